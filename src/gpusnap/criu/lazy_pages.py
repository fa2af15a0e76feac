"""gpusnap's page server for CRIU's lazy restore (``runc restore --lazy-pages``), over userfaultfd.

With ``--lazy-pages`` CRIU restores a process without copying its private anonymous memory: it
registers those mappings with a userfaultfd, hands the descriptor to a page server listening on
``lazy-pages.socket`` in its work directory, and lets the process go. The server fills the
pages with ``UFFDIO_COPY`` — the ones a thread touches first (a page fault it is told about),
the rest in the background. For a GPU container this is what the CUDA driver's restore wants:
it reads the checkpointed device memory out of the process's host memory, so the pages can be
filled while it copies them to the GPU instead of all before it starts.

Why not ``criu lazy-pages``: it copies one range at a time from one thread, from a buffer it
reads the image into (bench/results/gpu-h200-lazy-pages-2026-11-25: ~1.2 GB/s, slower than the
eager restore it replaces). This server maps the pages files (on the restore's tmpfs) and copies
straight from them, in large ranges, on a pool of threads (the ioctl releases the interpreter
lock), starting where the last fault was, so that a reader going through memory in order finds
its pages there. There is no library for the server side of CRIU's protocol; the facts used:

* The socket protocol (criu/uffd.c): one stream connection from the restore; per task of the
  tree an ``int`` pid (negative for a zombie, then nothing more) followed by the userfaultfd as
  SCM_RIGHTS on one dummy byte; at the end the ``uint32`` 0x52535446 ("restore finished"),
  then the restore closes the connection. A task's pages are its ``pagemap-<pid>.img`` entries
  flagged PE_LAZY, laid out in ``pages-<pages_id>.img`` as the eager restore reads them; a copy
  must stay inside one mapping (``mm-<pid>.img``), so ranges are cut at mapping ends.
* The mappings are registered in the restorer, after the descriptor is sent: background copies
  start once the restore says it finished (before that only faults are served).
* The events (linux/userfaultfd.h, the features CRIU asks for): a page fault; fork (a new
  descriptor for the child, whose missing pages are the parent's at that moment); mremap (the
  missing pages moved); munmap and MADV_DONTNEED/REMOVE (no longer to be filled: a copy after
  the event would bring back memory the process dropped). While such an event waits to be read,
  copies fail with EAGAIN; once it is read the process goes on changing its memory. So events
  are read only while no copy of that task is in flight (a per-task lock that copies share and
  the event reader takes alone), and what they change is applied before the next copy.
* A page the process touches that no lazy entry holds was never written before the dump: it
  gets the zero page. A copy of a range a fault raced with ends in EEXIST for the present page.

The process must not lose this server before its last page is in: the kernel would then fill
the missing pages with zeros. So it runs in a session of its own (a ^C or the death of the
``gpusnap`` that started it does not reach it), and ``gpusnap restore`` returns only after it
reported every page copied; if it fails instead, the restore removes the container and fails.
"""

from __future__ import annotations

import argparse
import bisect
import ctypes
import errno
import fcntl
import json
import mmap
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.criu.landed import PAGES_NAME, Intervals, LedgerFollower, wanted_path
from gpusnap.criu.pagemap import PAGE_SIZE, PagemapReader
from gpusnap.criu.images import ImageFormatError, decode_message, read_entries

SOCKET_NAME = "lazy-pages.socket"
RESTORE_FINISHED = 0x52535446
MM_MAGIC = 0x57492820
READY = b"ready\n"

# linux/userfaultfd.h: _IOWR/_IOR(0xAA, nr, struct), the same on x86_64 and arm64.
UFFDIO_UNREGISTER = 0x8010AA01
UFFDIO_WAKE = 0x8010AA02
UFFDIO_COPY = 0xC028AA03
UFFDIO_ZEROPAGE = 0xC020AA04
EVENT_PAGEFAULT, EVENT_FORK, EVENT_REMAP, EVENT_REMOVE, EVENT_UNMAP = 0x12, 0x13, 0x14, 0x15, 0x16
MSG_SIZE = 32

CHUNK = 4 << 20  # one background copy
FAULT_CHUNK = 1 << 20  # the copy that answers a fault (from the faulting page on)


class LazyPagesError(Exception):
    """The images cannot be served lazily, or serving failed."""


@dataclass
class Interval:
    start: int  # virtual address, page-aligned
    end: int
    src: int  # address, in this process, of the bytes for ``start``


