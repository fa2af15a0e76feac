"""Checkpoints hold process memory: the store and what gpusnap writes from it are private.

Run under a permissive umask (022) so the modes come from gpusnap, not from the environment.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.packaging import api, crypto
from gpusnap.packaging.store import OciStore
from gpusnap.packaging.verify import verify_store


@pytest.fixture(autouse=True)
def permissive_umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _open_to_others(root: Path) -> list[str]:
    bad = []
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        if not p.is_symlink() and mode & 0o077:
            bad.append(f"{p.relative_to(root.parent)} {oct(mode)}")
    return bad


def _criu_dir(root: Path) -> Path:
    root.mkdir()
    for name, data in {"inventory.img": b"inv", "pages-1.img": os.urandom(2 << 20), "core-1.img": b"core"}.items():
        (root / name).write_bytes(data)
        (root / name).chmod(0o600)  # as CRIU writes them
    return root


def test_store_is_private(tmp_path: Path, ledger) -> None:  # type: ignore[no-untyped-def]
    store_dir = tmp_path / "var" / "store"
    api.store_checkpoint(store_dir, _criu_dir(tmp_path / "ck"), form="criu-dir", ref="gs-rel-perm:1")
    key = crypto.EncryptionConfig(master=crypto.MasterKey(os.urandom(32)))
    api.store_checkpoint(store_dir, _criu_dir(tmp_path / "ck2"), form="criu-dir", ref="gs-rel-perm:2", encryption=key)
    api.gc(store_dir)
    bad = _open_to_others(store_dir)
    checked = sum(1 for _ in store_dir.rglob("*")) + 1
    ledger.record("permissions", "local store", tried=checked, passed=checked - len(bad), detail="0700 dirs, 0600 files")
    assert bad == []
    assert verify_store(OciStore(store_dir)).readable_by_others == []


def test_materialized_checkpoint_is_private(tmp_path: Path, ledger) -> None:  # type: ignore[no-untyped-def]
    store_dir = tmp_path / "store"
    api.store_checkpoint(store_dir, _criu_dir(tmp_path / "ck"), form="criu-dir", ref="gs-rel-perm:1")
    out = api.materialize_checkpoint(store_dir, "gs-rel-perm:1", tmp_path / "restore" / "ck", form="criu-dir")
    arch = api.materialize_checkpoint(store_dir, "gs-rel-perm:1", tmp_path / "restore" / "ck.tar", form="criu-dir")
    bad = _open_to_others(out) + _open_to_others(arch)
    n = sum(1 for _ in out.rglob("*")) + 2
    ledger.record("permissions", "materialized checkpoint", tried=n, passed=n - len(bad), detail="restore input dir")
    assert bad == []


def test_key_files_are_private(tmp_path: Path, ledger) -> None:  # type: ignore[no-untyped-def]
    crypto.generate_master_key_file(tmp_path / "k")
    bad = [p for p in (tmp_path / "k",) if stat.S_IMODE(p.stat().st_mode) != 0o600]
    ledger.record("permissions", "key files", tried=1, passed=1 - len(bad), detail="0600")
    assert bad == []
