"""Where a restore writes the CRIU image directory: memory (tmpfs) when it fits, else disk.

The image directory of a restore is scratch: it is rebuilt from the store or the registry, CRIU
reads it once, and it is removed when the restore ends. So it is never fsynced (a host crash
loses nothing that the store or the registry does not still hold), and when the checkpoint
fits comfortably in free memory it goes on a tmpfs under the run directory, where writing it
costs a memcpy rather than page-cache writeback to a disk (1-1.3 GB/s on the GPU host, and
throttled once dirty pages pass the kernel's dirty limit: a 33 GB training checkpoint would be
written at disk speed).

The rule (:func:`choose_base`): the tmpfs is used when

* the directory is on a tmpfs (ramfs too) — /run is one on systemd hosts;
* that filesystem has room for the image plus ``ROOM_MARGIN``;
* MemAvailable covers twice the image plus ``MEMORY_MARGIN``: tmpfs pages cannot be reclaimed
  (no swap here), and while CRIU restores, the process's own copy of its memory exists beside
  the image (until the image directory is removed after the restore).

Otherwise the work directory under the state directory (disk) is used, as before. The image's
size is its apparent size (the config's ``sizes.total``): holes take no memory, so this errs
towards the disk.

In memory, the image directory is a tmpfs of its own (:func:`mount_tmpfs`), mounted with
transparent huge pages and sized to the image: a restore writes each pages file from many
transfers at once, and a file on a tmpfs takes one writer at a time (its inode lock), each
4 KiB page allocated on the way. On the H100 host 16 threads writing one file reached 2.3 GB/s
on a plain tmpfs and 7.3 GB/s on a huge-page one (bench/results/gpu-h100-pull-2026-11-25). Its
size bounds what a restore can take from memory, and a run killed mid-restore leaves a mount
the next run's sweep unmounts (workdirs.release). Where it cannot be mounted (not root, no
tmpfs) the directory is written where it was chosen, as before.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusnap.engines import workdirs

GIB = 1 << 30
ROOM_MARGIN = 256 << 20
MEMORY_MARGIN = 4 * GIB
MEMORY_FS = ("tmpfs", "ramfs")


@dataclass(frozen=True)
class Choice:
    memory: bool  # True: ``base`` is on a tmpfs
    reason: str  # one line for -v output: why this place


def fs_type(path: Path, mountinfo: str | None = None) -> str:
    """The filesystem type of the mount holding ``path`` (its longest mount-point prefix in
    /proc/self/mountinfo); "" when unknown."""
    real = os.path.realpath(path)
    best, kind = "", ""
    for point, fstype in workdirs.mount_table(mountinfo):
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def mem_available(meminfo: str | None = None) -> int:
    """MemAvailable in bytes (0 when unknown)."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            return 0
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            return int(parts[1]) * 1024 if len(parts) > 1 and parts[1].isdigit() else 0
    return 0


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def on_memory(path: Path, mountinfo: str | None = None) -> bool:
    return fs_type(nearest_existing(path), mountinfo) in MEMORY_FS


def choose_base(memory_dir: Path, image_bytes: int, *, mountinfo: str | None = None, meminfo: str | None = None,
                room: int | None = None) -> Choice:
    """Whether the image directory of ``image_bytes`` goes under ``memory_dir`` (see the module
    docstring for the rule). ``memory_dir``'s nearest existing ancestor is examined."""
    probe = nearest_existing(memory_dir)
    kind = fs_type(probe, mountinfo)
    if kind not in MEMORY_FS:
        return Choice(False, f"{memory_dir} is not on a tmpfs ({kind or 'unknown'})")
    have = free_bytes(probe) if room is None else room
    if have < image_bytes + ROOM_MARGIN:
        return Choice(False, f"{memory_dir} has {have >> 20} MiB free, the image needs {image_bytes >> 20} MiB")
    avail = mem_available(meminfo)
    if avail < 2 * image_bytes + MEMORY_MARGIN:
        return Choice(False, f"{avail >> 20} MiB of memory available, less than twice the image ({image_bytes >> 20} MiB) and a margin")
    return Choice(True, f"{memory_dir} (tmpfs, {have >> 20} MiB free, {avail >> 20} MiB of memory available)")


TMPFS_SOURCE = "gpusnap-images"  # the mount's source name: how its mounts show in /proc/self/mountinfo
TMPFS_OPTIONS = "huge=within_size,mode=0700,nosuid,nodev,noexec"


