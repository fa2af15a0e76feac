"""Store a checkpoint while CRIU is still writing it.

A GPU checkpoint's image is nearly all pages (the driver's copy of GPU memory inside the
process), and CRIU writes them at one to two GB/s. When the store starts only after the dump,
``checkpoint --push`` costs the dump plus the store plus what the uploads add. A
:class:`DumpFollower` watches the image directory from before the dump: it cuts, hashes and packs
the pages files as they grow (the pack writer's ``on_blob`` uploads each pack as it is
committed), so that when the dump ends only the tail of the last file is left to store.

Why the result is the same as storing the finished directory:

* CRIU writes, for one process (or shared-memory object) after the other, a pagemap image (a
  head naming ``pages-N.img``, then an entry per run of pages, through a 4 KiB buffer) and
  ``pages-N.img`` itself, appended with splice and never rewritten: bytes below a pages file's
  current size are final.
* The cuts of a pages file depend only on its pagemap ranges (pack.AlignedCutter). A range seen
  so far may still grow (the next entry may continue it in memory and in the file), so its end
  is not yet a cut; every other cut is final. A window of pieces (pack.window_end) is added once a
  final cut lies past its reach and the file holds its bytes: the windows a store of the
  finished file makes, read from the same bytes.
* Files go in the order of their pages id, each to its end before the next: CRIU creates
  ``pages-(N+1).img`` after closing ``pages-N.img`` and its pagemap, so once the next one exists
  the earlier one is whole. :meth:`DumpFollower.finish`, called when the dump has ended, takes the
  rest the same way (every file is whole then) and checks that what was read while CRIU wrote is
  what the finished files say: another layout raises :class:`FollowMismatch` and the caller
  stores the finished directory instead, so a CRIU that writes differently costs time, never a
  wrong checkpoint.

* CRIU writes ``stats-dump`` last, once every image is closed. When it appears the follower
  takes the rest of the pages files and checks them on its own thread, while the runtime
  still works (a leave-running GPU checkpoint copies the GPU's state back for about a second),
  instead of after the engine has returned.
* Then it packs the large files that appear after the dump (``artifact.large_extra``: those
  the artifact stores as pieces, such as the engine's archive of an overlay's writable layer),
  provided they appear whole: ``engines.upper.pack_upper`` writes under a hidden name and
  renames, and a file whose identity (inode, size, change time) differs at :meth:`finish` from
  what was read is a :class:`FollowMismatch`, like a pagemap that changed.

The pages files (those whose pagemap is known) are packed first, in pages-id order, then those
large files in the order they appeared, then everything else as
:func:`gpusnap.packaging.artifact.build_artifact` goes through the directory. Without such large
files the artifact is the one a store of the finished directory makes; with them it holds the
same files and pieces, its packs in that order. Pieces carry provisional file numbers until the
artifact's file list places them (PackResult.renumber_files).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.criu.pagemap import PAGE_SIZE, PAGEMAP_NAME, PageRange, PagemapReader, merge_contiguous
from gpusnap.criu.images import DUMP_STATS, ImageFormatError
from gpusnap.host.cores import usable_cores
from gpusnap.packaging.store import OciStore

# Threads that read and hash for a follower's pack writer while CRIU dumps, when the caller names
# no count; once the dump has ended, what is left gets all the cores (PackWriter.widen). Beside
# the dump the store only has to keep up with one CRIU writer (1.5-2 GB/s, whatever the host's
# cores), and every thread more costs the dump. On H100 hosts, CRIU's dump of the 5.2 GB server
# took 3.29-4.68 s (median 3.54) with the store on all 16 cores beside it, 3.09-3.79 s (median
# 3.18) with 4 threads, 2.58-3.04 s with nothing beside it (bench/results/
# gpu-h100-e2e-2026-11-27-thirteenth-server); `checkpoint --push` end to end took 6.54-9.91 s with
# 2 threads against 6.62-10.62 s with 4, interleaved on three hosts (2 ahead by 0.36-1.1 s in
# three pairs of six, within 0.2 s either way in the others), and with 2 the dump still left
# only 0.06-0.10 s of storing after it (bench/results/gpu-h100-e2e-2026-11-27-fifteenth).
BESIDE_DUMP = 2


def beside_dump_workers(cores: int | None = None) -> int:
    """The follower's default thread count while the dump runs, on a host of ``cores`` cores."""
    return min(cores or usable_cores(), BESIDE_DUMP)

# numpy and the pack writer are imported where they are first used, on the follower's thread:
# the follower starts right before the dump, and the dump should not wait for those imports.

