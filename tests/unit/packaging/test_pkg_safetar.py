from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import zstandard

from gpusnap.errors import IntegrityError
from gpusnap.packaging import api
from gpusnap.packaging.artifact import write_directory
from gpusnap.packaging.safetar import check_member
from gpusnap.packaging.store import OciStore


def _member(name: str, type_: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type = type_
    m.linkname = linkname
    return m


@pytest.mark.parametrize("name", ["../etc/passwd", "checkpoint/../../x", "a/./../../b", "/etc/passwd", "/"])
def test_escaping_names_are_refused(name: str) -> None:
    with pytest.raises(IntegrityError, match="refusing"):
        check_member(_member(name))


@pytest.mark.parametrize("target", ["/etc/passwd", "../../outside", "a/../../../x"])
def test_symlinks_pointing_outside_are_refused(target: str) -> None:
    with pytest.raises(IntegrityError, match="refusing"):
        check_member(_member("checkpoint/link", tarfile.SYMTYPE, target))


def test_symlinks_inside_are_fine() -> None:
    assert check_member(_member("checkpoint/link", tarfile.SYMTYPE, "../config.dump")) == "checkpoint/link"


def test_hard_link_outside_and_devices_are_refused() -> None:
    with pytest.raises(IntegrityError):
        check_member(_member("x", tarfile.LNKTYPE, "../../etc/shadow"))
    with pytest.raises(IntegrityError, match="device"):
        check_member(_member("dev", tarfile.CHRTYPE))


def _archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return path


@pytest.mark.parametrize("evil", [
    _member("../evil"),
    _member("/abs/evil"),
    _member("checkpoint/link", tarfile.SYMTYPE, "/etc"),
])
def test_store_refuses_malicious_podman_archive_and_keeps_nothing(tmp_path: Path, evil: tarfile.TarInfo) -> None:
    archive = _archive(tmp_path / "evil.tar.zst", [(_member("config.dump"), b"{}"), (_member("checkpoint/pages-1.img"), b"p" * 4096),
                                                    (evil, b"boom")])
    store = tmp_path / "store"
    with pytest.raises(IntegrityError, match="refusing"):
        api.store_checkpoint(store, archive, form="podman-archive", ref="gs-pkg/evil")
    s = OciStore(store)
    assert s.tags() == [] and list(s.ingest_dir.iterdir()) == []
    assert not (tmp_path / "evil").exists() and not (tmp_path.parent / "evil").exists()


def test_symlink_chain_cannot_write_outside(tmp_path: Path) -> None:
    # Each link alone stays inside; together they lead out. The realpath check catches it.
    entries = [
        (_member("x", tarfile.DIRTYPE), None),
        (_member("x/c", tarfile.SYMTYPE, ".."), None),
        (_member("a", tarfile.SYMTYPE, "x/c/.."), None),
    ]
    file_info = _member("a/escaped")
    file_info.size = 3
    entries.append((file_info, io.BytesIO(b"bad")))
    dest = tmp_path / "sub" / "out"
    with pytest.raises(IntegrityError):
        write_directory(iter(entries), dest)  # type: ignore[arg-type]
    assert not (tmp_path / "sub" / "escaped").exists() and not (tmp_path / "escaped").exists()
    assert not dest.exists()
    assert [p.name for p in (tmp_path / "sub").iterdir()] == []  # the partial directory went too
