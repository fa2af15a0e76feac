"""Restore from a registry straight into the checkpoint image directory: the bytes are written once.

``gpusnap pull`` then ``materialize`` writes every byte twice (into the store, then out of it
into the image directory) and reads it back in between. A restore needs only the image
directory, so :func:`fetch_into` downloads the blobs in parallel and writes each piece where it
belongs in the directory as it streams in:

* the manifest and the config come first (the config says which files the pieces make up and
  is what the host check reads), each checked against its digest;
* every chunk blob is downloaded on a pool of transfers, hashed as it streams, and its bytes
  are decompressed (zstd pieces) and written with ``pwrite`` at their file offsets; the files
  are created at their full size first, so runs of zero pages are left as holes (sparse)
  rather than written;
* a blob that appears several times (identical memory in two places) is downloaded once and
  written to each place;
* the CRIU control tar layer and the engine layer are downloaded into an unlinked temporary
  file, checked, and only then extracted with the usual safe-tar rules (they are small; the
  check before extraction means no member of a forged layer is ever unpacked);
* interrupted downloads resume with a Range request from the byte they reached (the hash and
  the decompressor simply carry on).

Everything is written into a ``.partial-`` directory beside the destination, renamed into
place only when every blob and piece has been verified; any failure removes it. The work
directory holding it is named after the gpusnap process, so one left by a kill -9 is removed by
the next run (gpusnap.engines.orchestrate.work_dir). The store is not written during the download:
afterwards it records only the manifest and the config, and the registry repository as the
source of the blobs (see docs/artifact-format.md, "Restore from a registry").

Memory is bounded by the number of transfers: each holds one receive buffer, and a zstd piece
one decompression window and one output buffer.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import requests
import zstandard

from gpusnap.errors import GpusnapError, IntegrityError, NotFoundError, RegistryError, UsageError
from gpusnap.host.cores import usable_cores
from gpusnap.packaging import artifact as fmt
from gpusnap.packaging import transfer_procs
from gpusnap.packaging import layout as lay
from gpusnap.packaging.transfer_procs import Aborted as _Aborted
from gpusnap.packaging.progress import NullProgress, Progress
from gpusnap.packaging.registry import (
    RegistryClient,
    RemoteRef,
    check_manifest_shape,
    BodyReader,
    remember_remote,
)
from gpusnap.packaging.safetar import check_member
from gpusnap.packaging.store import (
    MEDIA_DOCKER_LIST,
    MEDIA_OCI_INDEX,
    MEDIA_OCI_MANIFEST,
    RESTORED_FILE,
    Descriptor,
    OciStore,
    sha256_digest,
)

DIRECT_FORMS = ("criu-dir", "docker-dir")  # forms whose checkpoint is a directory of files
MAX_CONFIG = 16 << 20
ZERO_BLOCK = 64 << 10  # runs of zeros this long (aligned in the piece) are left as holes
_ZEROS = bytes(ZERO_BLOCK)
OUT_SIZE = 1 << 20  # zstd output handed to the file writer at a time
REPORT_RUN = 4 << 20  # pieces written back to back are told to a lazy restore by runs of this size
# Bytes received per read of a blob: the Python work per read (routing to pieces, the zero
# scan, the pwrite call) is paid per buffer, and with many transfers on threads it is what they
# queue for (the GIL); the socket reads, SHA-256 and pwrite themselves run without it.
FETCH_RECV = 2 << 20
MAX_FETCH_WORKERS = 32


def fetch_workers(client_workers: int) -> int:
    """Transfers at once: one per core (at least the client's own count). Each transfer
    receives, hashes and writes its blob in turn, one core's worth of work, so fewer transfers
    than cores leaves cores idle; memory per transfer is one FETCH_RECV buffer."""
    return max(1, min(MAX_FETCH_WORKERS, max(client_workers, usable_cores())))


# ---- what to write where ----------------------------------------------------------------------
# The plan is the layout module's (format v1 and v2): for every blob, which of its byte ranges
# go to which offset of which file, stored and raw lengths, zstd or not, and (v2) each piece's
# SHA-256. plan() adds the checks a restore from a foreign registry needs before it creates a
# single file: every path is a safe relative path, listed once, and the pieces and zero runs
# tile every file exactly (no gap, no overlap).
Placement = lay.Placement
BlobPlan = lay.BlobPlan
Layout = lay.Layout


def plan(manifest: dict[str, Any], config: dict[str, Any], read_blob: Callable[[Descriptor], bytes] | None = None) -> Layout:
    """The checked layout of an artifact; ``read_blob`` fetches the v2 piece table (verified)."""
    def no_table(d: Descriptor) -> bytes:
        raise IntegrityError(f"{d.digest}: a piece table is needed and there is no way to read it")

    layout = lay.layout_from_parts(manifest, config, read_blob or no_table)
    sizes: dict[str, int] = {}
    for f in layout.files:
        if f.path in sizes:
            raise IntegrityError(f"the checkpoint config lists {f.path!r} twice; the artifact is corrupt")
        check_member(tarfile.TarInfo(f.path), what="checkpoint config")
        sizes[f.path] = f.size
    ranges: dict[str, list[tuple[int, int]]] = {p: [] for p in sizes}
    for bp in layout.blobs:
        for pl in bp.placements:
            if pl.blob_offset + pl.stored_length > bp.descriptor.size:
                raise IntegrityError(f"a piece of blob {bp.descriptor.digest} lies past its end; the artifact is corrupt")
            if not pl.compressed and pl.stored_length != pl.raw_length:
                raise IntegrityError(f"an uncompressed piece of blob {bp.descriptor.digest} has two lengths; the artifact is corrupt")
            ranges[pl.path].append((pl.file_offset, pl.file_offset + pl.raw_length))
    for path, offset, length in layout.zeros:
        ranges[path].append((offset, offset + length))
    for path, rs in ranges.items():
        at = 0
        for start, end in sorted(rs):
            if start != at:
                raise IntegrityError(f"{path}: its pieces {'overlap' if start < at else 'leave a gap'} at byte {min(start, at)}; "
                                     "the artifact is corrupt")
            at = end
        if at != sizes[path]:
            raise IntegrityError(f"{path}: its pieces add up to {at} bytes, the config says {sizes[path]}; the artifact is corrupt")
    # A blob listed several times (v1: identical memory in two places) is fetched once.
    merged: dict[str, BlobPlan] = {}
    for bp in layout.blobs:
        have = merged.get(bp.descriptor.digest)
        if have is None:
            merged[bp.descriptor.digest] = BlobPlan(bp.descriptor, list(bp.placements))
        elif have.descriptor.size != bp.descriptor.size:
            raise IntegrityError(f"blob {bp.descriptor.digest} is listed with two sizes; the artifact is corrupt")
        else:
            have.placements.extend(bp.placements)
    layout.blobs = sorted(merged.values(), key=lambda b: -b.descriptor.size)  # biggest first: the tail is short
    return layout


# ---- the remote artifact ----------------------------------------------------------------------
@dataclass
class RemoteCheckpoint:
    """A checkpoint artifact in a registry, its manifest and config fetched and verified."""

    ref: RemoteRef
    client: RegistryClient
    manifest_bytes: bytes
    manifest_media: str
    digest: str
    manifest: dict[str, Any]
    config_desc: Descriptor
    config_bytes: bytes

    @property
    def encrypted(self) -> bool:
        return self.config_desc.media_type.endswith("+encrypted")

    @property
    def config(self) -> dict[str, Any]:
        try:
            config = json.loads(self.config_bytes)
        except (ValueError, RecursionError):
            config = None
        if not isinstance(config, dict):
            raise GpusnapError(f"{self.ref} is not a gpusnap checkpoint (its config is not a JSON object); check the reference")
        return config

    @property
    def direct(self) -> bool:
        """Whether :func:`fetch_into` can write it (else: pull into the store, then materialize)."""
        if self.encrypted or self.config_desc.media_type != fmt.MEDIA_CONFIG:
            return False
        config = self.config
        return config.get("schemaVersion") in fmt.READABLE_SCHEMAS and config.get("form") in DIRECT_FORMS


def open_remote(remote: str, *, insecure: bool = False, client: RegistryClient | None = None) -> RemoteCheckpoint:
    """Fetch and verify ``remote``'s manifest and config (nothing else)."""
    ref = RemoteRef.parse(remote)
    client = client or RegistryClient(ref.registry, insecure=insecure)
    data, media, digest = client.get_manifest(ref.repository, ref.reference)
    if media in (MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST):
        raise UsageError(f"{remote} is an index of several images, not a checkpoint; give one manifest by digest")
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):
        raise IntegrityError(f"manifest of {remote} is not JSON") from None
    check_manifest_shape(manifest, remote)
    config_desc = Descriptor.from_dict(manifest["config"])
    if config_desc.size > MAX_CONFIG:
        raise GpusnapError(f"{remote}: the artifact's config is {config_desc.size} bytes, too large for checkpoint metadata")
    r = client.request("GET", f"/v2/{ref.repository}/blobs/{config_desc.digest}", scope=f"repository:{ref.repository}:pull",
                       headers={"Accept-Encoding": "identity"})
    config_bytes = r.content
    if sha256_digest(config_bytes) != config_desc.digest or len(config_bytes) != config_desc.size:
        raise IntegrityError(f"the config blob of {remote} does not match its digest {config_desc.digest}; the registry served other bytes")
    return RemoteCheckpoint(ref, client, data, media, digest, manifest, config_desc, config_bytes)


