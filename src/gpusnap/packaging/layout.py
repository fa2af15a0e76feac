"""Where every byte of a checkpoint artifact lies: blob → placements in the checkpoint's files.

The one view of an artifact (format v1 or v2) that readers need to rebuild the checkpoint tree
without going through the local store: for each blob, which byte ranges of it go to which offset
of which file, how long they are stored and raw, whether they are a zstd frame, and the digest
of their raw bytes (v2: BLAKE3, or SHA-256 in tables written before it) for verification as they
land. ``pull`` straight into an image directory
and ``materialize`` both work from this.

v1 (docs/artifact-format.md, "v1 chunk layers"): every chunk layer is one placement at blob
offset 0 covering the whole blob; its digest is the blob digest (no per-piece digest).
v2 ("packed pieces"): a piece table blob lists every piece of every chunked file; pieces are
stored in pack blobs, several pieces per blob, each piece raw or one zstd frame.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import blake3
import zstandard

from gpusnap.errors import IntegrityError
from gpusnap.packaging.store import Descriptor

# Media types of format v2 (v1's are in artifact.py and stay readable).
MEDIA_PACK = "application/vnd.gpusnap.checkpoint.pack.v2"
MEDIA_PIECES = "application/vnd.gpusnap.checkpoint.pieces.v2+zstd"
MEDIA_CRIU = "application/vnd.gpusnap.checkpoint.criu.v1.tar"
MEDIA_ENGINE = "application/vnd.gpusnap.checkpoint.engine.v1.tar"
_V1_CHUNK = (
    "application/vnd.gpusnap.checkpoint.pages.v1.chunk",
    "application/vnd.gpusnap.checkpoint.rootfs-diff.v1.chunk",
    "application/vnd.gpusnap.checkpoint.data.v1.chunk",
)
ZSTD_SUFFIX = "+zstd"
A_FILE = "io.gpusnap.checkpoint.file"
A_OFFSET = "io.gpusnap.checkpoint.offset"
A_LENGTH = "io.gpusnap.checkpoint.length"

# Piece table (the MEDIA_PIECES blob, zstd-decompressed): header then fixed-size records.
# The magic names the piece digest: SHA-256 in the first v2 tables, BLAKE3 since (both 32 bytes,
# the record unchanged). BLAKE3 because every byte of a checkpoint is hashed twice on the way to
# a registry (its piece's digest, then its pack's OCI digest, which must be SHA-256) and once
# more on the way back; the piece digest at 3-5x SHA-256's speed per core took a quarter of the
# store's CPU time off on this project's 2-core machine.
DIGEST_SHA256, DIGEST_BLAKE3 = "sha256", "blake3"
PIECE_DIGEST = DIGEST_BLAKE3  # what new tables use
_TABLE_MAGIC = {DIGEST_SHA256: b"GSPIECE2", DIGEST_BLAKE3: b"GSPIECE3"}
_DIGEST_OF_MAGIC = {m: d for d, m in _TABLE_MAGIC.items()}
_HASHERS: dict[str, Callable[..., Any]] = {DIGEST_SHA256: hashlib.sha256, DIGEST_BLAKE3: blake3.blake3}
_HEADER = struct.Struct("<8sII")  # magic, record count, record size
# file_offset, blob_offset, file index (into config "files"), layer index (into manifest
# "layers"; NO_LAYER for a zero piece), raw length, stored length, flags, reserved, digest(raw)
RECORD = struct.Struct("<QQIIIIII32s")
NO_LAYER = 0xFFFFFFFF
FLAG_ZSTD = 1
FLAG_ZERO = 2
MAX_PIECE = 16 << 20  # no v2 piece is larger; a table claiming more is rejected
MAX_TABLE = 512 << 20


def base_media(media_type: str) -> str:
    return media_type[: -len(ZSTD_SUFFIX)] if media_type.endswith(ZSTD_SUFFIX) else media_type


@dataclass(frozen=True)
class FileEntry:
    """A file of the checkpoint tree that is stored in pieces (not in a tar layer)."""

    path: str  # relative to the tree root (podman: CRIU images under "checkpoint/")
    size: int
    mode: int
    uid: int
    gid: int
    uname: str
    gname: str
    mtime: int
    role: str  # pages | rootfs | data


@dataclass(frozen=True, slots=True)  # slots: a restore holds one per piece (~1M for 64 GiB)
class Placement:
    """``stored_length`` bytes at ``blob_offset`` of a blob give ``raw_length`` bytes at
    ``file_offset`` of ``path`` (zstd-decompressed first when ``compressed``)."""

    path: str
    file_offset: int
    blob_offset: int
    stored_length: int
    raw_length: int
    compressed: bool
    digest: bytes | None  # raw bytes' digest (32 bytes); None in v1 (the blob digest covers it)
    algorithm: str = DIGEST_SHA256  # of ``digest``: the piece table's (an interned str: 8 bytes a piece)

    def matches(self, raw: bytes | bytearray | memoryview) -> bool:
        """Are ``raw`` the bytes this piece's digest was made of? (v1: no digest, always.)"""
        return self.digest is None or piece_hash(self.algorithm, raw) == self.digest

    def hasher(self) -> Any:
        """A fresh hash object of the piece's algorithm, for bytes that come in parts."""
        return _HASHERS[self.algorithm]()


