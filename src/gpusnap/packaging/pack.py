"""Format v2 writer: checkpoint files → content-keyed pieces packed into blobs, on a worker pool.

Pieces (docs/artifact-format.md, "Format v2"):

* ``pages-N.img``: cut at page granularity. A cut is forced where the pagemap says a new memory
  range starts (mappings that continue each other in memory are one range); inside a range a
  piece ends after a page whose sampled hash is 0 mod ``divisor`` (at least ``min_pages``, at
  most ``max_pages``), so a buffer that moved to another address or another place in the file
  still yields the same pieces. Runs of ``zero_min_pages`` or more all-zero pages are zero
  pieces: recorded, never stored. No rolling hash runs over the bytes: the per-page hash reads
  16 words of each page (numpy, vectorised, releases the GIL).
* other large files (podman's rootfs-diff.tar, data files): FastCDC (byte shifts are common
  there), smaller pieces than v1's so they pack well.

Each piece is hashed (BLAKE3 of its raw bytes: layout.PIECE_DIGEST) and, when compression is
asked for and pays, compressed to one zstd frame, on a thread pool sized to the cores: blake3 and
zstandard release the GIL on large buffers. A piece the store already holds (from any recent checkpoint) is
referenced where it lies — pack blob + offset — instead of being written again; new pieces are
appended to the open pack, and a pack is written, hashed and committed on the pool once it
reaches ``pack_target`` bytes. Reads go into a fixed pool of window buffers with ``readinto``;
pieces are memoryviews into them (no copy) until their pack is written, so memory stays bounded
whatever the checkpoint size.
"""

from __future__ import annotations

import collections
from array import array
import mmap
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

import zstandard
from pyfastcdc import FastCDC

from gpusnap.errors import IntegrityError
from gpusnap.host.cores import usable_cores
from gpusnap.host.numeric import np
from gpusnap.host.priority import yielding_pool
from gpusnap.packaging import layout as lay
from gpusnap.packaging.store import Descriptor, OciStore, PlacedBlobWriter

PAGE = 4096
_WORDS = PAGE // 8
_SAMPLE_STRIDE = 32  # words: 16 samples per page, one per 256 bytes
# Odd 64-bit multipliers (arbitrary, fixed: part of the format through the cut decisions).
_K = np.array([
    0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
    0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9,
    0x2545F4914F6CDD1D, 0x9FB21C651E98DF25, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB,
    0x8EBC6AF09C88C6E3, 0x589965CC75374CC3, 0x1D8E4E27C47D124F, 0x5851F42D4C957F2D,
], dtype=np.uint64)
SCHEME = "pagemap-pages-v2"
# Packs filled at once (see PackWriter): four pack digests in parallel outrun a 16-core host's
# disk (eight stored a real 5 GB server image no faster there: bench/results/
# gpu-h100-e2e-2026-11-27-fourteenth); fixed, not per core, so that a checkpoint makes the same
# packs on every host.
LANES = 4
_MAX_ZERO_PAGES = (1 << 30) // PAGE  # a zero piece's length must fit the table's 32-bit field


@dataclass(frozen=True)
class PackParams:
    cut: str = "vaddr"  # "vaddr": AlignedCutter; "cdc": page-level CDC also where the pagemap is known
    piece_pages: int = 32  # 128 KiB: pages pieces end at virtual addresses that are multiples of it
    # page-level CDC, for pages files whose pagemap is unknown
    min_pages: int = 4  # 16 KiB
    max_pages: int = 128  # 512 KiB
    divisor: int = 32  # average data piece ~36 pages (~144 KiB)
    zero_min_pages: int = 16  # shorter zero runs stay inside data pieces
    pack_target: int = 32 << 20
    cdc_avg: int = 1 << 20  # other large files (FastCDC 2020, pyfastcdc)
    cdc_min: int = 256 << 10
    cdc_max: int = 4 << 20
    window: int = 4 << 20  # read granularity
    compress_min_saving: float = 0.1  # keep a zstd frame only if it saves this fraction
    compress_level: int = 3

    def to_dict(self) -> dict[str, object]:
        return {
            "scheme": SCHEME, "pageSize": PAGE,
            "pages": {"cut": ("virtual-address multiples of pieceSize inside pagemap ranges" if self.cut == "vaddr"
                              else "page-level CDC, forced cuts at pagemap range starts"),
                      "pieceSize": self.piece_pages * PAGE,
                      "withoutPagemap": {"cut": "page-level CDC on a sampled page hash", "sampleWords": _WORDS // _SAMPLE_STRIDE,
                                         "minPages": self.min_pages, "maxPages": self.max_pages, "divisor": self.divisor,
                                         "zeroMinPages": self.zero_min_pages}},
            "other": {"algorithm": "fastcdc-2020", "avgSize": self.cdc_avg, "minSize": self.cdc_min, "maxSize": self.cdc_max},
            "packTarget": self.pack_target, "digest": f"{lay.PIECE_DIGEST}(raw piece)",
            "compression": {"algorithm": "zstd", "level": self.compress_level, "minSaving": self.compress_min_saving},
        }