# ---- writing pieces into files ----------------------------------------------------------------
class _FileWriter:
    """Writes one piece into an open file at its offset, leaving zero blocks as holes.

    The file was created empty and truncated to its size, so a hole reads as zeros; a block is
    written only when some byte of it is not zero. ``write`` takes the buffer and a range of it
    (``bytes.startswith`` at an offset compares in place: no copy to find out it is all zeros).
    """

    def __init__(self, fd: int, offset: int, length: int, path: str, piece: Placement | None = None) -> None:
        """``piece``: the placement whose digest checks what is written (None: nothing to check)."""
        self.fd, self.start, self.length, self.path = fd, offset, length, path
        self.done = 0
        self.expected, self.hash = (piece.digest, piece.hasher()) if piece is not None and piece.digest is not None else (None, None)

    def write_range(self, base: bytes | bytearray, start: int, end: int) -> None:
        n = end - start
        if self.done + n > self.length:
            raise IntegrityError(f"a piece of {self.path} holds more than the {self.length} bytes the artifact says; refusing it")
        if self.hash is not None:
            self.hash.update(memoryview(base)[start:end])
        at = self.start + self.done
        i = start
        while i < end:
            k = min(ZERO_BLOCK, end - i)
            if base.startswith(_ZEROS if k == ZERO_BLOCK else _ZEROS[:k], i):
                i += k
                continue
            j = i + k
            while j < end:  # extend the run of blocks that must be written
                k2 = min(ZERO_BLOCK, end - j)
                if base.startswith(_ZEROS if k2 == ZERO_BLOCK else _ZEROS[:k2], j):
                    break
                j += k2
            _pwrite_all(self.fd, memoryview(base)[i:j], at + (i - start), self.path)
            i = j
        self.done += n

    def write(self, data: bytes) -> int:  # zstd's stream_writer calls this with its output
        self.write_range(data, 0, len(data))
        return len(data)

    def flush(self) -> None:  # zstd's stream_writer may call it; pwrite needs none
        pass

    def finish(self) -> None:
        if self.done != self.length:
            raise IntegrityError(f"a piece of {self.path} holds {self.done} bytes, the artifact says {self.length}; refusing it")
        if self.hash is not None and self.hash.digest() != self.expected:
            raise IntegrityError(f"the piece at byte {self.start} of {self.path} does not match its digest; refusing it")