class Pending:
    """The ranges of one process still to copy: sorted, disjoint intervals with their source."""

    def __init__(self, items: list[Interval] | None = None) -> None:
        self.items: list[Interval] = sorted(items or [], key=lambda i: i.start)
        self.starts = [i.start for i in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def bytes(self) -> int:
        return sum(i.end - i.start for i in self.items)

    def copy(self) -> "Pending":
        return Pending([Interval(i.start, i.end, i.src) for i in self.items])

    def _index_at_or_after(self, addr: int) -> int:
        k = bisect.bisect_right(self.starts, addr) - 1
        if k >= 0 and self.items[k].end > addr:
            return k
        return k + 1

    def find(self, addr: int) -> Interval | None:
        k = bisect.bisect_right(self.starts, addr) - 1
        if k >= 0 and self.items[k].start <= addr < self.items[k].end:
            return self.items[k]
        return None

    def take(self, start: int, end: int) -> list[Interval]:
        """Remove [start, end) and return the parts of it that were pending."""
        out: list[Interval] = []
        k = self._index_at_or_after(start)
        while k < len(self.items) and self.items[k].start < end:
            it = self.items[k]
            lo, hi = max(it.start, start), min(it.end, end)
            out.append(Interval(lo, hi, it.src + (lo - it.start)))
            pieces = []
            if it.start < lo:
                pieces.append(Interval(it.start, lo, it.src))
            if hi < it.end:
                pieces.append(Interval(hi, it.end, it.src + (hi - it.start)))
            self.items[k:k + 1] = pieces
            self.starts[k:k + 1] = [p.start for p in pieces]
            k += len(pieces)
        return out

    def next_chunk(self, cursor: int, size: int) -> Interval | None:
        """The next ``size`` bytes (at most, within one interval) from ``cursor`` on, wrapping."""
        if not self.items:
            return None
        k = self._index_at_or_after(cursor)
        if k >= len(self.items):
            k = 0
        it = self.items[k]
        lo = max(it.start, cursor) if it.start <= cursor < it.end else it.start
        got = self.take(lo, min(it.end, lo + size))
        return got[0]

    def put(self, iv: Interval) -> None:
        """Give back a range taken and not copied (it overlaps nothing pending)."""
        if iv.end <= iv.start:
            return
        k = bisect.bisect_left(self.starts, iv.start)
        self.items.insert(k, iv)
        self.starts.insert(k, iv.start)

    def move(self, frm: int, to: int, length: int) -> None:
        for iv in self.take(frm, frm + length):
            self.put(Interval(iv.start - frm + to, iv.end - frm + to, iv.src))


class SharedExclusive:
    """A lock copies share and the event reader takes alone, the reader first in line once it
    asks (else a pool of copiers would keep it out). The stdlib has no such lock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if not self._shared:
                self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True

    def release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()


@dataclass
class Stats:
    copied_bytes: int = 0
    fault_bytes: int = 0  # of copied_bytes, copied to answer a fault
    faults: int = 0
    zero_pages: int = 0
    copies: int = 0
    dropped_bytes: int = 0  # pending bytes the process unmapped or dropped before they were copied
    deferred_faults: int = 0  # faults on pages not yet written when they came (answered once they were)
    events: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Task:
    """One process's userfaultfd and what is still missing in it."""

    def __init__(self, pid: int, uffd: int, pending: Pending) -> None:
        self.pid = pid
        self.uffd = uffd
        self.pending = pending
        self.total = pending.bytes()
        self.mu = threading.Lock()  # pending, inflight, cursor
        self.gate = SharedExclusive()  # copies (shared) against reading events (exclusive)
        self.inflight: list[Interval] = []
        self.cursor = pending.items[0].start if pending.items else 0
        self.gone = False  # the process exited: nothing more to copy
        # Where each source byte goes, as it was when the task came (a pages file range lands
        # by file offset; this finds its addresses). Events may move ranges since: a range
        # not where this says is copied once everything has landed, by the cursor.
        self.by_src = sorted((iv.src, iv.start, iv.end) for iv in pending.items)
        self.src_starts = [s for s, _, _ in self.by_src]

    def addresses_of(self, src_lo: int, src_hi: int) -> list[tuple[int, int]]:
        """The address ranges whose source was [src_lo, src_hi) when the task came."""
        out = []
        k = max(0, bisect.bisect_right(self.src_starts, src_lo) - 1)
        while k < len(self.by_src) and self.by_src[k][0] < src_hi:
            src, start, end = self.by_src[k]
            lo, hi = max(src, src_lo), min(src + (end - start), src_hi)
            if lo < hi:
                out.append((start + (lo - src), start + (hi - src)))
            k += 1
        return out

    def done(self) -> bool:
        with self.mu:
            return self.gone or (not self.pending.items and not self.inflight)

    def in_flight(self, addr: int) -> bool:
        return any(iv.start <= addr < iv.end for iv in self.inflight)


def _ioctl(fd: int, request: int, buf: bytearray) -> int:
    """The ioctl's errno, 0 on success (``buf`` is updated in place)."""
    try:
        fcntl.ioctl(fd, request, buf, True)
        return 0
    except OSError as exc:
        return exc.errno or errno.EIO


def uffd_copy(uffd: int, dst: int, src: int, length: int) -> tuple[int, int]:
    """(bytes copied, errno): a copy that stopped early says how far it got."""
    buf = bytearray(struct.pack("<QQQQq", dst, src, length, 0, 0))
    err = _ioctl(uffd, UFFDIO_COPY, buf)
    done = struct.unpack_from("<q", buf, 32)[0]
    if not err:
        return length, 0
    return max(done, 0), err


def uffd_zeropage(uffd: int, start: int, length: int) -> int:
    buf = bytearray(struct.pack("<QQQq", start, length, 0, 0))
    return _ioctl(uffd, UFFDIO_ZEROPAGE, buf)


def uffd_range(uffd: int, request: int, start: int, length: int) -> int:
    return _ioctl(uffd, request, bytearray(struct.pack("<QQ", start, length)))


MADV_DONTNEED = 4


def _libc() -> Any:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


# What CRIU's lazy restore asks of the kernel (criu/uffd.c NEED_UFFD_API_FEATURES): the events.
UFFDIO_API = 0xC018AA3F
UFFD_API = 0xAA
NEEDED_FEATURES = {"EVENT_FORK": 1 << 1, "EVENT_REMAP": 1 << 2, "EVENT_REMOVE": 1 << 3, "EVENT_UNMAP": 1 << 6}
SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}