# ---- cutting pages files ------------------------------------------------------------------------
def page_features(view: memoryview, npages: int, divisor: int) -> tuple[np.ndarray, np.ndarray]:
    """(zero, cut) flags per page: the page is all zero / a data piece may end after it."""
    a = np.frombuffer(view, dtype=np.uint64, count=npages * _WORDS).reshape(npages, _WORDS)
    s = np.ascontiguousarray(a[:, ::_SAMPLE_STRIDE])
    sample_zero = _rows_zero(s)
    zero = _full_check(a, sample_zero)
    h = (s * _K).sum(axis=1, dtype=np.uint64)
    h ^= h >> np.uint64(29)
    cut = ((h >> np.uint64(20)) % np.uint64(divisor) == 0) & ~sample_zero
    return zero, cut


def page_zero(view: memoryview, npages: int) -> np.ndarray:
    """Per page: is it all zero? (Full check only where the sampled words are all zero.)"""
    a = np.frombuffer(view, dtype=np.uint64, count=npages * _WORDS).reshape(npages, _WORDS)
    return _full_check(a, _rows_zero(np.ascontiguousarray(a[:, ::_SAMPLE_STRIDE])))


def _rows_zero(rows: np.ndarray) -> np.ndarray:
    """Per row of a C-contiguous uint64 array: are all its words zero?

    An OR-reduction, not ``~rows.any(axis=1)``: on a 4 MiB window (1024 rows) ``any`` held the
    interpreter lock for its whole run (two threads took as long as one), and the store's workers
    call this on every window they read; the OR-reduction releases it (two threads: half the
    time) and is no slower on one."""
    return np.bitwise_or.reduce(rows, axis=1) == 0


def _full_check(a: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Which candidate pages (rows of ``a``) are all zero, checked run by run on views of ``a``:
    indexing ``a`` with the candidates' indexes would copy them (4 MiB a window when it is all
    zero), and such transient copies on many threads stay in malloc's per-thread arenas."""
    zero = np.zeros(len(candidates), dtype=bool)
    if not candidates.any():
        return zero
    edges = np.flatnonzero(np.diff(np.concatenate(([False], candidates, [False])).astype(np.int8)))
    for s, e in zip(edges[::2].tolist(), edges[1::2].tolist()):
        zero[s:e] = _rows_zero(a[s:e])
    return zero


class PageCutter:
    """Turns per-page flags, fed window after window, into pieces (start, end, is_zero) in pages.

    Decisions depend only on the pages' content and the forced range starts, never on where a
    window begins (a pending zero run is decided only once its full length is known).
    """

    def __init__(self, params: PackParams, forced: list[int] | None) -> None:
        self.p = params
        self.forced = np.array(sorted(set(forced or [])), dtype=np.int64)
        self.start: int | None = None  # open piece start
        self.zero_open = False  # the open piece is a zero piece
        self.zrun: int | None = None  # start of a pending zero run at the end of the open data piece
        self.pos = 0  # pages fed so far
        self.out: list[tuple[int, int, bool]] = []

    def keep_from(self) -> int | None:
        """First page whose bytes are still needed (open data piece), None if none are."""
        return None if self.start is None or self.zero_open else self.start

    def _emit(self, a: int, b: int, zero: bool) -> None:
        if b > a:
            self.out.append((a, b, zero))

    def _data_to(self, hi: int, cands: np.ndarray) -> None:
        """Extend the open data piece to page ``hi`` applying candidate and max cuts."""
        p = self.p
        assert self.start is not None
        i = int(np.searchsorted(cands, self.start + p.min_pages - 1))
        while True:
            limit = self.start + p.max_pages
            c = int(cands[i]) if i < len(cands) else None
            if c is not None and c < hi and c + 1 <= limit:
                self._emit(self.start, c + 1, False)
                self.start = c + 1
                i = int(np.searchsorted(cands, self.start + p.min_pages - 1))
            elif limit <= hi:
                self._emit(self.start, limit, False)
                self.start = limit
                i = int(np.searchsorted(cands, self.start + p.min_pages - 1))
            else:
                return

    _NO = np.zeros(0, dtype=np.int64)

    def _resolve_zero(self, end: int, final: bool) -> None:
        """A pending zero run ending at ``end`` (it is over, or the file/range ends)."""
        if self.zrun is None:
            return
        zs = self.zrun
        self.zrun = None
        if end - zs >= self.p.zero_min_pages:
            assert self.start is not None
            self._emit(self.start, zs, False)
            self.start, self.zero_open = zs, True
        else:
            self._data_to(end, self._NO)

    def _close(self, at: int) -> None:
        if self.start is None:
            return
        self._resolve_zero(at, True)
        self._emit(self.start, at, self.zero_open)
        self.start, self.zero_open = None, False

    def feed(self, zero: np.ndarray, cut: np.ndarray) -> list[tuple[int, int, bool]]:
        base = self.pos
        n = len(zero)
        self.pos += n
        self.out = []
        # run starts: zero/non-zero transitions and forced range starts inside this window
        starts = set((np.flatnonzero(zero[1:] != zero[:-1]) + 1 + base).tolist())
        starts.add(base)
        f = self.forced[(self.forced >= base) & (self.forced < base + n)]
        forced = set(f.tolist())
        starts |= forced
        bounds = sorted(starts) + [base + n]
        cands = (np.flatnonzero(cut) + base).astype(np.int64)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if a in forced:
                self._close(a)
            if zero[a - base]:
                if self.start is None:
                    self.start, self.zero_open = a, True
                elif self.zero_open:
                    pass
                elif self.zrun is None:
                    self.zrun = a
                if self.zrun is not None and b - self.zrun >= self.p.zero_min_pages:
                    self._resolve_zero(b, False)
            else:
                if self.start is None:
                    self.start = a
                elif self.zero_open:
                    self._emit(self.start, a, True)
                    self.start, self.zero_open = a, False
                else:
                    self._resolve_zero(a, False)
                lo = int(np.searchsorted(cands, a))
                hi = int(np.searchsorted(cands, b))
                self._data_to(b, cands[lo:hi])
        return self.out

    def finish(self) -> list[tuple[int, int, bool]]:
        self.out = []
        self._close(self.pos)
        return self.out