def tmpfs_options(image_bytes: int) -> str:
    """The image tmpfs's mount options: huge pages for the bytes within each file's size (the
    fetch sizes every file before writing it); room for twice the image and CRIU's own files,
    as the rule above asks of memory (a layer is received into a temporary file there and
    unpacked beside it), a bound rather than a reservation: a tmpfs takes memory as it is written."""
    size = -(-(2 * image_bytes + ROOM_MARGIN) // (1 << 20))
    return f"size={size}m,{TMPFS_OPTIONS}"


def mount_tmpfs(parent: Path, image_bytes: int, *, run: Callable[[list[str]], int] | None = None) -> Path | None:
    """``parent/images``, a huge-page tmpfs for an image directory of ``image_bytes``; None
    where it cannot be mounted (the caller writes under ``parent`` instead)."""
    if image_bytes <= 0:
        return None
    where = parent / "images"
    where.mkdir(mode=0o700, exist_ok=True)
    run = run or workdirs.run_quiet
    if run(["mount", "-t", "tmpfs", "-o", tmpfs_options(image_bytes), TMPFS_SOURCE, str(where)]) != 0:
        where.rmdir()
        return None
    return where


def image_bytes_of(config: dict[str, object]) -> int:
    """The apparent size of a checkpoint's files, from its artifact config."""
    sizes = config.get("sizes")
    if isinstance(sizes, dict) and isinstance(sizes.get("total"), int):
        return int(sizes["total"])
    files = config.get("files")
    if isinstance(files, list):
        return sum(int(f.get("size", 0)) for f in files if isinstance(f, dict))
    return 0


class ImageJob:
    """The image directory of a restore, written on a thread of its own in two stages.

    ``write(staged, cancel)`` writes the directory (``api.materialize_checkpoint`` or
    ``api.fetch_into``): it calls ``staged()`` once every file but the pages files is in place,
    and stops early (raising) once ``cancel`` is set. A writer that has no stages simply never
    calls ``staged``: the directory then counts as staged once it is whole. Meanwhile the
    restore checks the host and prepares the engine (bundle, root filesystem, network), which
    need only the small files; the engine waits (:meth:`wait`) just before CRIU starts.

    A failure of the writer is raised by :meth:`wait_staged` and :meth:`wait`; the writer has
    then left nothing at its destination. :meth:`stop` (always called by the restore, success
    or not) tells the writer to stop and joins it, so the image directory is never removed
    while a thread still writes into it.
    """

    def __init__(self, write: Callable[[Callable[[], None], threading.Event], object], name: str = "gpusnap-images",
                 landed: Any = None) -> None:
        self._write = write
        self.landed = landed  # gpusnap.criu.landed.LandedPages the writer reports to: told here how it ended
        self._staged = threading.Event()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self.error: BaseException | None = None
        self.result: object = None
        self.waited_s = 0.0  # seconds the restore spent in wait() (the pages it did not overlap)
        self.what = name  # what the writer does, for timings ("materialize", "pull into ...")
        self.seconds = 0.0  # how long the writer ran, start to end
        self._started = 0.0
        self._told_to_stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "ImageJob":
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.result = self._write(self._staged.set, self._cancel)
            if self.landed is not None:
                self.landed.complete()
        except BaseException as exc:  # noqa: BLE001 - raised where the restore waits for it
            self.error = exc
            self._told_to_stop = self._cancel.is_set()
            if self.landed is not None:
                self.landed.fail(str(exc) or type(exc).__name__)
        finally:
            self.seconds = time.perf_counter() - self._started
            self._staged.set()
            self._done.set()

    @property
    def failed(self) -> bool:
        """Whether the writer failed by itself (not because :meth:`stop` told it to)."""
        return self._done.is_set() and self.error is not None and not self._told_to_stop

    def wait_staged(self) -> None:
        """Until every file but the pages files is in place; the writer's error, if it failed."""
        self._staged.wait()
        if self.error is not None:
            raise self.error

    def wait(self) -> object:
        """Until the whole directory is in place; the writer's error, if it failed."""
        start = time.perf_counter()
        try:
            self._done.wait()
        finally:
            self.waited_s += time.perf_counter() - start
        if self.error is not None:
            raise self.error
        return self.result

    def stop(self) -> None:
        """Stop the writer if it still runs, and wait until it has."""
        if self._thread.is_alive():
            self._cancel.set()
            self._thread.join()