PAGES_NAME = re.compile(r"^pages-(\d+)\.img$")
PROVISIONAL = 1 << 30  # file numbers of followed files until the artifact lists them: PROVISIONAL + pages id
EXTRA_PROVISIONAL = PROVISIONAL + (1 << 29)  # … and of the large files packed after the dump, in the order seen
POLL_S = 0.02
# What the follower's thread did after the dump, while the runtime went on (Followed.after_dump).
AFTER_DUMP = ("the pages left when the dump ended, added", "large files that appeared after the dump, cut and hashed")
_READ = 1 << 20


class FollowMismatch(Exception):
    """The finished files are not what was read while CRIU wrote them: store the directory anew."""


@dataclass
class _Track:
    """One pages file: what of it went to the writer."""

    pages_id: int
    name: str
    fd: int
    reader: PagemapReader | None = None
    pagemap_fd: int = -1
    pagemap_read: int = 0
    merged: list[PageRange] = field(default_factory=list)  # the pagemap's ranges so far, contiguous ones merged
    cuts: Any = None  # numpy array: the final cuts known (computed again only when ``merged`` grows)
    final: bool = False  # ``cuts`` are the whole file's
    at: int = 0  # index in ``cuts`` where the next window starts
    done: bool = False
    skipped: bool = False  # no usable pagemap: build_artifact stores it the usual way

    @property
    def started(self) -> bool:
        return self.at > 0

    @property
    def number(self) -> int:
        return PROVISIONAL + self.pages_id


@dataclass(frozen=True)
class _Extra:
    """A large file packed after the dump: its provisional number, size and identity when read."""

    number: int
    size: int
    identity: tuple[int, int, int, int]


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Followed:
    """What :meth:`DumpFollower.finish` hands to build_artifact: the writer that holds the pages
    files' pieces, and for each such file its provisional number and size."""

    writer: Any  # pack.PackWriter
    files: dict[str, tuple[int, int]]
    after_dump: dict[str, float] = field(default_factory=dict)  # seconds on the follower's thread (AFTER_DUMP)