def host_support(machine: str | None = None) -> tuple[bool, str]:
    """(whether this kernel gives this process a userfaultfd with the events CRIU's lazy restore
    needs, why not). Opens one and closes it: a microsecond, no CRIU."""
    nr = SYS_USERFAULTFD.get(machine or os.uname().machine)
    if nr is None:
        return False, f"no userfaultfd system call known for {machine or os.uname().machine}"
    fd = _libc().syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        return False, f"userfaultfd: {os.strerror(ctypes.get_errno())}"
    try:
        want = sum(NEEDED_FEATURES.values())
        buf = bytearray(struct.pack("<QQQ", UFFD_API, want, 0))
        err = _ioctl(fd, UFFDIO_API, buf)
        if err:
            return False, f"userfaultfd lacks {', '.join(NEEDED_FEATURES)} ({os.strerror(err)})"
        got = struct.unpack_from("<Q", buf, 8)[0]
        missing = [k for k, v in NEEDED_FEATURES.items() if not got & v]
        return (not missing), (f"userfaultfd lacks {', '.join(missing)}" if missing else "")
    finally:
        os.close(fd)


def mapping_ends(mm_image: bytes) -> list[tuple[int, int]]:
    """(start, end) of every mapping in ``mm-<pid>.img`` (MmEntry.vmas = 14; VmaEntry start 1, end 2)."""
    entries = read_entries(mm_image, MM_MAGIC)
    if not entries:
        raise ImageFormatError("mm image without an entry")
    out = []
    for raw in decode_message(entries[0]).get(14, []):
        f = decode_message(raw)
        out.append((int(f[1][0]), int(f[2][0])))
    return sorted(out)


@dataclass(frozen=True)
class LazyRange:
    vaddr: int
    file_offset: int
    length: int


def lazy_ranges(pagemap_image: bytes, vmas: list[tuple[int, int]]) -> tuple[int, list[LazyRange]]:
    """(pages_id, the lazy ranges of a pagemap image, cut at mapping ends)."""
    reader = PagemapReader()
    reader.feed(pagemap_image)
    if reader.pending or reader.pages_id is None:
        raise ImageFormatError("pagemap image is truncated")
    if reader.lazy_not_present:
        raise LazyPagesError("the checkpoint leaves lazy pages out of its pages files (dumped with --lazy-pages); it cannot be served from them")
    ends = [e for _, e in vmas]
    out: list[LazyRange] = []
    for r, lazy in zip(reader.ranges, reader.lazy, strict=True):
        if not lazy:
            continue
        start, end, off = r.vaddr, r.vaddr + r.nr_pages * PAGE_SIZE, r.file_offset
        while start < end:
            k = bisect.bisect_right(ends, start)
            stop = min(end, ends[k]) if k < len(ends) else end
            out.append(LazyRange(start, off, stop - start))
            off += stop - start
            start = stop
    return reader.pages_id, out


class PagesFiles:
    """The image directory's pages files, mapped once each, read-only to the server."""

    def __init__(self, images: Path) -> None:
        self.images = images
        self._maps: dict[int, tuple[mmap.mmap, int, Any]] = {}
        self._lock = threading.Lock()
        self._libc = _libc()
        self._spans: list[tuple[int, int, int]] = []  # (address, size, pages_id), by address

    def locate(self, src: int) -> tuple[int, int] | None:
        """(pages_id, file offset) of the mapped byte at ``src``."""
        k = bisect.bisect_right(self._spans, (src, 1 << 64, 0)) - 1
        if k >= 0:
            addr, size, pid = self._spans[k]
            if addr <= src < addr + size:
                return pid, src - addr
        return None

    def base(self, pages_id: int) -> tuple[int, int]:
        """(address, size) of pages-<pages_id>.img mapped in this process."""
        with self._lock:
            if pages_id not in self._maps:
                path = self.images / f"pages-{pages_id}.img"
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if not size:
                        self._maps[pages_id] = (None, 0, None)  # type: ignore[assignment]
                    else:
                        # A private, writable view only so that ctypes gives its address; it is
                        # never written, so it shares the file's pages.
                        m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                        anchor = ctypes.c_char.from_buffer(m)
                        self._maps[pages_id] = (m, size, anchor)
                        bisect.insort(self._spans, (ctypes.addressof(anchor), size, pages_id))
            m, size, anchor = self._maps[pages_id]
            return (ctypes.addressof(anchor) if anchor is not None else 0), size

    def release(self, src: int, length: int) -> None:
        """Drop this process's view of pages already copied: they stay in the image directory's
        files, but the server's resident size stays that of the copies in flight, whatever the
        checkpoint's size."""
        if length > 0:
            self._libc.madvise(ctypes.c_void_p(src), ctypes.c_size_t(length), MADV_DONTNEED)

    def close(self) -> None:
        with self._lock:
            self._maps.clear()  # the maps go with their last reference (the ctypes anchors hold them)