@dataclass
class BlobPlan:
    descriptor: Descriptor
    placements: list[Placement]  # sorted by blob_offset; one stored range may feed several placements

    def to_wire(self) -> dict[str, Any]:
        """As JSON, for a transfer process (gpusnap.packaging.transfer_worker)."""
        return {"descriptor": self.descriptor.to_dict(),
                "placements": [[p.path, p.file_offset, p.blob_offset, p.stored_length, p.raw_length, p.compressed,
                                p.digest.hex() if p.digest is not None else None, p.algorithm] for p in self.placements]}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> "BlobPlan":
        return cls(Descriptor.from_dict(wire["descriptor"]),
                   [Placement(path, fo, bo, sl, rl, bool(z), bytes.fromhex(h) if h is not None else None, digest_algorithm(a))
                    for path, fo, bo, sl, rl, z, h, a in wire["placements"]])


@dataclass
class Layout:
    version: int  # 1 or 2
    files: list[FileEntry]
    blobs: list[BlobPlan]  # every blob holding file data, manifest order
    tar_layers: list[Descriptor]  # criu/engine tar layers to extract (same in v1 and v2)
    zeros: list[tuple[str, int, int]] = field(default_factory=list)  # (path, offset, length): leave a hole
    criu_dir: str = ""  # the CRIU image directory inside the tree ("checkpoint" for podman)
    pieces_layer: Descriptor | None = None  # v2: the piece table blob

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)


def _file_entries(config: dict[str, Any]) -> list[FileEntry]:
    out = []
    for f in config.get("files", []):
        try:
            out.append(FileEntry(str(f["path"]), int(f["size"]), int(f["mode"]), int(f["uid"]), int(f["gid"]),
                                 str(f.get("uname", "")), str(f.get("gname", "")), int(f["mtime"]), str(f.get("role", "data"))))
        except (KeyError, TypeError, ValueError):
            raise IntegrityError(f"checkpoint config lists a malformed file entry {str(f)[:100]}; the artifact is corrupt") from None
        if out[-1].size < 0 or out[-1].path.startswith("/") or ".." in out[-1].path.split("/"):
            raise IntegrityError(f"checkpoint config lists a bad file entry {out[-1].path!r}; the artifact is corrupt")
    return out


def digest_algorithm(name: str) -> str:
    """``name`` as the interned constant of a known piece digest (IntegrityError otherwise)."""
    for known in _HASHERS:
        if name == known:
            return known
    raise IntegrityError(f"piece digest {name!r} is not one this gpusnap knows; upgrade gpusnap")


def piece_hash(algorithm: str, data: bytes | bytearray | memoryview) -> bytes:
    """The digest a piece table of ``algorithm`` records for the raw bytes ``data``."""
    return _HASHERS[algorithm](data).digest()


def encode_table(records: Iterable[tuple[int, int, int, int, int, int, int, bytes]], algorithm: str | None = None) -> bytes:
    """Records (file_offset, blob_offset, file, layer, raw, stored, flags, digest) → compressed table
    (``algorithm``: the records' digest, :data:`PIECE_DIGEST` as it is at the call by default)."""
    body = bytearray()
    for r in records:
        body += RECORD.pack(r[0], r[1], r[2], r[3], r[4], r[5], r[6], 0, r[7])
    return encode_packed_table(body, algorithm)