def window_end(cuts: np.ndarray, i: int, per: int) -> int:
    """The cut index that ends the window of whole pieces starting at ``cuts[i]``: the last
    cut at most ``per`` pages on, at least one piece. It depends on no cut past that reach, so
    a follower that knows the cuts only that far makes the same windows (follow.py)."""
    j = int(np.searchsorted(cuts, int(cuts[i]) + per, side="right")) - 1
    return max(j, i + 1)


def aligned_cuts(ranges: list[Any], piece_pages: int) -> np.ndarray:
    """The page indexes (in the pages file) where AlignedCutter's pieces start, and the file's
    end: each range's start, and inside it every page whose virtual address is a multiple of
    ``piece_pages`` pages. Whole arrays, no loop per range: a GPU process's pagemap can hold tens
    of thousands of ranges, and the store waits for these cuts before its first read."""
    if not ranges:
        return np.zeros(1, dtype=np.int64)
    s0 = np.fromiter((r.file_offset for r in ranges), dtype=np.int64, count=len(ranges)) // PAGE
    v = np.fromiter((r.vaddr for r in ranges), dtype=np.uint64, count=len(ranges)) // np.uint64(PAGE)
    n = np.fromiter((r.nr_pages for r in ranges), dtype=np.int64, count=len(ranges))
    # pages from each range's start to its first aligned address (1..piece_pages)
    first = (piece_pages - (v % np.uint64(piece_pages)).astype(np.int64))
    count = np.maximum(0, (n - first + piece_pages - 1) // piece_pages)  # aligned cuts inside each range
    starts = np.repeat(s0 + first, count)
    step = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    end = s0[-1] + n[-1]
    return np.unique(np.concatenate((s0, starts + step * piece_pages, [end])))


class AlignedCutter:
    """Pieces that end where the virtual address is a multiple of ``piece_pages`` pages, or
    where a memory range ends (ranges: the pagemap's, contiguous entries merged).

    Why addresses and not content: between two checkpoints of a GPU process the driver's
    buffers stay at the same addresses (measured: 95 % of pages identical at the same address,
    none moved), while CRIU's entries split at varying places; a cut tied to the address is
    stable wherever the entries split, and the pieces are keyed by content. An all-zero piece
    is a zero piece (consecutive ones are merged).
    """

    def __init__(self, ranges: list[Any], piece_pages: int) -> None:
        self.cuts = aligned_cuts(ranges, piece_pages)
        self.i = 0  # next piece: [cuts[i], cuts[i + 1])
        self.pos = 0
        self.zbuf = np.zeros(0, dtype=bool)  # zero flags of pages [cuts[i], pos)
        self.zero: tuple[int, int] | None = None  # zero pieces held back to merge with the next

    def keep_from(self) -> int | None:
        start = int(self.cuts[self.i])
        return start if start < self.pos else None

    def feed(self, zero: np.ndarray, cut: np.ndarray) -> list[tuple[int, int, bool]]:
        zbase = int(self.cuts[self.i])
        self.zbuf = np.concatenate((self.zbuf, zero))
        self.pos += len(zero)
        j = int(np.searchsorted(self.cuts, self.pos, side="right")) - 1
        out: list[tuple[int, int, bool]] = []
        if j > self.i:
            starts = self.cuts[self.i:j + 1]
            allzero = np.logical_and.reduceat(self.zbuf[: int(starts[-1]) - zbase], starts[:-1] - zbase)
            for k in range(len(starts) - 1):
                a, b, z = int(starts[k]), int(starts[k + 1]), bool(allzero[k])
                if z:
                    if self.zero is not None and self.zero[1] == a and b - self.zero[0] <= _MAX_ZERO_PAGES:
                        self.zero = (self.zero[0], b)
                    else:
                        self._flush_zero(out)
                        self.zero = (a, b)
                else:
                    self._flush_zero(out)
                    out.append((a, b, False))
            self.i = j
            self.zbuf = self.zbuf[int(self.cuts[j]) - zbase:]
        return out

    def _flush_zero(self, out: list[tuple[int, int, bool]]) -> None:
        if self.zero is not None:
            out.append((self.zero[0], self.zero[1], True))
            self.zero = None

    def finish(self) -> list[tuple[int, int, bool]]:
        out: list[tuple[int, int, bool]] = []
        self._flush_zero(out)  # the last range's end is a cut: all else was emitted
        return out


# ---- the dedup index ------------------------------------------------------------------------------
@dataclass(slots=True)
class KnownPiece:
    blob: Descriptor  # pack blob that holds it
    blob_offset: int
    stored: int
    raw: int
    flags: int


# 500k pieces cover the parent and two more 20 GB checkpoints at 128 KiB; older checkpoints
# beyond it are simply not deduped against (bounded memory, never wrong).
MAX_KNOWN = 500_000


class KnownIndex:
    """Raw digest → where a piece of an earlier checkpoint lies, in ~130 bytes a piece: the
    digest is the only Python object per piece; the rest sits in one flat array (a dict of
    records cost ~250 bytes a piece, 130 MB for the 500k limit)."""

    _W = 5  # pack index, blob offset, stored length, raw length, flags

    def __init__(self) -> None:
        self.packs: list[Descriptor] = []
        self._pack_at: dict[str, int] = {}
        self._where: dict[bytes, int] = {}
        self._rows = array("q")

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, digest: object) -> bool:
        return digest in self._where

    def add(self, digest: bytes, blob: Descriptor, blob_offset: int, stored: int, raw: int, flags: int) -> None:
        if digest in self._where:
            return
        pi = self._pack_at.get(blob.digest)
        if pi is None:
            pi = self._pack_at[blob.digest] = len(self.packs)
            self.packs.append(blob)
        self._where[digest] = len(self._rows) // self._W
        self._rows.extend((pi, blob_offset, stored, raw, flags))

    def get(self, digest: bytes) -> KnownPiece | None:
        i = self._where.get(digest)
        if i is None:
            return None
        pi, bo, stored, raw, flags = self._rows[i * self._W:(i + 1) * self._W]
        return KnownPiece(self.packs[pi], bo, stored, raw, flags)


