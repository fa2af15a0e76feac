"""Where a restore writes its image directory: the tmpfs-or-disk rule of engines/imagedir.py."""

from __future__ import annotations

from pathlib import Path

from gpusnap.engines import imagedir

GIB = 1 << 30
MOUNTS = "\n".join([
    "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw",
    "25 22 0:23 / /run rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=26214400k,mode=755",
    "26 22 0:24 / /dev/shm rw,nosuid,nodev shared:6 - tmpfs tmpfs rw",
    "27 22 253:2 / /run/disk rw shared:7 - xfs /dev/vdb rw",
    "28 22 0:25 / /mnt/with\\040space rw shared:8 - tmpfs tmpfs rw",
])


def meminfo(avail_gib: float) -> str:
    return f"MemTotal:       134217728 kB\nMemFree:        1000 kB\nMemAvailable:   {int(avail_gib * GIB / 1024)} kB\n"


def test_the_filesystem_is_that_of_the_longest_mount_point() -> None:
    assert imagedir.fs_type(Path("/run/gpusnap/tmp"), MOUNTS) == "tmpfs"
    assert imagedir.fs_type(Path("/run/disk/x"), MOUNTS) == "xfs"
    assert imagedir.fs_type(Path("/runner"), MOUNTS) == "ext4"  # /run is not a prefix of /runner
    assert imagedir.fs_type(Path("/mnt/with space/a"), MOUNTS) == "tmpfs"
    assert imagedir.fs_type(Path("/x"), "garbage\n") == ""


def test_mem_available_reads_kilobytes() -> None:
    assert imagedir.mem_available(meminfo(100)) == 100 * GIB
    assert imagedir.mem_available("MemTotal: 5 kB\n") == 0


def test_an_image_that_fits_in_memory_goes_to_the_tmpfs(tmp_path: Path) -> None:
    # /run is tmpfs in MOUNTS; the probe path must exist: /run/gpusnap/tmp's nearest existing
    # ancestor is examined, so a fresh run dir is judged by /run.
    choice = imagedir.choose_base(Path("/run/gpusnap-test-not-there/tmp"), 5 * GIB, mountinfo=MOUNTS, meminfo=meminfo(100), room=25 * GIB)
    assert choice.memory, choice.reason


def test_too_little_room_or_memory_or_a_disk_keeps_the_disk() -> None:
    where = Path("/run/gpusnap-test-not-there/tmp")
    small = imagedir.choose_base(where, 33 * GIB, mountinfo=MOUNTS, meminfo=meminfo(100), room=25 * GIB)
    assert not small.memory and "free" in small.reason
    # twice the image and the margin: 2 x 20 + 4 = 44 GiB needed, 40 available
    tight = imagedir.choose_base(where, 20 * GIB, mountinfo=MOUNTS, meminfo=meminfo(40), room=60 * GIB)
    assert not tight.memory and "memory" in tight.reason
    disk = imagedir.choose_base(Path("/gpusnap-test-not-there/tmp"), 1 * GIB, mountinfo=MOUNTS, meminfo=meminfo(100), room=60 * GIB)
    assert not disk.memory and "not on a tmpfs (ext4)" in disk.reason


def test_image_size_comes_from_the_config() -> None:
    assert imagedir.image_bytes_of({"sizes": {"total": 1234}}) == 1234
    assert imagedir.image_bytes_of({"files": [{"size": 10}, {"size": 5}]}) == 15
    assert imagedir.image_bytes_of({}) == 0


def test_the_image_tmpfs_is_sized_for_twice_the_image_with_huge_pages() -> None:
    opts = imagedir.tmpfs_options(10 << 30).split(",")
    assert opts[0] == f"size={(20 << 10) + 256}m"
    assert {"huge=within_size", "mode=0700", "nosuid", "nodev", "noexec"} <= set(opts)


def test_the_image_tmpfs_is_mounted_under_the_work_dir(tmp_path: Path) -> None:
    calls: list[list[str]] = []
    where = imagedir.mount_tmpfs(tmp_path, 1 << 30, run=lambda argv: calls.append(argv) or 0)
    assert where == tmp_path / "images" and where.is_dir()
    assert calls == [["mount", "-t", "tmpfs", "-o", imagedir.tmpfs_options(1 << 30), imagedir.TMPFS_SOURCE, str(where)]]


def test_where_no_tmpfs_can_be_mounted_the_work_dir_is_used(tmp_path: Path) -> None:
    assert imagedir.mount_tmpfs(tmp_path, 1 << 30, run=lambda argv: 32) is None
    assert list(tmp_path.iterdir()) == []  # the mount point it made is gone again
    assert imagedir.mount_tmpfs(tmp_path, 0, run=lambda argv: 0) is None  # size unknown: no bound to give it
