"""runc-direct's overlay root filesystem: option checks, the writable layer's archive, records.
The mounts themselves are exercised for real in tests/integration/cli/test_overlay_rootfs.py."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tarfile
from pathlib import Path

import pytest

from gpusnap.config import load_settings
from gpusnap.engines.base import RestoreOptions
from gpusnap.engines.runc_direct import (
    BUNDLE_RECORD,
    OVERLAY_ROOTFS,
    RuncDirectEngine,
    RuncDirectRecord,
    overlay_paths,
)
from gpusnap.engines.upper import pack_upper, unpack_upper, unpack_upper_apart
from gpusnap.errors import NotFoundError, RestoreError, UsageError


@pytest.fixture
def engine(tmp_path: Path) -> RuncDirectEngine:
    return RuncDirectEngine(load_settings({"GPUSNAP_RUN_DIR": str(tmp_path / "run"), "GPUSNAP_STATE_DIR": str(tmp_path / "state"),
                                           "GPUSNAP_CONFIG": str(tmp_path / "none.toml")}))


def test_rootfs_and_overlay_exclude_each_other(engine: RuncDirectEngine, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="exclude each other"):
        engine.run("gs-demo-u1", ["true"], rootfs=str(tmp_path), rootfs_overlay="/")
    assert not engine.home.exists()  # refused before anything was made


def test_overlay_lower_must_exist(engine: RuncDirectEngine, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="is not a directory"):
        engine.run("gs-demo-u2", ["true"], rootfs_overlay=str(tmp_path / "absent"))
    assert not engine.home.exists()


def test_overlay_paths_are_inside_the_container_dir(engine: RuncDirectEngine) -> None:
    scratch, merged = overlay_paths(engine.container_dir("c"))
    assert scratch.parent == merged.parent == engine.container_dir("c") and scratch != merged


def test_old_records_read_without_overlay_field() -> None:
    rec = RuncDirectRecord.from_dict({"name": "a", "command": ["sh"], "rootfs": "busybox"})
    assert rec.overlay_lower == ""
    rec = RuncDirectRecord.from_dict({"name": "a", "command": ["sh"], "rootfs": OVERLAY_ROOTFS, "overlay_lower": "/"})
    assert (rec.rootfs, rec.overlay_lower) == ("overlay", "/")


@pytest.mark.skipif(os.geteuid() != 0, reason="a whiteout is a character device: mknod needs root")
@pytest.mark.parametrize("tar_binary", ["auto", None], ids=["gnu-tar", "tarfile"])
def test_upper_layer_round_trip_keeps_files_links_and_whiteouts(tmp_path: Path, tar_binary: str | None) -> None:
    upper = tmp_path / "upper"
    (upper / "usr" / "bin").mkdir(parents=True)
    (upper / "usr" / "bin" / "link_remap.3").write_bytes(b"\x7fELF...")
    os.chmod(upper / "usr" / "bin" / "link_remap.3", 0o755)
    (upper / "etc").mkdir()
    os.symlink("../usr/bin/link_remap.3", upper / "etc" / "alias")
    os.mknod(upper / "etc" / "gone", 0o600 | 0o020000, os.makedev(0, 0))  # overlayfs whiteout
    archive = tmp_path / "upper.tar"
    pack_upper(upper, archive)
    out = tmp_path / "out"
    out.mkdir()
    unpack_upper(archive, out, tar_binary=tar_binary)
    assert (out / "usr" / "bin" / "link_remap.3").read_bytes() == b"\x7fELF..."
    assert os.stat(out / "usr" / "bin" / "link_remap.3").st_mode & 0o777 == 0o755
    assert os.readlink(out / "etc" / "alias") == "../usr/bin/link_remap.3"
    st = os.lstat(out / "etc" / "gone")
    assert (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == os.makedev(0, 0)


def _tar_with(tmp_path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    path = tmp_path / "evil.tar"
    with tarfile.open(path, "w") as tar:
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data) if data else None)
    return path


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b"])
def test_unpack_refuses_entries_outside(tmp_path: Path, name: str) -> None:
    archive = _tar_with(tmp_path, tarfile.TarInfo(name), b"x")
    (tmp_path / "out").mkdir()
    with pytest.raises(RestoreError, match="outside the root filesystem"):
        unpack_upper(archive, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_unpack_refuses_a_hard_link_to_outside(tmp_path: Path) -> None:
    m = tarfile.TarInfo("etc/shadow-copy")
    m.type, m.linkname = tarfile.LNKTYPE, "../../etc/shadow"
    archive = _tar_with(tmp_path, m)
    (tmp_path / "out").mkdir()
    with pytest.raises(RestoreError, match="outside the root filesystem"):
        unpack_upper(archive, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tar") is None, reason="owners as packed need root; GNU tar")
def test_gnu_tar_unpack_keeps_numeric_owners_and_special_mode_bits(tmp_path: Path) -> None:
    """A container's /tmp keeps its sticky bit and a file keeps its numeric owner, even one
    this host has no name for (tarfile's "tar" filter clears the high mode bits)."""
    upper = tmp_path / "upper"
    (upper / "tmp").mkdir(parents=True)
    os.chmod(upper / "tmp", 0o1777)
    (upper / "tmp" / "f").write_text("x")
    os.chown(upper / "tmp" / "f", 54321, 54322)
    archive = tmp_path / "upper.tar"
    pack_upper(upper, archive)
    out = tmp_path / "out"
    out.mkdir()
    unpack_upper(archive, out)
    assert os.stat(out / "tmp").st_mode & 0o7777 == 0o1777
    st = os.stat(out / "tmp" / "f")
    assert (st.st_uid, st.st_gid) == (54321, 54322)


def test_unpack_refuses_real_device_files(tmp_path: Path) -> None:
    m = tarfile.TarInfo("dev/sda")
    m.type, m.devmajor, m.devminor = tarfile.BLKTYPE, 8, 0
    archive = _tar_with(tmp_path, m)
    (tmp_path / "out").mkdir()
    with pytest.raises(RestoreError, match="not an overlay whiteout"):
        unpack_upper(archive, tmp_path / "out")


def test_restore_refuses_when_the_lower_layer_is_missing(engine: RuncDirectEngine, tmp_path: Path) -> None:
    cp = tmp_path / "cp"
    cp.mkdir()
    record = {"name": "gs-demo-u3", "command": ["python3"], "rootfs": OVERLAY_ROOTFS, "overlay_lower": str(tmp_path / "gone")}
    (cp / BUNDLE_RECORD).write_text(json.dumps({"record": record, "spec": {}}))
    with pytest.raises(RestoreError, match="overlay lower directory .* is not on this host"):
        engine.restore(cp, RestoreOptions(name="gs-demo-u3"))
    assert not (engine.home / "containers" / "gs-demo-u3").exists()


def test_unpack_apart_is_the_same_unpack_in_a_child(tmp_path: Path) -> None:
    """The restore unpacks the writable layer in a child interpreter (no GIL shared with its
    writer threads): the same tree, and the same one-line refusal."""
    upper = tmp_path / "upper"
    (upper / "tmp" / "cache").mkdir(parents=True)
    (upper / "tmp" / "cache" / "k.py").write_text("x = 1\n")
    (upper / "big").write_bytes(os.urandom(3 << 20))
    os.mknod(upper / "gone", 0o600 | stat.S_IFCHR, os.makedev(0, 0))  # an overlay whiteout
    archive = tmp_path / "rootfs-upper.tar"
    pack_upper(upper, archive)
    out = tmp_path / "out"
    out.mkdir()
    unpack_upper_apart(archive, out)
    assert (out / "tmp" / "cache" / "k.py").read_text() == "x = 1\n"
    assert (out / "big").read_bytes() == (upper / "big").read_bytes()
    assert stat.S_ISCHR((out / "gone").lstat().st_mode)
    bad = _tar_with(tmp_path, tarfile.TarInfo("../escape"), b"x")
    (tmp_path / "out2").mkdir()
    with pytest.raises(RestoreError, match="outside the root filesystem"):
        unpack_upper_apart(bad, tmp_path / "out2")
    assert list((tmp_path / "out2").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tar") is None, reason="owners as packed need root; GNU tar")
def test_gnu_tar_and_tarfile_pack_the_same_members(tmp_path: Path) -> None:
    """GNU tar packs the layer (fast) where there is one, tarfile elsewhere: the same members,
    named from the layer's root, in name order, with the same owners, modes, links and data;
    and an unchanged layer packs to the same bytes (dedup across checkpoints)."""
    upper = tmp_path / "upper"
    (upper / "tmp" / "torchinductor" / "b").mkdir(parents=True)
    for i in range(50):
        (upper / "tmp" / "torchinductor" / "b" / f"k{i:02d}.py").write_text(f"x = {i}\n")
    (upper / "usr").mkdir()
    (upper / "usr" / "link_remap.7").write_bytes(os.urandom(70_000))
    os.link(upper / "usr" / "link_remap.7", upper / "usr" / "hard")
    os.symlink("../usr/link_remap.7", upper / "tmp" / "alias")
    os.chown(upper / "tmp" / "torchinductor" / "b" / "k07.py", 4321, 4322)
    os.mknod(upper / "gone", 0o600 | stat.S_IFCHR, os.makedev(0, 0))

    def members(archive: Path) -> list[tuple]:
        with tarfile.open(archive) as tar:
            return [(m.name, m.type, m.mode, m.uid, m.gid, m.linkname, m.size,
                     tar.extractfile(m).read() if m.isreg() else b"") for m in tar.getmembers()]

    gnu, py, again = tmp_path / "gnu.tar", tmp_path / "py.tar", tmp_path / "again.tar"
    pack_upper(upper, gnu)
    pack_upper(upper, py, tar_binary=None)
    pack_upper(upper, again)
    assert members(gnu) == members(py)
    names = [m[0].rstrip("/") for m in members(gnu)]
    assert names[0] == "gone" and "tmp/torchinductor/b/k07.py" in names and not any(n.startswith(("/", "./")) for n in names)
    assert gnu.read_bytes() == again.read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    unpack_upper(gnu, out)
    assert (out / "usr" / "hard").read_bytes() == (upper / "usr" / "link_remap.7").read_bytes()
    assert os.stat(out / "usr" / "hard").st_ino == os.stat(out / "usr" / "link_remap.7").st_ino
    assert os.stat(out / "tmp" / "torchinductor" / "b" / "k07.py").st_uid == 4321


def test_an_empty_layer_packs_to_an_empty_archive(tmp_path: Path) -> None:
    (tmp_path / "upper").mkdir()
    pack_upper(tmp_path / "upper", tmp_path / "a.tar")
    with tarfile.open(tmp_path / "a.tar") as tar:
        assert tar.getmembers() == []


def test_a_failing_pack_is_one_line_and_leaves_no_archive(tmp_path: Path) -> None:
    from gpusnap.errors import CheckpointError

    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "f").write_text("x")
    archive = tmp_path / "a.tar"
    tar = tmp_path / "tar"  # a tar that starts writing, then fails as GNU tar does (status 2)
    tar.write_text('#!/bin/sh\necho partial > "$3"\necho "tar: f: Cannot open: Input/output error" >&2\nexit 2\n')
    tar.chmod(0o755)
    with pytest.raises(CheckpointError, match="cannot pack the writable layer .*: tar: f: Cannot open: Input/output error$") as info:
        pack_upper(upper, archive, tar_binary=str(tar))
    assert "\n" not in str(info.value) and not archive.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tar", "upper"], "the partial archive is removed too"


def test_the_archive_appears_only_whole(tmp_path: Path) -> None:
    # The store that follows the image directory takes a large file as soon as it is there:
    # tar writes under a hidden name, renamed once it succeeded.
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "f").write_text("x")
    archive = tmp_path / "img" / "rootfs-upper.tar"
    archive.parent.mkdir()
    tar = tmp_path / "tar"
    tar.write_text(f'#!/bin/sh\n[ -e "{archive}" ] && echo seen > "{tmp_path}/seen"\necho "$3" > "$3"\nexit 0\n')
    tar.chmod(0o755)
    pack_upper(upper, archive, tar_binary=str(tar))
    assert not (tmp_path / "seen").exists()
    assert archive.read_text().strip() == str(archive.parent / ".rootfs-upper.tar.partial")
    assert [p.name for p in archive.parent.iterdir()] == ["rootfs-upper.tar"]


