"""Bad input against a real registry: it dies mid-transfer, it serves a corrupt blob."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from gs_pkg_containers import files_of
from stack.registry import Registry

from gpusnap.errors import IntegrityError, RegistryError
from gpusnap.packaging import api
from gpusnap.packaging.progress import NullProgress
from gpusnap.packaging.registry import RegistryClient, pull_artifact, push_artifact
from gpusnap.packaging.store import OciStore

pytestmark = pytest.mark.integration


def _checkpoint_dir(path: Path, mib: int, seed: int = 3) -> Path:
    path.mkdir(parents=True)
    rnd = random.Random(seed)
    (path / "pages-1.img").write_bytes(rnd.randbytes(mib << 20))
    (path / "pstree.img").write_bytes(b"\x19\x43\x56\x54\x30\x30\x27\x50")
    return path


class _KillAfter(NullProgress):
    """Kills the registry once ``limit`` bytes moved; optionally restarts it after ``pause`` s."""

    def __init__(self, reg: Registry, limit: int, restart_after: float | None) -> None:
        self.reg, self.limit, self.restart_after = reg, limit, restart_after
        self.moved = 0
        self.killed = threading.Event()
        self._lock = threading.Lock()

    def advance(self, n: int) -> None:
        with self._lock:
            self.moved += n
            if self.moved < self.limit or self.killed.is_set():
                return
            self.killed.set()
        self.reg.kill()
        if self.restart_after is not None:
            threading.Timer(self.restart_after, self.reg.start).start()


def test_push_resumes_after_registry_restart(tmp_path: Path, registry: Registry) -> None:
    src = _checkpoint_dir(tmp_path / "ck", 96)
    store = OciStore(tmp_path / "store")
    api.store_checkpoint(store.root, src, form="criu-dir", ref="gs-pkg/resume")
    # Small PATCH requests so the upload is interrupted in the middle of a chunked upload.
    client = RegistryClient(registry.host, insecure=True, retries=8, backoff_s=0.3, monolithic_limit=1 << 20,
                            patch_size=2 << 20, workers=2)
    killer = _KillAfter(registry, 30 << 20, restart_after=1.0)
    remote = f"{registry.host}/gs-pkg/resume:v1"
    result = push_artifact(store, "gs-pkg/resume", remote, progress=killer, client=client)
    assert killer.killed.is_set()
    assert client.recoveries, "the push should have recovered an interrupted chunked upload"
    print("recoveries (blob, failed at, resumed from):", client.recoveries)
    assert result.uploaded_bytes >= 96 << 20

    store2 = tmp_path / "store2"
    local = api.pull(store2, remote, insecure=True)
    out = api.materialize_checkpoint(store2, local, tmp_path / "out", form="criu-dir")
    assert files_of(out) == files_of(src)


def test_pull_from_dying_registry_leaves_nothing_behind(tmp_path: Path, registry: Registry) -> None:
    src = _checkpoint_dir(tmp_path / "ck", 64)
    store = tmp_path / "store"
    api.store_checkpoint(store, src, form="criu-dir", ref="gs-pkg/die")
    remote = f"{registry.host}/gs-pkg/die:v1"
    api.push(store, "gs-pkg/die", remote, insecure=True)

    target = OciStore(tmp_path / "store2")
    before = set(target.blobs_dir.iterdir())
    client = RegistryClient(registry.host, insecure=True, retries=3, backoff_s=0.1, workers=2)
    killer = _KillAfter(registry, 10 << 20, restart_after=None)
    t0 = time.monotonic()
    with pytest.raises(RegistryError):
        pull_artifact(target, remote, progress=killer, client=client)
    assert time.monotonic() - t0 < 60
    assert target.tags() == []
    assert set(target.blobs_dir.iterdir()) == before  # no blob, whole or partial, was kept
    assert list(target.ingest_dir.iterdir()) == []


def test_corrupt_blob_in_registry_is_rejected_and_never_stored(tmp_path: Path, registry: Registry) -> None:
    src = _checkpoint_dir(tmp_path / "ck", 8)
    store = tmp_path / "store"
    stored = api.store_checkpoint(store, src, form="criu-dir", ref="gs-pkg/bad")
    remote = f"{registry.host}/gs-pkg/bad:v1"
    api.push(store, "gs-pkg/bad", remote, insecure=True)
    layer = next(d for d in api.inspect(store, stored.ref).layers if d.role in ("pages", "pack"))  # v1 chunk or v2 pack
    # Flip bytes inside the registry's own copy of the blob (same size, different content).
    data_file = registry.root / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / layer.digest[7:9] / layer.digest[7:] / "data"
    raw = bytearray(data_file.read_bytes())
    raw[1000:1010] = b"0123456789"
    data_file.write_bytes(bytes(raw))

    target = OciStore(tmp_path / "store2")
    with pytest.raises(IntegrityError, match="digest mismatch"):
        api.pull(target.root, remote, insecure=True)
    assert not target.has_blob(layer.digest)
    assert target.tags() == [] and list(target.ingest_dir.iterdir()) == []