def _pwrite_all(fd: int, view: memoryview, offset: int, path: str) -> None:
    while len(view):
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise GpusnapError(f"no space left to write the checkpoint ({path}: {exc.strerror}); free space in the "
                                   "gpusnap state directory, then try again") from None
            raise GpusnapError(f"cannot write the checkpoint file {path}: {exc.strerror or exc}") from None
        view, offset = view[n:], offset + n


class _PieceSink:
    """One placement of a blob being received: its stored bytes, decompressed if needed,
    written at the file offset (and checked against the piece's digest, where there is one)."""

    def __init__(self, pl: Placement, fd: int) -> None:
        self.pl = pl
        self.file = _FileWriter(fd, pl.file_offset, pl.raw_length, pl.path, pl)
        self.z = (zstandard.ZstdDecompressor().stream_writer(self.file, write_size=OUT_SIZE, closefd=False)  # type: ignore[arg-type]
                  if pl.compressed else None)

    def feed(self, base: bytearray, start: int, end: int) -> None:
        if self.z is not None:
            try:
                self.z.write(memoryview(base)[start:end])
            except zstandard.ZstdError as exc:
                raise IntegrityError(f"a zstd piece of {self.pl.path} does not decompress ({exc}); refusing it") from None
        else:
            self.file.write_range(base, start, end)

    def finish(self) -> None:
        if self.z is not None:
            try:
                self.z.flush()
            except zstandard.ZstdError as exc:
                raise IntegrityError(f"a zstd piece of {self.pl.path} does not decompress ({exc}); refusing it") from None
        self.file.finish()


def blob_span(bp: BlobPlan) -> tuple[int, int]:
    """The bytes of a blob a restore must receive: all of it when its digest is what verifies
    it (v1, or any piece without its own digest); otherwise (v2) only from its first to the
    end of its last needed piece, each piece checked by its own digest — a pack shared with an
    older checkpoint may hold many pieces this one does not use."""
    if not bp.placements or any(p.digest is None for p in bp.placements):
        return 0, bp.descriptor.size
    return min(p.blob_offset for p in bp.placements), max(p.blob_offset + p.stored_length for p in bp.placements)


class _BlobRouter:
    """Receives a blob's bytes in order (from ``start``, see :func:`blob_span`) and hands each
    range to the pieces that cover it; checks the whole blob's digest and size at the end when
    the blob digest is what verifies its pieces."""

    def __init__(self, bp: BlobPlan, fds: dict[str, int], on_piece: Callable[[str, int, int], None] | None = None) -> None:
        self.bp, self.fds = bp, fds
        self.start, self.end = blob_span(bp)
        self.whole = any(p.digest is None for p in bp.placements) or not bp.placements
        # Pieces checked by their own digest are in once written: told as they come (runs of
        # them merged, up to REPORT_RUN), not at the blob's end (gpusnap.criu.landed).
        self.on_piece = on_piece if not self.whole else None
        self.run: list[Any] = []  # [path, offset, length] of the run not yet told
        self.reset(self.start)

    def _written(self, pl: Placement) -> None:
        if self.on_piece is None:
            return
        if self.run and self.run[0] == pl.path and self.run[1] + self.run[2] == pl.file_offset:
            self.run[2] += pl.raw_length
        else:
            self.tell()
            self.run = [pl.path, pl.file_offset, pl.raw_length]
        if self.run[2] >= REPORT_RUN:
            self.tell()

    def tell(self) -> None:
        if self.run and self.on_piece is not None:
            self.on_piece(*self.run)
        self.run = []

    def reset(self, start: int | None = None) -> None:
        """Start over, from blob offset ``start`` (a server that ignored a Range request sends
        the blob from byte 0)."""
        if start is not None:
            self.start = start
        if self.start == 0:
            self.end = self.bp.descriptor.size if self.whole else self.end
        self.size = 0  # bytes received since ``start``
        self.hash = hashlib.sha256() if self.whole else None
        self.todo = sorted(self.bp.placements, key=lambda p: p.blob_offset)
        self.active: list[_PieceSink] = []

    @property
    def wanted(self) -> int:
        return self.end - self.start

    def take(self, base: bytearray, n: int) -> None:
        if self.hash is not None:
            self.hash.update(memoryview(base)[:n])
        lo, hi = self.start + self.size, self.start + self.size + n
        while self.todo and self.todo[0].blob_offset < hi:
            pl = self.todo.pop(0)
            self.active.append(_PieceSink(pl, self.fds[pl.path]))
        still = []
        for sink in self.active:
            end = sink.pl.blob_offset + sink.pl.stored_length
            s, e = max(lo, sink.pl.blob_offset), min(hi, end)
            if s < e:
                sink.feed(base, s - lo, e - lo)
            if end <= hi:
                sink.finish()
                self._written(sink.pl)
            else:
                still.append(sink)
        self.active = still
        self.size += n

    def finish(self) -> None:
        desc = self.bp.descriptor
        if self.hash is not None and ("sha256:" + self.hash.hexdigest() != desc.digest or self.size != desc.size):
            raise IntegrityError(f"blob {desc.digest} from the registry does not match its digest; refusing it (nothing of it is kept)")
        if self.size != self.wanted:
            raise IntegrityError(f"blob {desc.digest} from the registry ended after {self.size} of {self.wanted} bytes; refusing it")
        for pl in self.todo:  # empty pieces at the very end of the span
            self.active.append(_PieceSink(pl, self.fds[pl.path]))
        for sink in self.active:
            sink.finish()
            self._written(sink.pl)