class DumpFollower:
    """Packs the pages files of ``directory`` while a dump writes them (see the module doc).

    ``start`` begins watching (the directory may not exist yet); then either ``finish`` (the
    dump succeeded: the rest is taken, checked, and the writer returned for build_artifact) or
    ``abort`` (anything else: nothing it wrote stays referenced). ``close`` releases the store.
    """

    def __init__(self, store: OciStore, directory: Path, *, compress: bool, parent: str | None = None,
                 on_blob: Any = None, workers: int | None = None, params: Any = None,
                 poll_s: float = POLL_S, nice: int = 0) -> None:
        self.store, self.dir = store, Path(directory)
        self.compress, self.parent, self.on_blob = compress, parent, on_blob
        self.workers = workers or beside_dump_workers()
        # Threads for what is left once the dump has ended: the caller's count, or every core.
        self.workers_after = workers or usable_cores()
        self.params = params  # pack.PackParams; None: the defaults, which build_artifact uses too
        self.poll_s = poll_s
        self.nice = nice  # of this follower's thread and its writer's pools (gpusnap.host.priority)
        self.writer: Any = None  # pack.PackWriter, made on the follower's thread
        self.tracks: dict[int, _Track] = {}
        self.pagemaps: dict[int, str] = {}  # pages id → pagemap file name
        self._heads_seen: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock: Any = None
        self.bytes_while_dumping = 0  # pages handed to the writer before the dump ended
        self._finishing = False
        self.dump_over = False  # stats-dump seen: every pages file taken to its end and checked
        self.extras: dict[str, _Extra] = {}  # large files packed after the dump, by name
        # Seconds this follower's thread spent after the dump ended, beside the runtime (AFTER_DUMP
        # keys): what the store then no longer waits for.
        self.after_dump: dict[str, float] = {}

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> "DumpFollower":
        # The packs it commits are referenced by no tag until the store tags the artifact: keep
        # gc away from the first one on.
        self._lock = self.store.writing()
        self._lock.__enter__()
        self._thread = threading.Thread(target=self._run, name="gpusnap-follow", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            from gpusnap.host.priority import yield_cpu
            from gpusnap.packaging import pack as packing

            yield_cpu(self.nice)
            self.params = self.params or packing.PackParams()
            known = packing.known_pieces(self.store, [self.parent] if self.parent else None)
            self.writer = packing.PackWriter(self.store, compress=self.compress, params=self.params, known=known,
                                             on_blob=self.on_blob, workers=self.workers, nice=self.nice)
            while not self._stop.is_set():
                if not self.dump_over and (self.dir / DUMP_STATS).exists():
                    self._take_the_rest()
                    continue
                progressed = self._add_extra() if self.dump_over else self._step(final=False)
                if not progressed:
                    self._stop.wait(self.poll_s)
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self._error = exc

    def _join(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finish(self) -> Followed:
        """The dump ended and its files are whole: take the rest of every pages file."""
        self._join()
        if self._error is not None:
            raise self._error
        assert self.writer is not None
        early = self.dump_over  # the thread saw the dump end (else: taken here, inside the store)
        if not early:
            self._take_the_rest()
        for name, extra in self.extras.items():
            try:
                same = _identity(os.stat(self.dir / name)) == extra.identity
            except FileNotFoundError:
                same = False
            if not same:
                raise FollowMismatch(f"{name}: changed after it was stored")
        files = {t.name: (t.number, int(t.cuts[-1]) * PAGE_SIZE) for t in self._ordered() if t.done}
        files.update((name, (extra.number, extra.size)) for name, extra in self.extras.items())
        writer, self.writer = self.writer, None  # build_artifact finishes or aborts it from here on
        return Followed(writer, files, dict(self.after_dump) if early else {})

    def _take_the_rest(self) -> None:
        """Every pages file is whole (the dump ended): add what is left of each and check them."""
        t0 = time.perf_counter()
        self._finishing = True
        assert self.writer is not None
        self.writer.widen(self.workers_after)  # nothing left to slow down: the dump is over
        self._step(final=True)
        for t in self._ordered():
            if t.done:
                self._recheck(t)
        self.writer.seal_open()  # the last pages' packs: committed (and uploaded) now
        self.dump_over = True
        self.after_dump[AFTER_DUMP[0]] = round(time.perf_counter() - t0, 3)

    def _add_extra(self) -> bool:
        """Pack the next large file that appeared after the dump; whether one was packed. Small
        files are looked at again on each pass (one written in place may still grow)."""
        from gpusnap.packaging.artifact import large_extra

        try:
            entries = sorted(os.scandir(self.dir), key=lambda e: e.name)
        except FileNotFoundError:
            return False
        for entry in entries:
            name = entry.name
            if name in self.extras or name.startswith(".") or PAGES_NAME.match(name):
                continue
            try:
                if not large_extra(name, entry.stat(follow_symlinks=False)):
                    continue
            except OSError:
                continue  # gone since the listing (a hidden partial file renamed into place)
            try:
                f = open(os.open(self.dir / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW), "rb", buffering=0)
            except OSError:
                continue  # gone, or replaced by a link: build_artifact sees to it
            with f:
                st = os.fstat(f.fileno())
                assert self.writer is not None
                number = EXTRA_PROVISIONAL + len(self.extras)
                t0 = time.perf_counter()
                size = self.writer.add_cdc(number, f, st.st_size)
                self.writer.seal_open()
                self.after_dump[AFTER_DUMP[1]] = round(self.after_dump.get(AFTER_DUMP[1], 0.0) + time.perf_counter() - t0, 3)
            if size != st.st_size:
                raise FollowMismatch(f"{name}: read {size} bytes of {st.st_size}; it changed while it was stored")
            self.extras[name] = _Extra(number, size, _identity(st))
            return True
        return False

    def abort(self) -> None:
        """Stop, and drop every pack written so far (none is referenced by a tag yet)."""
        self._join()
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
            self.store.discard_pending()
        self._close_files()

    def close(self) -> None:
        """Release the store (after the artifact is tagged, or after ``abort``); a writer never
        handed over by ``finish`` is aborted."""
        self.abort()
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def _close_files(self) -> None:
        for t in self.tracks.values():
            if t.pagemap_fd >= 0:
                os.close(t.pagemap_fd)
                t.pagemap_fd = -1
            # the pages fds belong to the writer (adopt_fd), which closes them

    # -- following -------------------------------------------------------------------------------
    def _ordered(self) -> list[_Track]:
        return [self.tracks[k] for k in sorted(self.tracks)]

    def _pages_ids(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(PAGES_NAME.match, names) if m)

    def _step(self, final: bool) -> bool:
        """Add what can be added now; returns whether anything was."""
        ids = self._pages_ids()
        progressed = False
        for k, n in enumerate(ids):
            t = self.tracks.get(n)
            if t is None:
                t = self._open(n)
                if t is None:
                    break
            if t.done or t.skipped:
                continue
            whole = final or k + 1 < len(ids)
            progressed |= self._advance(t, whole)
            if not (t.done or t.skipped):
                break  # one file at a time, in pages-id order
        return progressed

    def _open(self, n: int) -> _Track | None:
        name = f"pages-{n}.img"
        try:
            fd = os.open(self.dir / name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        assert self.writer is not None
        t = _Track(n, name, self.writer.adopt_fd(fd))
        self.tracks[n] = t
        return t

    def _find_pagemap(self, pages_id: int) -> str | None:
        """The pagemap image whose head names ``pages_id`` (heads are read once each)."""
        if pages_id in self.pagemaps:
            return self.pagemaps[pages_id]
        try:
            names = sorted(n for n in os.listdir(self.dir) if PAGEMAP_NAME.match(n) and n not in self._heads_seen)
        except FileNotFoundError:
            return None
        for name in names:
            reader = PagemapReader()
            try:
                with open(self.dir / name, "rb") as f:
                    reader.feed(f.read(4096))
            except (OSError, ImageFormatError):
                continue
            if reader.pages_id is None:
                continue  # its head is still in CRIU's buffer
            self._heads_seen.add(name)
            self.pagemaps[reader.pages_id] = name
        return self.pagemaps.get(pages_id)

    def _advance(self, t: _Track, whole: bool) -> bool:
        from gpusnap.host.numeric import np

        from gpusnap.packaging import pack as packing

        if t.reader is None:
            name = self._find_pagemap(t.pages_id)
            if name is None:
                if whole:
                    t.skipped = True  # no pagemap names it: stored the usual way
                return False
            t.reader = PagemapReader()
            t.pagemap_fd = os.open(self.dir / name, os.O_RDONLY | os.O_CLOEXEC)
        new: list[PageRange] = []
        try:
            while chunk := os.pread(t.pagemap_fd, _READ, t.pagemap_read):
                t.pagemap_read += len(chunk)
                new += t.reader.feed(chunk)
        except ImageFormatError:
            return self._unusable(t, whole)
        size = os.fstat(t.fd).st_size
        if new:  # only the last merged range can join the new ones
            t.merged[-1:] = merge_contiguous(t.merged[-1:] + new)
        if new or (whole and not t.final):
            ranges = t.merged
            if whole:
                if t.reader.pending or not ranges or sum(r.nr_pages for r in ranges) * PAGE_SIZE != size:
                    return self._unusable(t, True)
                cuts = packing.AlignedCutter(ranges, self.params.piece_pages).cuts
                t.final = True
            else:
                if not ranges:
                    return False
                cuts = packing.AlignedCutter(ranges, self.params.piece_pages).cuts[:-1]  # the last range may grow
            used = t.cuts[: t.at + 1] if t.started else cuts[:0]
            if len(cuts) < len(used) or not np.array_equal(cuts[: len(used)], used):
                raise FollowMismatch(f"{t.name}: its pagemap changed after part of it was stored")
            t.cuts = cuts
        elif t.cuts is None:
            return False  # no range yet
        cuts = t.cuts
        per = self.params.window // PAGE_SIZE
        avail = size // PAGE_SIZE
        progressed = False
        while t.at < len(cuts) - 1:
            if not whole and int(cuts[-1]) <= int(cuts[t.at]) + per:
                break  # where this window ends depends on cuts not known yet
            j = packing.window_end(cuts, t.at, per)
            if int(cuts[j]) > avail:
                break
            assert self.writer is not None
            self.writer.add_pages_window(t.fd, t.number, cuts[t.at: j + 1])
            if not self._finishing:
                self.bytes_while_dumping += (int(cuts[j]) - int(cuts[t.at])) * PAGE_SIZE
            t.at = j
            progressed = True
        if whole and t.at == len(cuts) - 1:
            t.done = True
        return progressed

    def _recheck(self, t: _Track) -> None:
        """The finished file and its pagemap, read again from the start, give the cuts used."""
        from gpusnap.host.numeric import np

        from gpusnap.packaging import pack as packing

        reader = PagemapReader()
        try:
            with open(self.dir / self.pagemaps[t.pages_id], "rb") as f:
                reader.feed(f.read())
            ranges = merge_contiguous(reader.ranges)
            cuts = packing.AlignedCutter(ranges, self.params.piece_pages).cuts if ranges else None
        except (OSError, ImageFormatError):
            cuts = None
        if (cuts is None or reader.pending or reader.pages_id != t.pages_id or not np.array_equal(cuts, t.cuts)
                or os.fstat(t.fd).st_size != int(cuts[-1]) * PAGE_SIZE):
            raise FollowMismatch(f"{t.name}: the finished file is not the one that was stored while it was written")

    def _unusable(self, t: _Track, whole: bool) -> bool:
        """The pagemap does not describe the file (yet, or at all)."""
        if not whole:
            return False
        if t.started:
            raise FollowMismatch(f"{t.name}: its finished pagemap does not describe the part already stored")
        t.skipped = True
        return False