def encode_packed_table(body: bytes | bytearray | memoryview, algorithm: str | None = None) -> bytes:
    """Records already packed with :data:`RECORD` back to back → compressed table (the writer
    keeps its records in this form: 72 bytes a piece instead of a tuple of Python objects)."""
    if len(body) % RECORD.size:
        raise ValueError("packed records are not a whole number of records")
    cctx = zstandard.ZstdCompressor(level=3)
    out = cctx.compressobj(size=_HEADER.size + len(body))
    head = out.compress(_HEADER.pack(_TABLE_MAGIC[algorithm or PIECE_DIGEST], len(body) // RECORD.size, RECORD.size))
    return head + out.compress(body) + out.flush()


def _table_body(data: bytes) -> tuple[str, memoryview]:
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_TABLE)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"piece table is not a zstd frame ({exc}); the artifact is corrupt") from None
    if len(raw) < _HEADER.size:
        raise IntegrityError("piece table is truncated; the artifact is corrupt")
    magic, n, size = _HEADER.unpack_from(raw)
    if size != RECORD.size or len(raw) != _HEADER.size + n * size:
        raise IntegrityError("piece table header does not match its content; the artifact is corrupt")
    algorithm = _DIGEST_OF_MAGIC.get(magic)
    if algorithm is None:
        raise IntegrityError(f"piece table format {magic[:8]!r} is not one this gpusnap reads; upgrade gpusnap (or the artifact is corrupt)")
    return algorithm, memoryview(raw)[_HEADER.size:]


Record = tuple[int, int, int, int, int, int, int, bytes]


def read_table(data: bytes) -> tuple[str, Iterable[Record]]:
    """A compressed table's piece digest algorithm and its records, one at a time (the table is
    checked first)."""
    algorithm, body = _table_body(data)
    return algorithm, ((r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[8]) for r in RECORD.iter_unpack(body))


def iter_table(data: bytes) -> Iterable[Record]:
    """The records of a compressed table, one at a time (the table is checked first)."""
    return read_table(data)[1]


def decode_table(data: bytes) -> list[Record]:
    return list(iter_table(data))


def layout_from_parts(manifest: dict[str, Any], config: dict[str, Any], read_blob: Callable[[Descriptor], bytes]) -> Layout:
    """The layout of an artifact from its manifest and config.

    ``read_blob(desc)`` returns the verified bytes of a small blob; it is called once, for the
    v2 piece table (a few MB per 20 GB), never for v1.
    """
    layers = [Descriptor.from_dict(x) for x in manifest.get("layers", [])]
    files = _file_entries(config)
    version = int(config.get("schemaVersion", 1))
    criu_dir = str(config.get("criuDir", ""))
    tars = [d for d in layers if base_media(d.media_type) in (MEDIA_CRIU, MEDIA_ENGINE)]
    if version == 1:
        return _layout_v1(layers, files, tars, criu_dir)
    if version != 2:
        raise IntegrityError(f"checkpoint config schema {version} has no known layout; upgrade gpusnap")
    tables = [d for d in layers if d.media_type == MEDIA_PIECES]
    if len(tables) != 1:
        raise IntegrityError(f"a v2 checkpoint needs exactly one piece table layer, found {len(tables)}; the artifact is corrupt")
    algorithm, records = read_table(read_blob(tables[0]))
    plans: dict[int, BlobPlan] = {}
    zeros: list[tuple[str, int, int]] = []
    expect = [0] * len(files)
    for fo, bo, fi, li, raw, stored, flags, digest in records:
        if fi >= len(files) or fo != expect[fi] or raw <= 0 or raw > MAX_PIECE and not flags & FLAG_ZERO:
            raise IntegrityError(f"piece table entry (file {fi}, offset {fo}) is out of order or malformed; the artifact is corrupt")
        expect[fi] = fo + raw
        path = files[fi].path
        if flags & FLAG_ZERO:
            zeros.append((path, fo, raw))
            continue
        if li >= len(layers) or layers[li].media_type != MEDIA_PACK or bo + stored > layers[li].size or stored > MAX_PIECE:
            raise IntegrityError(f"piece of {path} at {fo} points outside its pack blob; the artifact is corrupt")
        plan = plans.get(li)
        if plan is None:
            plan = plans[li] = BlobPlan(layers[li], [])
        plan.placements.append(Placement(path, fo, bo, stored, raw, bool(flags & FLAG_ZSTD), digest, algorithm))
    for f, n in zip(files, expect):
        if n != f.size:
            raise IntegrityError(f"{f.path}: pieces cover {n} of {f.size} bytes; the artifact is corrupt")
    blobs = [plans[i] for i in sorted(plans)]
    for p in blobs:
        p.placements.sort(key=lambda x: (x.blob_offset, x.path, x.file_offset))
    return Layout(2, files, blobs, tars, zeros, criu_dir, tables[0])