def known_pieces(store: OciStore, prefer: list[str] | None = None, limit: int = MAX_KNOWN) -> KnownIndex:
    """Pieces of v2 checkpoints already in ``store``: raw digest → where they lie.

    Derived from the stored artifacts themselves (manifest + piece table, both verified when
    read), so it can never disagree with the store after a crash. Bounded: the manifests in
    ``prefer`` (e.g. the parent) first, then the newest tags, until ``limit`` pieces. Only tables
    whose digest is the one new pieces get (layout.PIECE_DIGEST): an older table's SHA-256 keys
    could never match, and would take room in the index.
    """
    import json

    out = KnownIndex()
    seen: set[str] = set()
    tags = store.tags()
    order = list(prefer or [])
    dated = []
    for t in tags:
        try:
            created = os.stat(store.blob_path(t.descriptor.digest)).st_mtime
        except OSError:
            continue
        dated.append((created, t.descriptor.digest))
    order += [d for _, d in sorted(dated, reverse=True)]
    for digest in order:
        if digest in seen or len(out) >= limit:
            continue
        seen.add(digest)
        try:
            m = store.manifest(digest)
            layers = [Descriptor.from_dict(x) for x in m.get("layers", [])]
            tables = [d for d in layers if d.media_type == lay.MEDIA_PIECES]
            if len(tables) != 1:
                continue  # v1 or encrypted: nothing to reference piecewise
            algorithm, records = lay.read_table(store.read_bytes(tables[0].digest, limit=lay.MAX_TABLE))
            if algorithm != lay.PIECE_DIGEST:
                continue
        except (IntegrityError, OSError, ValueError, json.JSONDecodeError):
            continue
        except Exception:  # noqa: BLE001 - a damaged old checkpoint only means less dedup
            continue
        present: dict[int, bool] = {}
        for _fo, bo, _fi, li, raw, stored, flags, key in records:
            if flags & lay.FLAG_ZERO or li >= len(layers) or key in out:
                continue
            ok = present.get(li)
            if ok is None:
                ok = present[li] = layers[li].media_type == lay.MEDIA_PACK and store.has_blob(layers[li].digest)
            if ok:
                out.add(key, layers[li], bo, stored, raw, flags)
                if len(out) >= limit:
                    break
    return out


# ---- the pipeline -----------------------------------------------------------------------------------
class _Buffer:
    """A read window; the pool of these bounds memory. A window goes back to the pool when
    nothing refers to its bytes any more (its pieces are hashed and, if new, in a pack file)."""

    __slots__ = ("data", "refs", "pool")

    def __init__(self, size: int, pool: "queue.Queue[_Buffer]") -> None:
        # An anonymous mapping, not a bytearray: it costs memory only once read into, and is
        # given back to the system when dropped (malloc keeps freed windows in its heap).
        self.data = mmap.mmap(-1, size)
        self.refs = 0
        self.pool = pool


class _Pack:
    """A pack being filled: its pieces are written to its file as soon as they are placed."""

    __slots__ = ("writer", "index", "size", "writes", "desc", "future")

    def __init__(self, writer: PlacedBlobWriter, index: int) -> None:
        self.writer = writer
        self.index = index  # in PackWriter.packs (first-use order)
        self.size = 0
        self.writes: list[Future[None]] = []  # pwrites of its pieces, not yet waited for
        self.desc: Descriptor | None = None
        self.future: Future[Descriptor] | None = None


@dataclass
class _Piece:
    file: int
    offset: int
    raw: int
    zero: bool = False
    view: Any = None  # raw bytes (memoryview into a window buffer, or bytes)
    digest: bytes = b""
    at: int = -1  # where ``view`` starts in its window buffer (-1: not in one)
    stored: Any = None  # zstd frame when compressed and it paid


_ZERO_DIGEST = b"\0" * 32
_RECORD_PACK = lay.RECORD.pack