def test_early_pack_waits_for_the_dump_then_packs_beside_the_runtime(tmp_path: Path) -> None:
    import time

    from gpusnap.engines.upper import EarlyPack

    upper = tmp_path / "upper"
    (upper / "tmp").mkdir(parents=True)
    (upper / "tmp" / "cache.py").write_text("x = 1\n")
    archive, ready = tmp_path / "img" / "rootfs-upper.tar", tmp_path / "img" / "stats-dump"
    archive.parent.mkdir()
    pack = EarlyPack(upper, archive, ready, poll_s=0.001).start()
    time.sleep(0.05)
    assert not archive.exists(), "nothing is packed before CRIU's dump is over"
    (upper / "usr").mkdir()
    (upper / "usr" / "link_remap.3").write_text("made by the dump")  # CRIU's link-remap file, before stats-dump
    ready.write_text("")
    assert pack.finish() is True
    with tarfile.open(archive) as tar:
        assert {"tmp/cache.py", "usr/link_remap.3"} <= set(tar.getnames())


def test_early_pack_without_a_finished_dump_packs_nothing(tmp_path: Path) -> None:
    from gpusnap.engines.upper import EarlyPack

    (tmp_path / "upper").mkdir()
    archive = tmp_path / "rootfs-upper.tar"
    pack = EarlyPack(tmp_path / "upper", archive, tmp_path / "stats-dump", poll_s=0.001).start()
    assert pack.finish() is False and not archive.exists()
    again = EarlyPack(tmp_path / "upper", archive, tmp_path / "stats-dump", poll_s=0.001).start()
    (tmp_path / "stats-dump").write_text("")
    again.cancel()  # a runtime that failed after the dump: the archive goes with the images
    assert not archive.exists()