def _layout_v1(layers: list[Descriptor], files: list[FileEntry], tars: list[Descriptor], criu_dir: str) -> Layout:
    known = {f.path for f in files}
    covered: dict[str, int] = {}
    blobs = []
    for d in layers:
        if base_media(d.media_type) not in _V1_CHUNK:
            continue
        path = d.annotations.get(A_FILE)
        if not path or path not in known:
            raise IntegrityError(f"chunk layer {d.digest} names no file of the config; the artifact is corrupt")
        try:
            off, length = int(d.annotations.get(A_OFFSET, "0")), int(d.annotations[A_LENGTH])
        except (KeyError, ValueError):
            raise IntegrityError(f"chunk layer {d.digest} lacks offset/length; the artifact is corrupt") from None
        covered[path] = covered.get(path, 0) + length
        blobs.append(BlobPlan(d, [Placement(path, off, 0, d.size, length, d.media_type.endswith(ZSTD_SUFFIX), None)]))
    for f in files:
        if covered.get(f.path, 0) != f.size:
            raise IntegrityError(f"{f.path}: chunks do not add up to {f.size} bytes; the artifact is corrupt")
    return Layout(1, files, blobs, tars, [], criu_dir)


def layout_of(store: Any, art: Any) -> Layout:
    """The layout of a loaded artifact (``artifact.load``) in an :class:`OciStore`."""
    return layout_from_parts(art.manifest, art.config, lambda d: store.read_bytes(d.digest, limit=MAX_TABLE))


def target_path(path: str, prefix: str | None) -> str | None:
    """Where a tree path goes in the output: ``prefix`` is the CRIU dir to strip (None keeps the
    whole tree). None: the file is not part of the output (e.g. podman's engine files for a
    CRIU image directory)."""
    if prefix is None or not prefix:
        return path
    if path.startswith(prefix + "/"):
        return path[len(prefix) + 1:]
    return None


# ---- turning stored bytes into file bytes, verified ---------------------------------------------
_dctx = zstandard.ZstdDecompressor  # one per call: ZstdDecompressor objects are not thread-safe


def piece_bytes(p: Placement, stored: bytes | bytearray | memoryview) -> bytes | memoryview:
    """The raw bytes of a placement from its stored bytes, checked against length and digest.

    Raises :class:`IntegrityError` on any mismatch. v1 placements (``digest`` None) are checked
    only for length: their blob digest is what verifies them.
    """
    if len(stored) != p.stored_length:
        raise IntegrityError(f"{p.path} at {p.file_offset}: got {len(stored)} stored bytes, expected {p.stored_length}")
    if p.compressed:
        try:
            raw: bytes | memoryview = _dctx().decompress(stored, max_output_size=p.raw_length)
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"{p.path} at {p.file_offset}: piece does not decompress ({exc}); the blob is corrupt") from None
    else:
        raw = memoryview(stored)
    if len(raw) != p.raw_length:
        raise IntegrityError(f"{p.path} at {p.file_offset}: piece holds {len(raw)} bytes, expected {p.raw_length}; the blob is corrupt")
    if not p.matches(raw):
        raise IntegrityError(f"{p.path} at {p.file_offset}: piece digest mismatch; the blob is corrupt — pull the checkpoint again")
    return raw


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError("short pwrite")
        view = view[n:]
        offset += n