class FileMaps:
    """Shared read-write mappings of windows of the image directory's files, one run of
    pieces at a time (:class:`_MappedRouter` unmaps each once its pieces are checked, so a
    transfer process never holds more of the image mapped than the runs it is receiving: its
    resident size stays that of the interpreter, not of the image).

    Why map: a file takes one writer at a time through ``pwrite`` (the inode lock), so many
    transfers writing one pages file queue there — 2.3 GB/s for 16 writers on a tmpfs, 7.3 with
    huge pages — while copies into shared mappings of the same file run side by side (28 GB/s
    measured; bench/results/gpu-h100-pull-2026-11-25). With a mapping the socket read itself
    lands the bytes in the file. The catch: a write through a mapping that finds no space is a
    SIGBUS, not an error — so only a filesystem whose space is reserved for this image gets
    mapped (the restore's own tmpfs, sized to twice the image: engines/imagedir.py), and only in
    a transfer process, whose death the fetch reports as a one-line error.
    """

    def __init__(self, fds: dict[str, int]) -> None:
        self.fds = fds

    def window(self, path: str, start: int, end: int) -> "_Window":
        """Bytes [start, end) of ``path``, mapped shared and writable."""
        base = start - start % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(self.fds[path], end - base, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
        return _Window(mm, memoryview(mm), base)


@dataclass
class _Window:
    mm: mmap.mmap
    view: memoryview
    base: int  # the file offset of view[0]

    def piece(self, offset: int, length: int) -> memoryview:
        return self.view[offset - self.base:offset - self.base + length]

    def close(self) -> None:
        """Unmap now, or when the last slice handed out is gone."""
        self.view.release()
        try:
            self.mm.close()
        except BufferError:
            pass


@dataclass
class _Run:
    """Consecutive raw pieces of one blob that are consecutive in one file too: received in
    one go into the file's mapping. Blob bytes [b0, b1) are file bytes [f0, f0 + b1 - b0)."""

    b0: int
    b1: int
    path: str
    f0: int


class _MappedRouter(_BlobRouter):
    """A v2 blob received straight into its files' mappings (FileMaps): each raw piece lands
    at its file offset as it is read from the socket, and is checked against its digest in
    place as soon as its last byte is in (a piece that does not match fails the blob, and the
    fetch removes the whole directory). What cannot land in place — a zstd piece, one stored
    range feeding several places, the bytes of other checkpoints' pieces between this one's in
    a shared pack — goes through the receive buffer exactly as in :class:`_BlobRouter`."""

    MAX_READ = 8 << 20  # bytes asked of the socket per read into a mapping

    def __init__(self, bp: BlobPlan, fds: dict[str, int], maps: FileMaps) -> None:
        self.maps = maps
        self.direct = _direct_pieces(bp.placements)
        self._direct_ids = {id(p) for p in self.direct}
        self.runs: list[_Run] = []
        for p in self.direct:
            last = self.runs[-1] if self.runs else None
            if last is not None and last.b1 == p.blob_offset and last.path == p.path and last.f0 + (last.b1 - last.b0) == p.file_offset:
                last.b1 += p.stored_length
            else:
                self.runs.append(_Run(p.blob_offset, p.blob_offset + p.stored_length, p.path, p.file_offset))
        super().__init__(bp, fds)

    def reset(self, start: int | None = None) -> None:
        super().reset(start)
        self.todo = [p for p in self.todo if id(p) not in self._direct_ids]
        self.ri = 0  # the run at or after the read position
        self.vi = 0  # the first direct piece not checked yet
        self.in_map = False
        self._unmap()

    def _unmap(self) -> None:
        win = getattr(self, "win", None)
        if win is not None:
            win.close()
        self.win: _Window | None = None
        self.win_run = -1

    def target(self, scratch: memoryview) -> memoryview:
        """Where the next read goes: the current run's place in its file's mapping, or the
        receive buffer up to the next run (all of it past the end, to catch an oversized blob)."""
        pos = self.start + self.size
        runs = self.runs
        while self.ri < len(runs) and runs[self.ri].b1 <= pos:
            self.ri += 1
        if self.ri < len(runs) and runs[self.ri].b0 <= pos:
            run = runs[self.ri]
            if self.win_run != self.ri:  # the run before is done and checked (landed): its window goes
                self._unmap()
                self.win, self.win_run = self.maps.window(run.path, run.f0, run.f0 + run.b1 - run.b0), self.ri
            assert self.win is not None
            self.in_map = True
            return self.win.piece(run.f0 + (pos - run.b0), min(run.b1 - pos, self.MAX_READ))
        self.in_map = False
        upto = runs[self.ri].b0 if self.ri < len(runs) else self.end
        return scratch[:upto - pos] if pos < upto else scratch

    def landed(self, base: bytearray, n: int) -> None:
        if not self.in_map:
            self.take(base, n)
            return
        self.size += n
        pos = self.start + self.size
        while self.vi < len(self.direct) and self.direct[self.vi].blob_offset + self.direct[self.vi].stored_length <= pos:
            self._check(self.direct[self.vi])
            self.vi += 1

    def _check(self, p: Placement) -> None:
        assert self.win is not None  # a piece is checked right after the read that completed it, in its run's window
        if not p.matches(self.win.piece(p.file_offset, p.raw_length)):
            raise IntegrityError(f"the piece at byte {p.file_offset} of {p.path} does not match its digest; refusing it")

    def finish(self) -> None:
        try:
            super().finish()
            if self.vi != len(self.direct):
                raise IntegrityError(f"blob {self.bp.descriptor.digest} from the registry ended before all its pieces; refusing it")
        finally:
            self._unmap()


def _direct_pieces(placements: list[Placement]) -> list[Placement]:
    """The placements that can land in place, in blob order: raw, with their own digest, and
    sharing no stored byte with another placement."""
    ps = sorted(placements, key=lambda p: (p.blob_offset, p.stored_length))
    out = []
    reach = 0  # the furthest end of the placements before this one
    for i, p in enumerate(ps):
        end = p.blob_offset + p.stored_length
        alone = reach <= p.blob_offset and (i + 1 == len(ps) or end <= ps[i + 1].blob_offset)
        if alone and not p.compressed and p.digest is not None and p.raw_length == p.stored_length > 0:
            out.append(p)
        reach = max(reach, end)
    return out


def make_router(bp: BlobPlan, fds: dict[str, int], maps: FileMaps | None = None) -> _BlobRouter:
    """The sink of a blob's bytes: into the files' mappings where ``maps`` is given and the
    blob's pieces carry their own digests (v2), else through the receive buffer."""
    if maps is not None and bp.placements and all(p.digest is not None for p in bp.placements):
        return _MappedRouter(bp, fds, maps)
    return _BlobRouter(bp, fds)


class _TempSink:
    """A tar layer received into an unlinked temporary file (gone with the process, whatever
    kills it), checked before a single member is extracted."""

    def __init__(self, desc: Descriptor, where: Path) -> None:
        self.desc = desc
        self.start, self.end = 0, desc.size
        self.file: IO[bytes] = tempfile.TemporaryFile(dir=where)
        self.reset()

    @property
    def wanted(self) -> int:
        return self.end

    def reset(self, start: int | None = None) -> None:
        self.size = 0
        self.hash = hashlib.sha256()
        self.file.seek(0)
        self.file.truncate()

    def take(self, base: bytearray, n: int) -> None:
        self.hash.update(memoryview(base)[:n])
        try:
            self.file.write(memoryview(base)[:n])
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise GpusnapError(f"no space left to receive layer {self.desc.digest} ({exc.strerror}); free space in the gpusnap "
                                   "state directory, then try again") from None
            raise
        self.size += n

    def finish(self) -> None:
        if "sha256:" + self.hash.hexdigest() != self.desc.digest or self.size != self.desc.size:
            raise IntegrityError(f"layer {self.desc.digest} from the registry does not match its digest; refusing it (nothing of it is extracted)")
        self.file.seek(0)


@dataclass
class FetchResult:
    dest: Path
    digest: str
    form: str
    bytes_received: int
    blobs: int
    seconds: float


class _Fetch:
    """The downloads of one fetch against ``client``'s registry, repository ``repo``: in the
    fetching process, or in a transfer process (gpusnap.packaging.transfer_worker)."""

    def __init__(self, client: RegistryClient, repo: str, progress: Progress) -> None:
        self.client, self.repo = client, repo
        self.progress = progress
        self.abort = threading.Event()
        self.cancel: threading.Event | None = None
        self.received = 0
        self._lock = threading.Lock()

    def stream(self, desc: Descriptor, sink: Any) -> None:
        """Receive ``desc`` into ``sink`` (``start``, ``wanted``, ``size``, ``take``, ``reset``,
        ``finish``): the ``wanted`` bytes from blob offset ``start``, resuming with Range after a
        broken connection, then let the sink verify them."""
        client = self.client
        if self.stopped():
            raise _Aborted()
        buf = bytearray(FETCH_RECV)
        view = memoryview(buf)
        failures = restarts = 0
        while True:
            headers = {"Accept-Encoding": "identity"}  # the digests are over the stored bytes
            at = sink.start + sink.size
            if at or sink.start + sink.wanted < desc.size:
                headers["Range"] = f"bytes={at}-{sink.start + sink.wanted - 1}"
            try:
                r = client.request("GET", f"/v2/{self.repo}/blobs/{desc.digest}", scope=f"repository:{self.repo}:pull", stream=True,
                                   headers=headers, ok=(200, 206), allow=(404,))
                with r:
                    if r.status_code == 404:
                        raise NotFoundError(f"blob {desc.digest} is missing from {client.registry}/{self.repo}")
                    if "Range" in headers and r.status_code == 200:  # the server ignored Range: the whole blob comes
                        if sink.size:
                            restarts += 1
                            if restarts > client.retries:
                                raise RegistryError(f"download of {desc.digest} from {client.registry} kept breaking off and the "
                                                    "registry ignores Range; try again later")
                        self.advance(-sink.size)
                        sink.reset(0)
                        self.progress.add_total(desc.size - sink.wanted)
                        sink.end = desc.size
                    body = BodyReader(r)
                    # A sink with ``target`` chooses where each read lands (_MappedRouter: its
                    # file's mapping); the others take their bytes from the receive buffer.
                    target = getattr(sink, "target", None)
                    while n := body.readinto(target(view) if target is not None else view):
                        if self.stopped():
                            raise _Aborted()
                        if sink.size + n > sink.wanted:
                            raise IntegrityError(f"blob {desc.digest} from {client.registry} is larger than its descriptor says; refusing it")
                        if target is not None:
                            sink.landed(buf, n)
                        else:
                            sink.take(buf, n)
                        self.advance(n)
                if sink.size < sink.wanted:
                    raise requests.ConnectionError(f"stream ended at {sink.size} of {sink.wanted} bytes")
                break
            except requests.RequestException as exc:
                failures += 1
                if failures >= client.retries:
                    raise RegistryError(f"download of {desc.digest} from {client.registry} failed: {exc}") from None
                time.sleep(client.backoff_s * (2 ** (failures - 1)))
        sink.finish()

    def stopped(self) -> bool:
        return self.abort.is_set() or (self.cancel is not None and self.cancel.is_set())

    def advance(self, n: int) -> None:
        """Bytes received (here or in a transfer process)."""
        self.progress.advance(n)
        with self._lock:
            self.received += n


def fetch_into(store: OciStore, rc: RemoteCheckpoint, dest: Path, *, progress: Progress | None = None,
               staged: Callable[[], None] | None = None, cancel: threading.Event | None = None,
               processes: int | None = None, map_files: bool = False, timings: dict[str, float] | None = None,
               landed: Any = None) -> FetchResult:
    """Write the checkpoint ``rc`` as its image directory ``dest``, straight from the registry.

    ``dest`` must not exist or be empty. Every blob and piece is verified; on any failure
    nothing is left at ``dest`` and the store is as it was. On success the store records the
    manifest and config and where the blobs are (no blob data: see docs/artifact-format.md).

    ``staged`` (a restore overlapping its own preparation with the download): the tar layers and
    the blobs holding any byte of a file other than the pages files are fetched first; once
    they are all in, the directory is renamed into place and ``staged()`` is called while the
    pages files go on arriving (written in place). ``cancel``: set by the caller to stop the
    transfers (raises :class:`layout.Cancelled`). Either way a failure leaves nothing at ``dest``.

    ``processes``: how many transfer processes download the blobs (the pages blobs, when
    staged) — past one interpreter's lock (gpusnap.packaging.transfer_worker); 0: all in this
    process; None: :func:`transfer_procs.auto_processes` decides from the size and the cores.

    ``map_files``: ``dest``'s filesystem has room reserved for the whole image (the restore's
    own tmpfs), so transfer processes may receive straight into the files' mappings
    (:class:`FileMaps` says why only then). ``timings``: filled with seconds per phase (reading
    the piece table, the first stage when staged, the rest).

    ``landed`` (a lazy restore whose page server copies pages as they arrive:
    gpusnap.criu.landed.LandedPages): told of every range of the files once it is written and
    verified (zero runs at once); when staged, asked which ranges of the pages files to fetch
    first once the other files are in (those CRIU reads itself).
    """
    started = time.monotonic()
    if not rc.direct:
        raise UsageError(f"{rc.ref} cannot be written straight into a directory (encrypted, or not a directory checkpoint); pull it")
    config = rc.config
    tables: list[tuple[Descriptor, bytes]] = []

    def read_table(desc: Descriptor) -> bytes:
        data = _fetch_small(rc, desc, lay.MAX_TABLE)
        tables.append((desc, data))
        return data

    pl = plan(rc.manifest, config, read_table)
    if timings is not None:
        timings["read the piece table"] = round(time.monotonic() - started, 3)
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} already exists and is not an empty directory; choose a new path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    prog = progress or NullProgress()
    prog.add_total(sum(d.size for d in pl.tar_layers) + sum(blob_span(b)[1] - blob_span(b)[0] for b in pl.blobs))
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.partial-"))
    if map_files:  # the room is there, or the mappings are not used (FileMaps: no SIGBUS for want of space)
        st = os.statvfs(tmp)
        map_files = sum(f.size for f in pl.files) <= st.f_bavail * st.f_frsize
    root = tmp  # where the tree is: ``dest`` once renamed (early when staged)
    fds: dict[str, int] = {}
    fetch = _Fetch(rc.client, rc.ref.repository, prog)
    fetch.cancel = cancel  # the caller's stop; ``abort`` is this fetch's own (a failed transfer sets it)
    pool: transfer_procs.TransferProcesses | None = None
    try:
        for f in pl.files:
            fds[f.path] = _create_sparse(tmp, f.path, f.size)
        if landed is not None:
            for path, off, length in pl.zeros:  # holes from the start
                landed.add(path, off, length)
        chunk_names = set(fds)
        late = {f.path for f in pl.files if f.role == lay.STAGED_ROLE} if staged is not None else set()
        first, rest = lay.split_stages(pl.blobs, late)
        queue = lay.BlobQueue(rest, landed.wanted if landed is not None else None)

        def finish(files: list[lay.FileEntry]) -> None:
            for f in files:
                fd = fds.pop(f.path)
                try:
                    _set_attributes(fd, f)
                finally:
                    os.close(fd)

        def in_place() -> None:
            nonlocal root
            finish([f for f in pl.files if f.path not in late])
            if dest.exists():
                dest.rmdir()
            os.replace(tmp, dest)
            root = dest
            if timings is not None:
                timings["all but the pages files"] = round(time.monotonic() - started, 3)
            assert staged is not None
            if landed is not None:
                queue.put_first(landed.first(dest))
            staged()

        def tar_job(desc: Descriptor) -> None:
            sink = _TempSink(desc, dest.parent)
            try:
                fetch.stream(desc, sink)
                _extract(sink.file, desc, tmp, chunk_names)
            finally:
                sink.file.close()

        def tell_blob(bp: BlobPlan) -> None:  # all a blob wrote, once it is verified
            if landed is not None:
                for path, off, length in lay.written_spans(bp):
                    landed.add(path, off, length)

        def blob_job(bp: BlobPlan) -> None:
            router = _BlobRouter(bp, fds, on_piece=landed.add if landed is not None else None)
            fetch.stream(bp.descriptor, router)
            router.tell()
            if router.on_piece is None:  # verified only by the blob's digest: told now
                tell_blob(bp)

        def process_job(bp: BlobPlan) -> None:  # a transfer process tells nothing before it returns
            assert pool is not None
            pool.run(bp)
            tell_blob(bp)

        # The blobs that transfer processes download, if any: the pages when staged (the first
        # stage is small and wanted soon), else all; the processes start now, while it runs.
        far = rest if staged is not None else first + rest
        far_files = late if staged is not None else set(fds)
        n_procs = processes if processes is not None else transfer_procs.auto_processes(sum(blob_span(b)[1] - blob_span(b)[0] for b in far))
        if far and n_procs > 0:
            try:
                pool = transfer_procs.TransferProcesses(rc.client, rc.ref.repository, {p: fds[p] for p in far_files}, n_procs,
                                                     on_bytes=fetch.advance, on_total=prog.add_total, stopped=fetch.stopped,
                                                     map_files=map_files)
            except OSError:  # no process to be had (fork refused, a pipe broken at once): all in this one, slower
                pool = None
        far_job = process_job if pool is not None else blob_job
        near_job = blob_job if staged is not None else far_job

        def next_far() -> None:  # the next blob of the second stage, in the order of ``queue`` then
            far_job(queue.take())

        jobs: list[Callable[[], None]] = [lambda d=d: tar_job(d) for d in pl.tar_layers]
        jobs += [lambda b=b: near_job(b) for b in first]
        stage_one = len(jobs)
        jobs += [next_far for _ in rest]
        workers = max(fetch_workers(rc.client.workers), pool.slots if pool is not None else 0)
        _run_all(jobs, workers, fetch.abort, (stage_one, in_place) if staged is not None else None, cancel=cancel)
        if pool is not None:
            pool.close()
        if cancel is not None and cancel.is_set():
            raise lay.Cancelled()
        finish([f for f in pl.files if f.path in fds])
        if root is tmp:
            if dest.exists():
                dest.rmdir()
            os.replace(tmp, dest)
            root = dest
    except BaseException:
        if pool is not None:
            pool.close(kill=True)  # before the directory goes: no worker writes into it after
        for fd in fds.values():
            os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
        raise
    if timings is not None:
        timings["all"] = round(time.monotonic() - started, 3)
    _record(store, rc, tables)
    return FetchResult(dest, rc.digest, str(config.get("form")), fetch.received, len(pl.tar_layers) + len(pl.blobs),
                       time.monotonic() - started)