@dataclass
class PackResult:
    table: bytearray  # lay.RECORD records back to back; layer field = index in ``packs`` (NO_LAYER: zero piece)
    packs: list[Descriptor]  # every pack blob referenced, first-use order
    new_bytes: int
    new_blobs: int
    stats: dict[str, int] = field(default_factory=dict)
    algorithm: str = lay.PIECE_DIGEST  # of the records' digests
    _first_pack: int = 0  # what ``table``'s layer fields are relative to now

    def encode_table(self, first_pack: int) -> bytes:
        """The compressed piece table, with ``packs[i]`` at manifest layer ``first_pack + i``."""
        arr = _records(self.table)  # in place: no copy of a table of 270k pieces
        li = arr["li"]
        li[li != lay.NO_LAYER] += np.uint32(first_pack - self._first_pack)
        self._first_pack = first_pack
        return lay.encode_packed_table(self.table, self.algorithm)

    def renumber_files(self, numbers: dict[int, int]) -> None:
        """Give the pieces of file ``k`` the file index ``numbers[k]`` (files packed before
        their place in the artifact's file list was known: follow.py)."""
        if not numbers:
            return
        fi = _records(self.table)["fi"]
        old = fi.copy()
        for k, v in numbers.items():
            fi[old == k] = v


def _records(table: bytearray) -> np.ndarray:
    rec = np.dtype([("fo", "<u8"), ("bo", "<u8"), ("fi", "<u4"), ("li", "<u4"), ("raw", "<u4"), ("stored", "<u4"),
                    ("flags", "<u4"), ("res", "<u4"), ("digest", "V32")])
    assert rec.itemsize == lay.RECORD.size
    return np.frombuffer(table, dtype=rec)