def _read_exact(stream: Any, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = stream.readinto(buf[got:])
        if not n:
            raise IntegrityError(f"blob ended {len(buf) - got} bytes early; the transfer or the blob is truncated")
        got += n


RUN_MAX = 4 << 20  # bytes of contiguous pieces read and written with one call each (per thread)


def _run_end(ps: list[Placement], i: int) -> int:
    """The end (exclusive) of the run of placements starting at ``i`` that lie back to back in
    the blob and in one file, uncompressed, at most RUN_MAX bytes: read with one call, each
    piece verified, written with one call. A run of one otherwise."""
    p = ps[i]
    j, total = i + 1, p.stored_length
    if p.compressed:
        return j
    while j < len(ps):
        q, prev = ps[j], ps[j - 1]
        if (q.compressed or q.path != p.path or q.blob_offset != prev.blob_offset + prev.stored_length
                or q.file_offset != prev.file_offset + prev.raw_length or total + q.stored_length > RUN_MAX):
            break
        total += q.stored_length
        j += 1
    return j


def place_stream(plan: BlobPlan, stream: Any, fd_for: Callable[[str], int],
                 on_written: Callable[[str, int, int], None] | None = None) -> int:
    """Read one blob sequentially from ``stream`` (anything with ``readinto``) and pwrite each of
    its placements, verified, into ``fd_for(path)`` at its offset. Bytes no placement needs
    (pieces of an older checkpoint sharing the pack) are read and dropped. Returns the raw bytes
    written. The stream must start at blob offset 0; it is read up to the last placement only.

    Placements back to back in the blob and in their file (most of a pack: the pieces of one
    pages range) are read and written as one run (:func:`_run_end`); every piece of the run is
    verified before any of it is written. ``on_written(path, offset, length)``: told of each
    range once it is written (a lazy restore's page server copies it from then on).
    """
    pos = 0
    last: tuple[int, int, bytes | memoryview] | None = None  # (blob_offset, stored_length, raw) of the last piece
    skip = bytearray(1 << 20)
    scratch = bytearray(1 << 20)  # reused: a fresh buffer per piece costs an mmap and page faults
    written = 0
    ps = plan.placements
    i = 0
    while i < len(ps):
        p = ps[i]
        if last is not None and (p.blob_offset, p.stored_length) == last[:2]:
            raw = last[2]  # the same stored piece feeds another place (duplicate content)
            if p.digest is not None and len(raw) != p.raw_length:
                raise IntegrityError(f"{p.path} at {p.file_offset}: duplicate placement disagrees on length; the artifact is corrupt")
            pwrite_all(fd_for(p.path), raw, p.file_offset)
            written += p.raw_length
            if on_written is not None:
                on_written(p.path, p.file_offset, p.raw_length)
            i += 1
            continue
        if p.blob_offset < pos:
            raise IntegrityError(f"blob {plan.descriptor.digest}: overlapping placements; the artifact is corrupt")
        while pos < p.blob_offset:
            n = min(len(skip), p.blob_offset - pos)
            _read_exact(stream, memoryview(skip)[:n])
            pos += n
        j = _run_end(ps, i)
        total = sum(q.stored_length for q in ps[i:j]) if j > i + 1 else p.stored_length
        if len(scratch) < total:
            scratch = bytearray(total)
        data = memoryview(scratch)[:total]
        _read_exact(stream, data)
        pos += total
        if j == i + 1:
            raw = piece_bytes(p, data)  # valid until the next read: duplicates follow at once (sorted)
            last = (p.blob_offset, p.stored_length, raw)
        else:
            at = 0
            for q in ps[i:j]:
                raw = piece_bytes(q, data[at:at + q.stored_length])
                at += q.stored_length
            last = (ps[j - 1].blob_offset, ps[j - 1].stored_length, raw)
            raw = data  # uncompressed: the run's raw bytes are its stored bytes, each piece verified above
        pwrite_all(fd_for(p.path), raw, p.file_offset)
        n = sum(q.raw_length for q in ps[i:j]) if j > i + 1 else p.raw_length
        written += n
        if on_written is not None:
            on_written(p.path, p.file_offset, n)
        i = j
    return written


# ---- writing a tree in two stages (a restore overlaps the second with its own preparation) ------
STAGED_ROLE = "pages"  # what is written last: CRIU's memory pages, the bulk of a checkpoint


class Cancelled(Exception):
    """The writer of a directory was told to stop (the restore it serves failed elsewhere)."""

    def __str__(self) -> str:
        return "stopped: the restore failed elsewhere"


def split_stages(blobs: list[BlobPlan], late: set[str]) -> tuple[list[BlobPlan], list[BlobPlan]]:
    """The blobs in two groups: those holding any byte of a file not in ``late`` (the first
    stage, everything a restore needs before CRIU starts), then those holding only bytes of
    ``late`` files (the pages). A pack that mixes both is placed whole in the first stage, so no
    blob is read twice; each group keeps its order."""
    first = [b for b in blobs if any(p.path not in late for p in b.placements)]
    rest = [b for b in blobs if all(p.path in late for p in b.placements)]
    return first, rest


class BlobQueue:
    """The second stage's blobs, handed out one at a time (``take``, from many threads) in an
    order a lazy restore may change while they are written: the blobs holding CRIU's own pages
    first (:meth:`put_first`, once they are known), and before each ``take`` the blobs holding
    pages the restored process waits for (``wanted()``: (path, offset) pairs the page server
    asked for, gpusnap.criu.landed), so what it touches first comes first."""

    def __init__(self, blobs: list[BlobPlan], wanted: Callable[[], list[tuple[str, int]]] | None = None) -> None:
        self.items = list(blobs)  # the next one first
        self.wanted = wanted
        self.mu = threading.Lock()
        self.index: dict[str, tuple[list[int], list[tuple[int, BlobPlan]]]] = {}
        if wanted is not None:
            spans: dict[str, list[tuple[int, int, BlobPlan]]] = {}
            for b in blobs:
                for p in b.placements:
                    spans.setdefault(p.path, []).append((p.file_offset, p.file_offset + p.raw_length, b))
            for path, got in spans.items():
                got.sort(key=lambda t: t[0])
                self.index[path] = ([lo for lo, _, _ in got], [(hi, b) for _, hi, b in got])

    def put_first(self, wanted: dict[str, list[tuple[int, int]]]) -> None:
        with self.mu:
            self.items = wanted_first(self.items, wanted)

    def _holder(self, path: str, offset: int) -> BlobPlan | None:
        found = self.index.get(path)
        if found is None:
            return None
        k = bisect.bisect_right(found[0], offset) - 1
        if k >= 0 and found[1][k][0] > offset:
            return found[1][k][1]
        return None

    def take(self) -> BlobPlan:
        asked = self.wanted() if self.wanted is not None else []
        with self.mu:
            for path, offset in reversed(asked):  # the first asked ends up in front
                b = self._holder(path, offset)
                if b is not None:
                    for i, queued in enumerate(self.items):
                        if queued is b:
                            self.items.insert(0, self.items.pop(i))
                            break
            return self.items.pop(0)


def written_spans(bp: BlobPlan) -> list[tuple[str, int, int]]:
    """(path, offset, length) of what a blob wrote once it is placed and verified, contiguous
    placements of one file merged (what a restore reports to its page server: gpusnap.criu.landed)."""
    spans: list[tuple[str, int, int]] = []
    for p in sorted(bp.placements, key=lambda p: (p.path, p.file_offset)):
        if spans and spans[-1][0] == p.path and spans[-1][1] + spans[-1][2] == p.file_offset:
            spans[-1] = (p.path, spans[-1][1], spans[-1][2] + p.raw_length)
        else:
            spans.append((p.path, p.file_offset, p.raw_length))
    return spans


def wanted_first(blobs: list[BlobPlan], wanted: dict[str, list[tuple[int, int]]]) -> list[BlobPlan]:
    """``blobs`` with those holding any byte of a ``wanted`` range (path: [(start, end)]) first,
    each group in its order: a lazy restore lets CRIU go once the pages it copies itself are in."""
    from gpusnap.criu.landed import Intervals

    if not wanted:
        return list(blobs)
    sets: dict[str, Intervals] = {}
    for path, ranges in wanted.items():
        for lo, hi in ranges:
            sets.setdefault(path, Intervals()).add(lo, hi)

    def needed(b: BlobPlan) -> bool:
        return any(p.path in sets and sets[p.path].overlaps(p.file_offset, p.file_offset + p.raw_length) for p in b.placements)

    urgent = [needed(b) for b in blobs]
    return [b for b, u in zip(blobs, urgent, strict=True) if u] + [b for b, u in zip(blobs, urgent, strict=True) if not u]