def _run_all(jobs: list[Callable[[], None]], workers: int, abort: threading.Event,
             after: tuple[int, Callable[[], None]] | None = None, cancel: threading.Event | None = None) -> None:
    """Run ``jobs`` on ``workers`` threads; the first failure stops the others and is raised.
    ``after`` = (n, fn): ``fn()`` runs on this thread once the first ``n`` jobs succeeded, while
    the others go on (a failure of ``fn`` stops them like a failed job)."""
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs) or 1))) as pool:
        futures = [pool.submit(j) for j in jobs]
        first: BaseException | None = None

        def fail(exc: BaseException) -> None:
            nonlocal first
            if first is None:
                first = exc
                abort.set()
                for g in futures:
                    g.cancel()

        for i, f in enumerate(futures + [None]):  # type: ignore[operator]
            if after is not None and i == after[0] and first is None and not abort.is_set() and not (cancel and cancel.is_set()):
                try:
                    after[1]()
                except BaseException as exc:  # noqa: BLE001 - re-raised below, once the others stopped
                    fail(exc)
            if f is None:
                break
            try:
                f.result()
            except _Aborted:
                continue
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once the others stopped
                fail(exc)
        if first is not None:
            raise first


def _inside(root: Path, name: str) -> Path:
    """``root/name`` for a checked member name, its parent directories created, refusing a
    parent that resolves outside ``root`` through a symlink."""
    name = check_member(tarfile.TarInfo(name), what="checkpoint")
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    real_root = os.path.realpath(root)
    parent = os.path.realpath(path.parent)
    if parent != real_root and not parent.startswith(real_root + os.sep):
        raise IntegrityError(f"checkpoint entry {name!r} would be written outside the destination through a symlink; refusing it")
    return path