class PackWriter:
    """Writes the pieces of several files (one after the other) into pack blobs of ``store``.

    ``pool`` reads windows, finds zero pages, hashes and compresses pieces (one thread per
    core). Packs are filled ``LANES`` at a time, consecutive windows going to consecutive lanes;
    each lane's thread writes a window's new pieces into its open pack's file (``pwritev``
    straight from the window, which is then free again) and hashes them for the pack digest as
    it goes, so ``LANES`` pack digests run at once with no read-back. ``sealers`` commit full
    packs as pending blobs (made durable together at the store's publish). The main thread only
    decides, in file order, which pieces are new and where they go: the artifact depends on the
    input only, not on timing or the number of cores.
    """

    def __init__(self, store: OciStore, *, compress: bool, params: PackParams = PackParams(),
                 known: KnownIndex | None = None, on_blob: Callable[[Descriptor], None] | None = None,
                 workers: int | None = None, nice: int = 0) -> None:
        self.store = store
        self.compress = compress
        self.p = params
        self.known = known if known is not None else KnownIndex()
        self.algorithm = lay.PIECE_DIGEST  # every piece of one table has the same digest
        self.on_blob = on_blob
        workers = max(1, workers or usable_cores())
        # ``nice``: the threads' nice value (gpusnap.host.priority), raised where the pack runs
        # beside a dump.
        self.nice = nice
        self.pool = yielding_pool(workers, "gpusnap-pack", nice)
        self._retired: list[ThreadPoolExecutor] = []  # pools replaced by widen(): shut down with the others
        self.lanes = [yielding_pool(1, f"gpusnap-pack-lane{i}", nice) for i in range(LANES)]
        self.sealers = yielding_pool(workers, "gpusnap-pack-seal", nice)
        self.free: queue.Queue[_Buffer] = queue.LifoQueue()  # reuse warm windows; cold ones never cost memory
        self._window_size = params.window + (params.max_pages + params.zero_min_pages + 1) * PAGE
        self.nbuf = 0
        self._size_for(workers)
        self.inflight: collections.deque[tuple[_Buffer | None, Future[list[_Piece]]]] = collections.deque()
        self.fresh: dict[bytes, int] = {}  # new pieces: digest → record index in ``table``
        self.table = bytearray()
        self.nrecords = 0
        self.packs: list[Any] = []  # _Pack (new) or Descriptor (known), first-use order
        self._known_at: dict[str, int] = {}
        self.all_new: list[_Pack] = []
        self.open: list[_Pack | None] = [None] * LANES  # each lane's pack being filled
        self.seq = 0  # units (windows, batches) placed so far: unit i fills lane i % LANES
        self.sealing: collections.deque[_Pack] = collections.deque()
        self.new_bytes = 0
        self.stats = {"pieces": 0, "zero_pieces": 0, "zero_bytes": 0, "deduped_pieces": 0, "deduped_bytes": 0,
                      "new_pieces": 0, "compressed_pieces": 0}
        self._lock = threading.Lock()
        self._failed: BaseException | None = None
        self._fds: list[int] = []

    def widen(self, workers: int) -> None:
        """Read and hash on ``workers`` threads from now on (never fewer than before): a
        follower's writer runs on few threads while CRIU dumps, so as not to slow the dump, and
        on all the cores for what is left once the dump has ended. Main thread only."""
        if workers <= self.workers:
            return
        # ThreadPoolExecutor cannot grow: a new pool takes the next windows while the old one
        # finishes those it has (the main thread waits for them in order all the same).
        self._retired.append(self.pool)
        self.pool = yielding_pool(workers, "gpusnap-pack", self.nice)
        self._size_for(workers)

    def _size_for(self, workers: int) -> None:
        """The bounds that follow the read pool's thread count, and windows to match (added,
        never taken away)."""
        self.workers = workers
        self.depth = workers + 2  # windows read and hashed at once
        self.max_sealing = 2 * workers + 2  # packs hashed/flushed at once before the reads wait
        # Windows: the reads in flight, plus those whose new pieces are being written (a write
        # is a memcpy into the page cache, so few are; when the disk holds the writes back, the
        # reads wait for them), plus the main thread's.
        nbuf = self.depth + max(4, workers // 2) + 2
        for _ in range(nbuf - self.nbuf):
            self.free.put(_Buffer(self._window_size, self.free))
        self.nbuf = max(self.nbuf, nbuf)

    # -- worker side -------------------------------------------------------------------------
    def _read_and_hash(self, buf: _Buffer, fd: int, fi: int, bounds: np.ndarray) -> list[_Piece]:
        """Worker: read pages [bounds[0], bounds[-1]) of ``fd`` into ``buf``, find the zero
        pieces among ``bounds``' pieces and hash the others (aligned cutting needs no data to
        place its cuts, so whole windows run here, reads included, off the main thread)."""
        start = int(bounds[0]) * PAGE
        length = (int(bounds[-1]) - int(bounds[0])) * PAGE
        mv = memoryview(buf.data)[:length]
        got = 0
        while got < length:
            n = os.preadv(fd, [mv[got:]], start + got)
            if n <= 0:
                raise IntegrityError(f"pages file ended {length - got} bytes early; it changed while being stored")
            got += n
        zero = page_zero(mv, length // PAGE)
        rel = (bounds - bounds[0]).astype(np.int64)
        allzero = np.logical_and.reduceat(zero, rel[:-1])
        pieces: list[_Piece] = []
        for k in range(len(rel) - 1):
            a, b = int(rel[k]) * PAGE, int(rel[k + 1]) * PAGE
            if allzero[k]:
                if pieces and pieces[-1].zero and pieces[-1].offset + pieces[-1].raw == start + a:
                    pieces[-1].raw += b - a
                else:
                    pieces.append(_Piece(fi, start + a, b - a, zero=True))
            else:
                pieces.append(_Piece(fi, start + a, b - a, view=mv[a:b], at=a))
        self._hash(pieces)
        return pieces

    def _hash(self, pieces: list[_Piece]) -> list[_Piece]:
        zc = zstandard.ZstdCompressor(level=self.p.compress_level) if self.compress else None
        misses = 0
        for pc in pieces:
            if pc.zero:
                continue
            pc.digest = lay.piece_hash(self.algorithm, pc.view)
            if zc is not None and pc.digest not in self.known and misses < 8:
                frame = zc.compress(pc.view)
                if len(frame) <= pc.raw * (1 - self.p.compress_min_saving):
                    pc.stored = frame
                    misses = 0
                else:
                    misses += 1  # incompressible data (weights): stop trying for this window
        return pieces

    def _write(self, buf: _Buffer | None, runs: list[tuple[_Pack, int, list[Any]]]) -> None:
        """A lane's thread: write runs of new pieces (consecutive in their pack) where they go,
        in order, so that the pack's writer hashes them as written."""
        try:
            for pack, off, views in runs:
                pack.writer.pwrite(views, off)
        except BaseException as exc:
            self._failed = self._failed or exc
            raise
        finally:
            if buf is not None:
                self._release(buf)

    def _commit_pack(self, pack: _Pack) -> Descriptor:
        """sealers: once every piece is in the file (and hashed), add it as a pending blob."""
        try:
            for f in pack.writes:
                f.result()
            pack.writes = []
            digest = pack.writer.commit(pack.size)  # hashed as written
            desc = Descriptor(lay.MEDIA_PACK, digest, pack.size)
            pack.desc = desc
            if self.on_blob is not None:
                self.on_blob(desc)
            return desc
        except BaseException as exc:
            pack.writer.abort()
            self._failed = self._failed or exc
            raise

    # -- main thread -------------------------------------------------------------------------
    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _get_buffer(self) -> _Buffer:
        try:
            return self.free.get_nowait()
        except queue.Empty:
            pass
        while self.inflight:
            self._drain_one()
        while True:
            self._check()
            try:
                return self.free.get(timeout=0.5)
            except queue.Empty:
                pass

    def _new_pack(self) -> _Pack:
        # Not fdatasynced as sealed: the store's publish makes all packs durable together (see
        # OciStore._make_durable); their writeback starts as each piece is written.
        pack = _Pack(self.store.placed_writer(), len(self.packs))
        self.packs.append(pack)
        self.all_new.append(pack)
        return pack

    def _seal(self, pack: _Pack) -> None:
        pack.future = self.sealers.submit(self._commit_pack, pack)
        self.sealing.append(pack)
        while self.sealing and self.sealing[0].future.done():  # type: ignore[union-attr]
            self.sealing.popleft().future.result()  # type: ignore[union-attr]
        while len(self.sealing) > self.max_sealing:  # the disk is behind: let it catch up
            self.sealing.popleft().future.result()  # type: ignore[union-attr]

    def _submit(self, buf: _Buffer | None, pieces: list[_Piece]) -> None:
        if buf is not None:
            with self._lock:
                buf.refs += 1  # the window itself, until its results are placed
        self.inflight.append((buf, self.pool.submit(self._hash, pieces)))
        while len(self.inflight) > self.depth:
            self._drain_one()

    def _submit_read(self, buf: _Buffer, fd: int, fi: int, bounds: np.ndarray) -> None:
        with self._lock:
            buf.refs += 1
        self.inflight.append((buf, self.pool.submit(self._read_and_hash, buf, fd, fi, bounds)))
        while len(self.inflight) > self.depth:
            self._drain_one()

    def _record(self, fo: int, bo: int, fi: int, li: int, raw: int, stored: int, flags: int, digest: bytes) -> None:
        self.table += _RECORD_PACK(fo, bo, fi, li, raw, stored, flags, 0, digest)
        self.nrecords += 1

    def _known_pack(self, desc: Descriptor) -> int:
        i = self._known_at.get(desc.digest)
        if i is None:
            i = self._known_at[desc.digest] = len(self.packs)
            self.packs.append(desc)
        return i

    def _flush(self, buf: _Buffer | None, runs: list[tuple[_Pack, int, list[Any]]], lane: int) -> None:
        if not runs:
            return
        if buf is not None:
            with self._lock:
                buf.refs += 1
        fut = self.lanes[lane].submit(self._write, buf, runs)
        for pack in {id(r[0]): r[0] for r in runs}.values():
            pack.writes.append(fut)

    def _drain_one(self) -> None:
        self._check()
        buf, fut = self.inflight.popleft()
        try:
            pieces = fut.result()
        except BaseException:
            if buf is not None:
                self._release(buf)
            raise
        runs: list[tuple[_Pack, int, list[Any]]] = []  # new pieces of this window, per pack, consecutive
        stats = self.stats
        lane = self.seq % LANES
        self.seq += 1
        span_start = span_end = -2  # the window bytes that the last view of ``runs`` spans
        try:
            for pc in pieces:
                stats["pieces"] += 1
                if pc.zero:
                    stats["zero_pieces"] += 1
                    stats["zero_bytes"] += pc.raw
                    self._record(pc.offset, 0, pc.file, lay.NO_LAYER, pc.raw, 0, lay.FLAG_ZERO, _ZERO_DIGEST)
                    continue
                k = self.known.get(pc.digest)
                if k is not None and k.raw == pc.raw:
                    stats["deduped_pieces"] += 1
                    stats["deduped_bytes"] += pc.raw
                    self._record(pc.offset, k.blob_offset, pc.file, self._known_pack(k.blob), pc.raw, k.stored, k.flags, pc.digest)
                    continue
                r = self.fresh.get(pc.digest)
                if r is not None:
                    _fo, bo, _fi, li, raw, stored, flags, _res, _sha = lay.RECORD.unpack_from(self.table, r * lay.RECORD.size)
                    if raw == pc.raw:
                        stats["deduped_pieces"] += 1
                        stats["deduped_bytes"] += pc.raw
                        self._record(pc.offset, bo, pc.file, li, raw, stored, flags, pc.digest)
                        continue
                compressed = pc.stored is not None
                data = pc.stored if compressed else pc.view
                stats["compressed_pieces"] += compressed
                pack = self.open[lane] or self._new_pack()
                self.open[lane] = pack
                n = len(data)
                off = pack.size
                pack.size += n
                if runs and runs[-1][0] is pack:
                    if not compressed and pc.at >= 0 and pc.at == span_end:
                        # Adjacent in the window and in the pack: one view, so that the lane
                        # hashes and writes the run in one call and one iovec instead of one per
                        # piece (the same packs; no change in the store's speed was measured).
                        runs[-1][2][-1] = memoryview(buf.data)[span_start:pc.at + pc.raw]  # type: ignore[union-attr]
                    else:
                        runs[-1][2].append(data)
                        span_start = pc.at
                else:
                    runs.append((pack, off, [data]))
                    span_start = pc.at
                span_end = pc.at + pc.raw if not compressed and pc.at >= 0 else -2
                self.fresh[pc.digest] = self.nrecords
                self._record(pc.offset, off, pc.file, pack.index, pc.raw, n, lay.FLAG_ZSTD if compressed else 0, pc.digest)
                stats["new_pieces"] += 1
                self.new_bytes += n
                pc.view = pc.stored = None
                if pack.size >= self.p.pack_target:
                    self._flush(buf, runs, lane)
                    runs = []
                    self.open[lane] = None
                    self._seal(pack)
            self._flush(buf, runs, lane)
        finally:
            if buf is not None:
                self._release(buf)

    def _release(self, buf: _Buffer) -> None:
        with self._lock:
            buf.refs -= 1
            if buf.refs == 0:
                buf.pool.put(buf)

    # -- feeding files ---------------------------------------------------------------------------
    def add_pages_fd(self, file_index: int, fd: int, size: int, ranges: list[Any], *, from_page: int = 0) -> int:
        """Cut a pages file that can be read at any offset (a file of a checkpoint directory)
        by address: windows of whole pieces are read, checked for zeros and hashed by the
        workers in parallel; this thread only schedules them and places the results.
        ``from_page``: the windows before that cut were added already (add_pages_window, by
        a DumpFollower while CRIU wrote the file); the windows are the same either way."""
        cuts = AlignedCutter(ranges, self.p.piece_pages).cuts
        if int(cuts[-1]) * PAGE != size:
            raise IntegrityError(f"pages file is {size} bytes, its pagemap says {int(cuts[-1]) * PAGE}")
        i = int(np.searchsorted(cuts, from_page))
        if i >= len(cuts) or int(cuts[i]) != from_page:
            raise IntegrityError(f"page {from_page} is not where a piece of this pages file starts")
        fd = self.adopt_fd(os.dup(fd))  # the caller may close its file before the workers have read it
        per = self.p.window // PAGE
        while i < len(cuts) - 1:
            j = window_end(cuts, i, per)
            self.add_pages_window(fd, file_index, cuts[i:j + 1])
            i = j
        return size

    def add_pages_window(self, fd: int, file_index: int, bounds: np.ndarray) -> None:
        """One window of a pages file: the pieces between consecutive ``bounds`` (page
        indexes), read from ``fd`` (kept open until the writer finishes) by a worker."""
        self._submit_read(self._get_buffer(), fd, file_index, bounds)

    def adopt_fd(self, fd: int) -> int:
        """``fd`` is closed when the writer finishes or aborts (its workers may read it until then)."""
        self._fds.append(fd)
        return fd

    def add_pages(self, file_index: int, stream: Any, size: int, ranges: list[Any] | None) -> int:
        """Cut a pages file read from ``stream`` (``readinto``); returns the bytes read.

        ``ranges``: its pagemap ranges (pagemap.ranges_of); None: page-level CDC instead."""
        if ranges and self.p.cut == "vaddr":
            cutter: Any = AlignedCutter(ranges, self.p.piece_pages)
        else:
            cutter = PageCutter(self.p, [r.file_offset // PAGE for r in ranges] if ranges else None)
        buf_start = 0  # file offset of buf.data[0]
        carry = b""
        total = 0
        while True:
            buf = self._get_buffer()
            mv = memoryview(buf.data)
            mv[: len(carry)] = carry
            fill = len(carry)
            want = min(self.p.window, size - total) if size >= 0 else self.p.window
            got = 0
            while got < want:
                n = stream.readinto(mv[fill + got: fill + want])
                if not n:
                    break
                got += n
            total += got
            end = fill + got
            whole = (total // PAGE) * PAGE - cutter.pos * PAGE  # bytes of complete new pages
            npages = whole // PAGE
            pieces: list[_Piece] = []
            if npages:
                first = fill  # new pages start after the carried bytes
                zero, cut = page_features(mv[first: first + npages * PAGE], npages, self.p.divisor)
                for a, b, z in cutter.feed(zero, cut):
                    pieces.append(self._piece(file_index, a * PAGE, (b - a) * PAGE, z, mv, buf_start))
            eof = got < want or total >= size
            if eof:
                for a, b, z in cutter.finish():
                    pieces.append(self._piece(file_index, a * PAGE, (b - a) * PAGE, z, mv, buf_start))
                rest = total - cutter.pos * PAGE  # a partial last page (not a CRIU pages file)
                if rest:
                    pieces.append(self._piece(file_index, cutter.pos * PAGE, rest, False, mv, buf_start))
                self._submit(buf, pieces)
                return total
            keep = cutter.keep_from()
            keep_off = (keep if keep is not None else cutter.pos) * PAGE
            carry = bytes(mv[keep_off - buf_start: end])
            self._submit(buf, pieces)
            buf_start = keep_off

    def _piece(self, fi: int, off: int, length: int, zero: bool, mv: memoryview, buf_start: int) -> _Piece:
        if zero:
            return _Piece(fi, off, length, zero=True)
        return _Piece(fi, off, length, view=mv[off - buf_start: off - buf_start + length], at=off - buf_start)

    def add_cdc(self, file_index: int, stream: IO[bytes], size: int) -> int:
        """Cut any other large file with FastCDC; pieces are copied out of pyfastcdc's buffer."""
        cdc = FastCDC(self.p.cdc_avg, min_size=self.p.cdc_min, max_size=self.p.cdc_max)
        from gpusnap.packaging.chunker import _Limited

        offset = 0
        batch: list[_Piece] = []
        batch_bytes = 0
        for c in cdc.cut_stream(_Limited(stream, size)):
            data = bytes(c.data)
            batch.append(_Piece(file_index, offset, len(data), view=data))
            offset += len(data)
            batch_bytes += len(data)
            if batch_bytes >= self.p.window:
                self._submit(None, batch)
                batch, batch_bytes = [], 0
        if batch:
            self._submit(None, batch)
        return offset

    def seal_open(self) -> None:
        """Seal the packs being filled now, so that they are committed (and ``on_blob`` told,
        which starts their uploads) without waiting for :meth:`finish`; what comes next goes to
        new packs. For a natural break in the input: the follower calls it once a dump's pages
        are all in, so the last packs go up while the runtime still copies the GPU state back,
        instead of after the whole store."""
        while self.inflight:
            self._drain_one()
        for lane, pack in enumerate(self.open):
            if pack is not None:
                self.open[lane] = None
                self._seal(pack)

    def finish(self) -> PackResult:
        self.seal_open()
        while self.sealing:
            self.sealing.popleft().future.result()  # type: ignore[union-attr]
        self._check()
        packs = [pk.desc if isinstance(pk, _Pack) else pk for pk in self.packs]
        self._shutdown(cancel=False)
        return PackResult(self.table, packs, self.new_bytes, len(self.all_new), self.stats, self.algorithm)  # type: ignore[arg-type]

    def abort(self) -> None:
        self._failed = self._failed or RuntimeError("aborted")
        for _, fut in self.inflight:
            fut.cancel()
        self._shutdown(cancel=True)
        for pack in self.all_new:
            if pack.desc is None:
                pack.writer.abort()  # its file never became a blob: leave nothing in ingest/

    def _shutdown(self, cancel: bool) -> None:
        # reads first (they feed nothing once the main thread stops), then the writes the
        # sealers wait for, then the sealers
        for pool in (*self._retired, self.pool, *self.lanes, self.sealers):
            pool.shutdown(wait=True, cancel_futures=cancel)
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