def task_pending(images: Path, pid: int, files: PagesFiles) -> Pending:
    try:
        vmas = mapping_ends((images / f"mm-{pid}.img").read_bytes())
        pages_id, ranges = lazy_ranges((images / f"pagemap-{pid}.img").read_bytes(), vmas)
    except (OSError, ImageFormatError) as exc:
        raise LazyPagesError(f"cannot read the memory images of process {pid}: {exc}") from exc
    if not ranges:
        return Pending()
    base, size = files.base(pages_id)
    items = []
    for r in ranges:
        if r.file_offset + r.length > size:
            raise LazyPagesError(f"pages-{pages_id}.img is shorter than its pagemap says; the checkpoint is damaged")
        items.append(Interval(r.vaddr, r.vaddr + r.length, base + r.file_offset))
    return Pending(items)


class Server:
    """Serves one restore: ``listen``, then ``run`` until every page of every task is in."""

    def __init__(self, images: Path, work: Path, *, threads: int = 8, log: Any = None, landed: Path | None = None) -> None:
        self.images = images
        self.work = work
        self.threads = max(1, threads)
        self.files = PagesFiles(images)
        self.stats = Stats()
        self.stats_mu = threading.Lock()
        self.tasks: list[Task] = []
        self.tasks_mu = threading.Lock()
        self.work_cv = threading.Condition()
        self.finished = False  # the restore said it finished: mappings are registered
        self.failure: str | None = None
        self.log = log
        self.listener: socket.socket | None = None
        self.started = time.monotonic()
        self.times: dict[str, float] = {}
        # ``landed``: the pages files are still being written (gpusnap.criu.landed); only
        # ranges the ledger says are in are copied, a fault on any other waits for it.
        self.ledger = landed
        self.landed_all = landed is None
        self.landed: dict[int, Intervals] = {}
        self.landed_mu = threading.Lock()
        self.landed_queue: deque[tuple[int, int, int]] = deque()  # (pages_id, offset, end), CHUNK at most
        self.deferred: list[tuple[Task, int]] = []  # faults on pages not in yet: (task, page)
        self.asked: set[tuple[int, int]] = set()  # (pages_id, MiB) asked of the writer already
        self.wanted_fd = -1
        if landed is not None:  # the writer fetches what a fault waits for next
            try:
                self.wanted_fd = os.open(wanted_path(landed), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            except OSError:
                self.wanted_fd = -1  # only an ordering hint: the pages come in file order then

    def say(self, text: str) -> None:
        if self.log is not None:
            print(f"{time.monotonic() - self.started:8.3f} {text}", file=self.log, flush=True)

    def listen(self) -> None:
        (self.work / SOCKET_NAME).unlink(missing_ok=True)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # CRIU connects to the name relative to its work directory; a socket's path is limited
        # to 107 bytes, which a work directory deep in a state directory passes: bound through
        # a descriptor of the directory instead.
        dfd = os.open(self.work, os.O_PATH | os.O_DIRECTORY)
        try:
            s.bind(f"/proc/self/fd/{dfd}/{SOCKET_NAME}")
        except OSError:
            s.close()
            raise
        finally:
            os.close(dfd)
        s.listen(4)
        self.listener = s

    # -- the restore's connection ---------------------------------------------------------
    def receive(self, timeout: float) -> None:
        """Take the restore's connection and its tasks, until it says it finished. ``timeout``
        (0: none) bounds the wait for the connection; so does the death of the process that
        started the server (a restore waits for its images first, as long as a pull takes)."""
        assert self.listener is not None
        parent = os.getppid()
        deadline = time.monotonic() + timeout if timeout else None
        try:
            while True:
                ready, _, _ = select.select([self.listener], [], [], 1.0)
                if ready:
                    conn, _ = self.listener.accept()
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise LazyPagesError(f"no restore connected within {timeout:g} s")
                if os.getppid() != parent:
                    raise LazyPagesError("the gpusnap restore that started this server is gone, and no restore connected")
        finally:
            self.listener.close()
            (self.work / SOCKET_NAME).unlink(missing_ok=True)
        conn.settimeout(None)
        with conn:
            while True:
                raw = conn.recv(4, socket.MSG_WAITALL)  # short only if the restore closed it
                if len(raw) < 4:
                    raise LazyPagesError("the restore closed its connection before it finished (CRIU failed; see its log)")
                (word,) = struct.unpack("<i", raw)
                if word == RESTORE_FINISHED:
                    break
                if word < 0:
                    self.say(f"zombie {-word}")
                    continue
                _, fds, _, _ = socket.recv_fds(conn, 1, 1)
                if len(fds) != 1:
                    raise LazyPagesError(f"the restore sent process {word} without its userfaultfd")
                try:
                    os.set_blocking(fds[0], False)
                    pending = task_pending(self.images, word, self.files)
                except BaseException:
                    os.close(fds[0])
                    raise
                self.add_task(Task(word, fds[0], pending))
        self.times["restore_finished_s"] = round(time.monotonic() - self.started, 3)
        self.say("restore finished")
        with self.work_cv:
            self.finished = True
            self.work_cv.notify_all()

    def add_task(self, task: Task) -> None:
        self.say(f"process {task.pid}: {task.total} bytes lazy in {len(task.pending)} ranges")
        with self.tasks_mu:
            self.tasks.append(task)
        with self.work_cv:
            self.work_cv.notify_all()

    # -- pages still being written ----------------------------------------------------------
    def landed_run(self, src: int, length: int) -> int:
        """How many bytes from ``src`` (whole pages, at most ``length``) are in the pages files."""
        if self.landed_all:
            return length
        where = self.files.locate(src)
        if where is None:
            return 0
        pages_id, off = where
        with self.landed_mu:
            got = self.landed.get(pages_id)
            end = got.run_end(off, off + length) if got is not None else off
        return (end - off) & ~(PAGE_SIZE - 1)

    def clip_landed(self, task: Task, iv: Interval) -> Interval | None:
        """``iv`` (just taken, under ``task.mu``) cut to its part that is in; the rest goes back."""
        n = self.landed_run(iv.src, iv.end - iv.start)
        if n >= iv.end - iv.start:
            return iv
        task.pending.put(Interval(iv.start + n, iv.end, iv.src + n))
        return Interval(iv.start, iv.start + n, iv.src) if n else None

    def follow_ledger(self) -> None:
        """Reads the ledger as the writer appends to it, until every range is in."""
        assert self.ledger is not None
        try:
            follower = LedgerFollower(self.ledger)
        except OSError as exc:
            self.fail(f"cannot read the ledger of the pages being written: {exc}")
            return
        try:
            while self.failure is None and not self.landed_all:
                entries = follower.read()
                if not entries:
                    time.sleep(0.002)
                    continue
                fresh = False
                for kind, name, off, length in entries:
                    if kind == "!":
                        self.fail(f"the checkpoint's pages could not be written: {name}")
                        return
                    if kind == "=":
                        self.landed_all = True
                        self.times["landed_all_s"] = round(time.monotonic() - self.started, 3)
                        self.say("every page is in the pages files")
                        continue
                    m = PAGES_NAME.match(name)
                    if m is None:
                        continue
                    pages_id = int(m.group(1))
                    # Queued by whole pages: a page a piece ends in is copied with the piece
                    # that completes it (clip_landed checks every byte of it is in).
                    first, end = off & ~(PAGE_SIZE - 1), (off + length + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)
                    with self.landed_mu:
                        self.landed.setdefault(pages_id, Intervals()).add(off, off + length)
                        for lo in range(first, end, CHUNK):
                            self.landed_queue.append((pages_id, lo, min(end, lo + CHUNK)))
                    fresh = True
                if fresh or self.landed_all:
                    self.retry_deferred()
                    with self.work_cv:
                        self.work_cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - reported by run()
            self.fail(f"reading the ledger of the pages being written: {exc}")
        finally:
            follower.close()

    def ask_for(self, where: tuple[int, int] | None) -> None:
        """Tell the writer a fault waits for the page at ``where`` ((pages_id, file offset), from
        ``files.locate``), once per MiB of a file."""
        if where is None or self.wanted_fd < 0:
            return
        pages_id, off = where
        with self.landed_mu:
            if (pages_id, off >> 20) in self.asked:
                return
            self.asked.add((pages_id, off >> 20))
        try:
            os.write(self.wanted_fd, f"pages-{pages_id}.img {off}\n".encode())
        except OSError:
            pass  # a hint only

    def retry_deferred(self) -> None:
        """Answer again the faults whose pages have landed since."""
        with self.landed_mu:
            waiting, self.deferred = self.deferred, []
        for task, page in waiting:
            if not task.gone:
                self.answer_page(task, page)

    def copy_landed(self) -> bool:
        """One background copy while the pages are still being written: of a range that has
        landed, in the order they land; False when none is queued."""
        with self.landed_mu:
            if not self.landed_queue:
                return False
            pages_id, off, end = self.landed_queue.popleft()
        base, _ = self.files.base(pages_id)
        with self.tasks_mu:
            tasks = list(self.tasks)
        for task in tasks:
            for lo, hi in task.addresses_of(base + off, base + end):

                def choose(task: Task = task, lo: int = lo, hi: int = hi) -> Interval | None:
                    got = None
                    for iv in task.pending.take(lo, hi):
                        if got is None:
                            got = self.clip_landed(task, iv)  # puts back what is not in
                        else:
                            task.pending.put(iv)  # the next call's
                    return got

                while self.copy_taken(task, choose, fault=False):
                    pass
        return True

    # -- copying ---------------------------------------------------------------------------
    def count(self, **kw: int) -> None:
        with self.stats_mu:
            for k, v in kw.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def copy_taken(self, task: Task, choose: Any, *, fault: bool, gate: bool = True) -> bool:
        """Take a range out of ``task.pending`` with ``choose`` (called under ``task.mu``; None:
        nothing to take) and copy it, all under the task's shared lock: taken and in flight are
        one step, so a fault never finds its page in neither (it would get a zero page), and no
        event is applied between the taking and the copy (it would not see the range).
        ``gate``: False when the caller holds the shared lock already."""
        if gate:
            task.gate.acquire_shared()
        try:
            with task.mu:
                iv = None if task.gone else choose()
                if iv is None:
                    return False
                task.inflight.append(iv)
            self._copy(task, iv, fault=fault)
            return True
        finally:
            if gate:
                task.gate.release_shared()
            with self.work_cv:
                self.work_cv.notify_all()

    def _copy(self, task: Task, iv: Interval, *, fault: bool) -> None:
        """The copy of an in-flight range (copy_taken); what could not be copied yet goes back."""
        back: Interval | None = None
        try:
            dst, src, left = iv.start, iv.src, iv.end - iv.start
            limit = left
            while left > 0:
                n = min(left, limit)
                done, err = uffd_copy(task.uffd, dst, src, n)
                if done:
                    self.count(copied_bytes=done, copies=1, **({"fault_bytes": done} if fault else {}))
                dst, src, left = dst + done, src + done, left - done
                if done:
                    self.files.release(src - done, done)
                if not err:
                    continue
                if err == errno.EEXIST:  # that page is in already (a fault raced): skip it
                    dst, src, left = dst + PAGE_SIZE, src + PAGE_SIZE, left - PAGE_SIZE
                    continue
                if err == errno.EAGAIN:  # an event waits to be read: retry after it
                    back = Interval(dst, dst + left, src)
                    break
                if err in (errno.ESRCH, errno.ENOSPC):  # the process exited
                    self.say(f"process {task.pid}: copy at {dst:#x} (+{left}): {errno.errorcode.get(err)}: gone")
                    task.gone = True
                    break
                if err == errno.ENOENT:
                    if not self.finished:  # not registered yet
                        back = Interval(dst, dst + left, src)
                        break
                    # The range now spans two mappings (an mprotect split it; no event says so):
                    # smaller copies, down to the page; a page in no registered mapping is dropped.
                    if n > PAGE_SIZE:
                        limit = max(PAGE_SIZE, (n // 2) & ~(PAGE_SIZE - 1))
                        continue
                    self.count(dropped_bytes=PAGE_SIZE)
                    dst, src, left = dst + PAGE_SIZE, src + PAGE_SIZE, left - PAGE_SIZE
                    continue
                raise LazyPagesError(f"UFFDIO_COPY into process {task.pid} at {dst:#x} failed: {os.strerror(err)}")
        finally:
            with task.mu:
                task.inflight.remove(iv)
                if back is not None and not task.gone:
                    task.pending.put(back)
        if back is not None:
            time.sleep(0.0005)  # an event is waiting: let the reader take the lock

    def copy_next(self) -> bool:
        """One background copy, of the first task with something left; False: none has."""
        if not self.landed_all:
            return self.copy_landed()
        with self.tasks_mu:
            tasks = list(self.tasks)
        for task in tasks:

            def choose(task: Task = task) -> Interval | None:
                iv = task.pending.next_chunk(task.cursor, CHUNK)
                if iv is not None:
                    task.cursor = iv.end
                return iv

            if self.copy_taken(task, choose, fault=False):
                return True
        return False

    def all_done(self) -> bool:
        with self.tasks_mu:
            tasks = list(self.tasks)
        return self.finished and all(t.done() for t in tasks)

    def worker(self) -> None:
        try:
            while self.failure is None:
                with self.work_cv:
                    while self.failure is None and not self.finished:
                        self.work_cv.wait(0.05)
                if not self.copy_next():
                    if self.all_done():
                        with self.work_cv:
                            self.work_cv.notify_all()
                        return
                    with self.work_cv:
                        self.work_cv.wait(0.01)
                    continue
        except BaseException as exc:  # noqa: BLE001 - reported by run()
            self.fail(f"{exc}")

    def fail(self, text: str) -> None:
        with self.work_cv:
            if self.failure is None:
                self.failure = text
            self.work_cv.notify_all()

    # -- events ----------------------------------------------------------------------------
    def read_events(self, task: Task) -> list[bytes]:
        """The task's pending messages, read while none of its copies is in flight."""
        task.gate.acquire_exclusive()
        try:
            msgs: list[bytes] = []
            while True:
                try:
                    data = os.read(task.uffd, MSG_SIZE * 64)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno == errno.EBADF:
                        break
                    raise
                if not data:
                    break
                msgs.extend(data[i:i + MSG_SIZE] for i in range(0, len(data), MSG_SIZE))
            for m in msgs:
                self.apply(task, m)
            return msgs
        finally:
            task.gate.release_exclusive()

    def apply(self, task: Task, msg: bytes) -> None:
        """Events that change the memory, applied under the task's exclusive lock; faults are
        answered after it is released (by answer_fault)."""
        event = msg[0]
        name = {EVENT_PAGEFAULT: "fault", EVENT_FORK: "fork", EVENT_REMAP: "remap", EVENT_REMOVE: "remove", EVENT_UNMAP: "unmap"}.get(event, hex(event))
        with self.stats_mu:
            self.stats.events[name] = self.stats.events.get(name, 0) + 1
        if event in (EVENT_REMOVE, EVENT_UNMAP):
            start, end = struct.unpack_from("<QQ", msg, 8)
            with task.mu:
                dropped = sum(iv.end - iv.start for iv in task.pending.take(start, end))
            self.count(dropped_bytes=dropped)
            if event == EVENT_REMOVE:
                # Faults in the dropped range are the kernel's again (zero pages), as without us.
                err = uffd_range(task.uffd, UFFDIO_UNREGISTER, start, end - start)
                if err == errno.ENOMEM:
                    task.gone = True
                elif err:
                    raise LazyPagesError(f"UFFDIO_UNREGISTER in process {task.pid} failed: {os.strerror(err)}")
        elif event == EVENT_REMAP:
            frm, to, length = struct.unpack_from("<QQQ", msg, 8)
            with task.mu:
                task.pending.move(frm, to, length)
        elif event == EVENT_FORK:
            (ufd,) = struct.unpack_from("<I", msg, 8)
            os.set_blocking(ufd, False)
            with task.mu:
                child = Task(task.pid, ufd, task.pending.copy())
            self.add_task(child)
        elif event != EVENT_PAGEFAULT:
            raise LazyPagesError(f"unexpected userfaultfd event {event:#x} from process {task.pid}")

    def answer_fault(self, task: Task, msg: bytes) -> None:
        (addr,) = struct.unpack_from("<Q", msg, 16)
        self.count(faults=1)
        self.answer_page(task, addr & ~(PAGE_SIZE - 1))

    def defer(self, task: Task, page: int, where: tuple[int, int] | None) -> bool:
        """Hold a fault until its page at ``where`` ((pages_id, file offset)) lands; False if it
        has landed meanwhile (then answer it again). Checked and recorded under the lock the
        ledger follower adds ranges under, before it retries the held faults: no fault is held
        past its page's landing."""
        with self.landed_mu:
            got = self.landed.get(where[0]) if where is not None else None
            if self.landed_all or (got is not None and where is not None and got.covers(where[1], where[1] + PAGE_SIZE)):
                return False
            self.deferred.append((task, page))
        return True

    def answer_page(self, task: Task, page: int) -> None:
        state: dict[str, int | bool] = {"wait": False}

        def choose() -> Interval | None:
            if task.in_flight(page):
                state["wait"] = True  # the copy in flight wakes it
                return None
            holder = task.pending.find(page)
            if holder is None:
                return None
            iv = self.clip_landed(task, task.pending.take(page, min(holder.end, page + FAULT_CHUNK))[0])
            if iv is None:  # not written yet: answered once it lands
                state["src"] = holder.src + (page - holder.start)
                return None
            task.cursor = iv.end  # the background goes on from there: readers go in order
            return iv

        landed_meanwhile = False
        task.gate.acquire_shared()
        try:
            if self.copy_taken(task, choose, fault=True, gate=False) or state["wait"] or task.gone:
                return
            if "src" in state:
                where = self.files.locate(int(state["src"]))
                if self.defer(task, page, where):
                    self.count(deferred_faults=1)
                    self.ask_for(where)
                    return
                landed_meanwhile = True
                err = 0
            else:
                # In no lazy range, none in flight: a page never written before the dump (or
                # one a copy filled since the fault). Under the shared lock, as copies are.
                err = uffd_zeropage(task.uffd, page, PAGE_SIZE)
        finally:
            task.gate.release_shared()
        if landed_meanwhile:  # again, outside the task's lock (it is taken again)
            self.answer_page(task, page)
        elif err == errno.EEXIST:
            uffd_range(task.uffd, UFFDIO_WAKE, page, PAGE_SIZE)
        elif err in (errno.ESRCH, errno.ENOSPC, errno.ENOENT, errno.EAGAIN):
            if err == errno.EAGAIN:
                return  # an event is first; the fault comes again
            self.say(f"process {task.pid}: zero page at {page:#x}: {errno.errorcode.get(err)}")
            task.gone = err != errno.ENOENT
        elif err:
            raise LazyPagesError(f"UFFDIO_ZEROPAGE in process {task.pid} at {page:#x} failed: {os.strerror(err)}")
        else:
            self.count(zero_pages=1)

    def event_loop(self) -> None:
        poller = select.poll()
        polled: dict[int, Task] = {}
        try:
            while self.failure is None:
                with self.tasks_mu:
                    tasks = [t for t in self.tasks if not t.gone]
                for t in tasks:
                    if t.uffd not in polled and not t.gone:
                        poller.register(t.uffd, select.POLLIN)
                        polled[t.uffd] = t
                if self.all_done():
                    return
                for fd, _ in poller.poll(20):
                    task = polled[fd]
                    for m in self.read_events(task):
                        if m[0] == EVENT_PAGEFAULT:
                            self.answer_fault(task, m)
                    if task.gone:
                        poller.unregister(fd)  # its process exited: nothing more will come
        except BaseException as exc:  # noqa: BLE001 - reported by run()
            self.fail(f"{exc}")

    def run(self, accept_timeout: float = 0.0) -> dict[str, Any]:
        """Serve until every task is filled; a summary for the caller. Raises LazyPagesError."""
        pool = [threading.Thread(target=self.worker, name=f"gpusnap-lazy-{i}", daemon=True) for i in range(self.threads)]
        events = threading.Thread(target=self.event_loop, name="gpusnap-lazy-events", daemon=True)
        events.start()
        follower = None
        if self.ledger is not None:
            follower = threading.Thread(target=self.follow_ledger, name="gpusnap-lazy-ledger", daemon=True)
            follower.start()
        for t in pool:
            t.start()
        try:
            self.receive(accept_timeout)
        except BaseException as exc:  # noqa: BLE001
            self.fail(str(exc))
        for t in pool:
            t.join()
        events.join()
        if follower is not None and not self.landed_all:
            self.landed_all = True  # every page is in the processes: the ledger is of no more use
        if follower is not None:
            follower.join()
        self.times["done_s"] = round(time.monotonic() - self.started, 3)
        with self.tasks_mu:
            tasks = list(self.tasks)
        for t in tasks:
            try:
                os.close(t.uffd)  # only now: a closed descriptor would let the kernel zero-fill
            except OSError:
                pass
        self.files.close()
        if self.wanted_fd >= 0:
            os.close(self.wanted_fd)
        if self.failure is not None:
            raise LazyPagesError(self.failure)
        return {"tasks": len(tasks), "lazy_bytes": sum(t.total for t in tasks), **self.stats.to_dict(), **self.times,
                "copy_gbps": round(self.stats.copied_bytes / 1e9 / max(1e-6, self.times["done_s"] - self.times["restore_finished_s"]), 2)}


def main(argv: list[str] | None = None) -> int:
    """``python -m gpusnap.criu.lazy_pages IMAGES WORK``: listen on WORK/lazy-pages.socket, print
    "ready" on stdout, serve one restore, print its summary as one line of JSON; exit 1 on error."""
    p = argparse.ArgumentParser(prog="gpusnap.criu.lazy_pages")
    p.add_argument("images", type=Path)
    p.add_argument("work", type=Path)
    # the cores this process may run on (as gpusnap.host.cores counts them; criu does not import host)
    p.add_argument("--threads", type=int, default=min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    p.add_argument("--accept-timeout", type=float, default=0.0, help="seconds to wait for the restore (0: as long as its starter lives)")
    p.add_argument("--log", type=Path)
    p.add_argument("--done-marker", type=Path, help="removed once every page is in (the engine's sign of a complete restore)")
    p.add_argument("--landed", type=Path, help="the ledger of the pages files still being written (gpusnap.criu.landed)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the terminal of the gpusnap that started it may go
    log = open(a.log, "a") if a.log else None  # noqa: SIM115 - open for the server's life
    server = Server(a.images, a.work, threads=a.threads, log=log, landed=a.landed)
    try:
        server.listen()
    except OSError as exc:
        print(json.dumps({"error": f"cannot listen on {a.work / SOCKET_NAME}: {exc}"}), flush=True)
        return 1
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    try:
        summary = server.run(a.accept_timeout)
    except LazyPagesError as exc:
        server.say(f"failed: {exc}")
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    server.say(f"done: {summary}")
    if a.done_marker is not None:
        a.done_marker.unlink(missing_ok=True)
    print(json.dumps(summary), flush=True)
    return 0



class ServerProcess:
    """The server as a process of its own session (see the module's docstring for why)."""

    def __init__(self, proc: Any, started: float) -> None:
        self.proc = proc
        self.started = started

    @classmethod
    def spawn(cls, images: Path, work: Path, *, log: Path | None = None, threads: int | None = None, ready_timeout: float = 30.0,
              done_marker: Path | None = None, landed: Path | None = None) -> "ServerProcess":
        """Start it and wait until it listens; LazyPagesError if it does not. ``done_marker``:
        written now with the server's pid, removed by the server once every page is in.
        ``landed``: the pages files are still being written; this ledger says what is in."""
        import subprocess

        argv = [sys.executable, "-m", "gpusnap.criu.lazy_pages", str(images), str(work)]
        if log is not None:
            argv += ["--log", str(log)]
        if done_marker is not None:
            argv += ["--done-marker", str(done_marker)]
        if landed is not None:
            argv += ["--landed", str(landed)]
        if threads:
            argv += ["--threads", str(threads)]
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        me = cls(proc, started)
        if done_marker is not None:
            done_marker.write_text(f"{proc.pid}\n")
        ready, _, _ = select.select([proc.stdout], [], [], ready_timeout)
        line = proc.stdout.readline() if ready else b""
        if line != READY:
            me.kill()
            raise LazyPagesError(f"the lazy-pages server did not start: {me._reason(line)}")
        return me

    def _reason(self, line: bytes) -> str:
        try:
            return str(json.loads(line)["error"])
        except (ValueError, KeyError, TypeError):
            err = (self.proc.stderr.read() if self.proc.poll() is not None else b"").decode(errors="replace").strip()
            return err.splitlines()[-1] if err else f"exit status {self.proc.poll()}"

    def wait(self, timeout: float) -> dict[str, Any]:
        """Until every page is in: its summary; LazyPagesError if it failed or ran past ``timeout``."""
        import subprocess

        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise LazyPagesError(f"the lazy-pages server did not fill the memory within {timeout:.0f} s") from None
        line = out.strip().splitlines()[-1] if out.strip() else b""
        try:
            summary = json.loads(line)
        except ValueError:
            lines = err.decode(errors="replace").strip().splitlines()
            summary = {"error": lines[-1]} if lines else {}
        if self.proc.returncode or "error" in summary:
            rc = self.proc.returncode
            why = summary.get("error") or (f"killed by signal {-rc}" if rc and rc < 0 else f"exit status {rc}")
            raise LazyPagesError(f"the lazy-pages server failed: {why}")
        summary["server_s"] = round(time.monotonic() - self.started, 3)
        return summary

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.communicate(timeout=10)
        except Exception:  # noqa: BLE001 - best effort: it was killed
            pass



def fill_incomplete(marker: Path) -> bool:
    """Whether a lazy restore's fill ended without every page in: its marker is still there and
    the server it names is gone (a running process then reads zeros where pages were missing)."""
    try:
        pid = int(marker.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[-1].split()[0] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