def _create_sparse(root: Path, name: str, size: int) -> int:
    path = _inside(root, name)
    # Read-write: a transfer process may map it (FileMaps), which needs a readable descriptor.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)  # a hole: the zero blocks are never written
    except OSError as exc:
        os.close(fd)
        raise GpusnapError(f"cannot create the checkpoint file {name} ({size} bytes): {exc.strerror}; check the space in the gpusnap "
                           "state directory") from None
    return fd


def _set_attributes(fd: int, f: lay.FileEntry) -> None:
    os.fchmod(fd, f.mode & 0o777)
    if os.geteuid() == 0:
        os.fchown(fd, f.uid, f.gid)
    os.utime(fd, (f.mtime, f.mtime))


def _fetch_small(rc: RemoteCheckpoint, desc: Descriptor, limit: int) -> bytes:
    """A small blob (the v2 piece table) in memory, checked against its digest."""
    if desc.size > limit:
        raise IntegrityError(f"blob {desc.digest} of {rc.ref} claims {desc.size} bytes, more than {limit}; refusing it")
    r = rc.client.request("GET", f"/v2/{rc.ref.repository}/blobs/{desc.digest}", scope=f"repository:{rc.ref.repository}:pull",
                          headers={"Accept-Encoding": "identity"}, stream=True)
    with r:
        buf = bytearray()
        try:
            for data in r.iter_content(1 << 20):
                buf += data
                if len(buf) > desc.size:
                    break
        except requests.RequestException as exc:
            raise RegistryError(f"download of {desc.digest} from {rc.ref.registry} broke off ({exc}); try again") from None
    if len(buf) != desc.size or sha256_digest(bytes(buf)) != desc.digest:
        raise IntegrityError(f"blob {desc.digest} from {rc.ref.registry} does not match its digest; refusing it")
    return bytes(buf)


def _extract(file: IO[bytes], desc: Descriptor, root: Path, reserved: set[str]) -> None:
    """Unpack a verified tar layer under ``root`` with the safe-tar checks of every other path."""
    stream: Any = file
    if desc.media_type.endswith(fmt.ZSTD_SUFFIX):
        stream = zstandard.ZstdDecompressor().stream_reader(file, read_across_frames=True, closefd=False)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for m in tar:
                name = check_member(m, what=f"layer {desc.digest}")
                if name == ".":
                    continue
                if name in reserved:
                    raise IntegrityError(f"layer {desc.digest} holds {name}, which the artifact also lists as a chunked file; refusing it")
                m.name = name
                fmt._write_entry(root, m, tar.extractfile(m) if m.isreg() else None)
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(f"layer {desc.digest} is not a readable tar ({exc}); the artifact is corrupt") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise GpusnapError(f"no space left to unpack the checkpoint ({exc.strerror}); free space in the gpusnap state directory") from None
        raise


def _record(store: OciStore, rc: RemoteCheckpoint, extra: list[tuple[Descriptor, bytes]] = []) -> None:  # noqa: B006 - never mutated
    """What the store keeps of a checkpoint restored from a registry: its manifest, config and
    (v2) piece table (small, verified), a record ``ref → manifest, source repository`` in restored.json (not a
    tag: nothing may take the artifact for a whole local one), and the repository in
    remotes.json. ``inspect REF`` reads them; a later push to another repository of that
    registry mounts the blobs from there instead of uploading them, and one to the same
    repository finds them with HEAD. This is a record, not part of the restore: a store that
    cannot take it (full disk) leaves the restore as it is."""
    local_ref = str(RemoteRef(rc.ref.registry, rc.ref.repository, rc.ref.tag, None if rc.ref.tag else rc.ref.digest))
    try:
        with store.writing():
            try:
                store.put_bytes(rc.config_bytes, rc.config_desc.digest)
                for desc, data in extra:  # the v2 piece table: where every piece lies
                    store.put_bytes(data, desc.digest)
                store.put_bytes(rc.manifest_bytes, rc.digest)
                store.publish()
            except BaseException:
                store.discard_pending()
                raise
            manifest_desc = Descriptor(rc.manifest_media or MEDIA_OCI_MANIFEST, rc.digest, len(rc.manifest_bytes),
                                       artifact_type=rc.manifest.get("artifactType"))
            with store._index_lock():
                records = _read_records(store)
                records[local_ref] = {"manifest": manifest_desc.to_dict(), "source": f"{rc.ref.registry}/{rc.ref.repository}"}
                store._atomic_write(store.root / RESTORED_FILE, json.dumps(records, indent=1, sort_keys=True).encode())
        remember_remote(store, rc.digest, rc.ref)
    except (GpusnapError, OSError):
        pass


def _read_records(store: OciStore) -> dict[str, Any]:
    try:
        data = json.loads((store.root / RESTORED_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def find_restored(store: OciStore, ref: str) -> Descriptor | None:
    """The manifest of ``ref`` if it was restored straight from a registry into this host."""
    rec = _read_records(store).get(str(RemoteRef.parse(ref)) if "/" in ref else ref)
    if not isinstance(rec, dict):
        return None
    try:
        desc = Descriptor.from_dict(rec["manifest"])
    except (KeyError, TypeError, IntegrityError):
        return None
    return desc if store.has_blob(desc.digest) else None


def forget_restored(store: OciStore, ref: str) -> Descriptor | None:
    key = str(RemoteRef.parse(ref)) if "/" in ref else ref
    with store._index_lock():
        records = _read_records(store)
        rec = records.pop(key, None)
        if rec is None:
            return None
        store._atomic_write(store.root / RESTORED_FILE, json.dumps(records, indent=1, sort_keys=True).encode())
    try:
        return Descriptor.from_dict(rec["manifest"])
    except (KeyError, TypeError, IntegrityError):
        return None
