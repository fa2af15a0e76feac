"""The checkpoint artifact format: building it from a checkpoint, and turning it back into one.

A checkpoint is seen as a tree of files (a CRIU image directory, a docker checkpoint directory,
or the content of a podman export archive). Each file is routed to one kind of layer:

* CRIU control files (everything in the CRIU image directory but memory pages) → one tar layer;
* memory pages (``pages-N.img``), the rootfs diff and any other large file → content-defined
  chunks, one blob per chunk, so unchanged memory yields the same blobs in every checkpoint;
* engine files (podman's config.dump, spec.dump, network.status, ...) → one tar layer.

The config blob carries the checkpoint's metadata and the list of chunked files (mode, owner,
size), so the tree can be rebuilt without reading any other source. docs/artifact-format.md is
the reference for all of this.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import zstandard

from gpusnap.errors import GpusnapError, IntegrityError, NotFoundError, UsageError
from gpusnap.host.cores import usable_cores
from gpusnap.metadata import METADATA_FILE, CheckpointMetadata
from gpusnap.criu import images as pstree
from gpusnap.packaging import chunker
from gpusnap.packaging import layout as lay
from gpusnap.criu.pagemap import PAGEMAP_NAME, ranges_of
from gpusnap.packaging.safetar import LinkTracker, check_member
from gpusnap.packaging.store import MEDIA_OCI_MANIFEST, BlobWriter, Descriptor, OciStore, sha256_digest

if TYPE_CHECKING:
    from gpusnap.packaging import pack as packing  # imported where a store needs it: numpy is slow to load, a restore never does

FORMS = ("criu-dir", "podman-archive", "docker-dir")

ARTIFACT_TYPE = "application/vnd.gpusnap.checkpoint.v1"
MEDIA_CONFIG = "application/vnd.gpusnap.checkpoint.config.v1+json"
MEDIA_CRIU = "application/vnd.gpusnap.checkpoint.criu.v1.tar"
MEDIA_ENGINE = "application/vnd.gpusnap.checkpoint.engine.v1.tar"
MEDIA_PAGES = "application/vnd.gpusnap.checkpoint.pages.v1.chunk"
MEDIA_ROOTFS = "application/vnd.gpusnap.checkpoint.rootfs-diff.v1.chunk"
MEDIA_DATA = "application/vnd.gpusnap.checkpoint.data.v1.chunk"
ZSTD_SUFFIX = "+zstd"

A_FILE = "io.gpusnap.checkpoint.file"
A_OFFSET = "io.gpusnap.checkpoint.offset"
A_LENGTH = "io.gpusnap.checkpoint.length"
A_TITLE = "org.opencontainers.image.title"
A_CREATED = "org.opencontainers.image.created"

CONFIG_SCHEMA_VERSION = 2  # what build_artifact writes; load() reads 1 and 2
READABLE_SCHEMAS = (1, 2)
MEDIA_PACK = lay.MEDIA_PACK
MEDIA_PIECES = lay.MEDIA_PIECES
PODMAN_CRIU_DIR = "checkpoint"
PODMAN_ROOTFS_DIFF = "rootfs-diff.tar"
_PAGES_RE = re.compile(r"^pages-\d+\.img$")
# Files this large are chunked whatever they are: they are what makes a checkpoint big.
LARGE_FILE = 32 << 20
# Small files whose content the config blob summarises (metadata, process tree).
_KEEP = re.compile(r"^(gpusnap\.json|config\.dump|spec\.dump|pstree\.img|inventory\.img|core-\d+\.img|descriptors\.json)$")
_KEEP_LIMIT = 4 << 20

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"


def base_media(media_type: str) -> str:
    return media_type[: -len(ZSTD_SUFFIX)] if media_type.endswith(ZSTD_SUFFIX) else media_type


def is_chunk_media(media_type: str) -> bool:
    """A v1 chunk layer (one piece of one file per blob)."""
    return base_media(media_type) in (MEDIA_PAGES, MEDIA_ROOTFS, MEDIA_DATA)


def is_data_media(media_type: str) -> bool:
    """A layer holding file data: v1 chunk, v2 pack or v2 piece table."""
    return is_chunk_media(media_type) or media_type in (MEDIA_PACK, MEDIA_PIECES)


def _compressor() -> zstandard.ZstdCompressor:
    # threads=-1: one worker per core. Output is the same for any worker count >= 1, so two
    # hosts with different core counts still produce identical chunk blobs.
    return zstandard.ZstdCompressor(level=3, threads=-1)


# ---- reading a checkpoint ------------------------------------------------------------------------
@dataclass
class Entry:
    name: str  # normalized relative path in the tree
    info: tarfile.TarInfo
    stream: IO[bytes] | None = None  # regular files only


def open_archive(path: Path) -> IO[bytes]:
    """A plain byte stream of a tar that may be zstd- or gzip-compressed (sniffed, not guessed)."""
    f = open(path, "rb")
    head = f.read(4)
    f.seek(0)
    if head.startswith(_ZSTD_MAGIC):
        return zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True, closefd=True)  # type: ignore[return-value]
    if head.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]
    return f


def iter_archive(path: Path) -> Iterator[Entry]:
    stream = open_archive(path)
    try:
        try:
            tar = tarfile.open(fileobj=stream, mode="r|")
        except tarfile.TarError as exc:
            raise UsageError(f"{path}: not a tar archive (plain, gzip or zstd) ({exc}); give a `podman container checkpoint --export` file") from None
        links = LinkTracker()
        with tar:
            for member in tar:
                name = check_member(member, what=str(path))
                links.check(member, name, what=str(path))
                if name == ".":
                    continue
                yield Entry(name, member, tar.extractfile(member) if member.isreg() else None)
    except (tarfile.TarError, zstandard.ZstdError, OSError, EOFError) as exc:
        raise IntegrityError(f"{path}: archive is truncated or corrupt ({exc}); export the checkpoint again") from None
    finally:
        stream.close()


def iter_directory(root: Path) -> Iterator[Entry]:
    if not root.is_dir():
        raise NotFoundError(f"{root}: no such checkpoint directory")
    maker = tarfile.TarFile(fileobj=io.BytesIO(), mode="w")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames) + sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            info = maker.gettarinfo(full, arcname=rel)
            if info is None or not (info.isreg() or info.isdir() or info.issym()):
                continue  # sockets and fifos are never part of a CRIU image directory
            check_member(info, what=str(root))
            if info.isreg():
                with open(full, "rb") as f:
                    yield Entry(rel, info, f)
            else:
                yield Entry(rel, info)


# ---- routing entries to layers -------------------------------------------------------------------
def criu_prefix(form: str) -> str:
    return PODMAN_CRIU_DIR if form == "podman-archive" else ""


def _under(name: str, prefix: str) -> str | None:
    if not prefix:
        return name
    if name == prefix:
        return ""
    return name[len(prefix) + 1:] if name.startswith(prefix + "/") else None


def classify(entry: Entry, form: str) -> str:
    """One of: pages, rootfs, data (chunked), criu, engine (tar layers)."""
    inside = _under(entry.name, criu_prefix(form))
    if entry.info.isreg():
        if inside is not None and "/" not in inside and _PAGES_RE.match(inside):
            return "pages"
        if form == "podman-archive" and entry.name == PODMAN_ROOTFS_DIFF:
            return "rootfs"
        if entry.info.size >= LARGE_FILE:
            return "data"
    return "criu" if inside is not None else "engine"


def large_extra(name: str, st: os.stat_result) -> bool:
    """Whether a top-level file of a criu-dir checkpoint that is not a pages file is stored as
    pieces (:func:`classify`'s "data"): what the dump follower may pack before the store."""
    return stat.S_ISREG(st.st_mode) and st.st_size >= LARGE_FILE and not _PAGES_RE.match(name)


class _LayerSink:
    """A tar layer being written: tar stream → optional zstd → blob writer (bounded memory)."""

    def __init__(self, store: OciStore, media_type: str, compress: bool) -> None:
        self.media_type = media_type + (ZSTD_SUFFIX if compress else "")
        self.blob: BlobWriter = store.writer()
        self._z = _compressor().stream_writer(self.blob, closefd=False) if compress else None
        self.tar = tarfile.open(fileobj=self._z or self.blob, mode="w|", format=tarfile.PAX_FORMAT)  # type: ignore[arg-type]
        self.raw_size = 0
        self.count = 0

    def add(self, entry: Entry) -> None:
        self.tar.addfile(entry.info, entry.stream)
        self.raw_size += entry.info.size if entry.info.isreg() else 0
        self.count += 1

    def finish(self) -> Descriptor:
        self.tar.close()
        if self._z is not None:
            self._z.flush(zstandard.FLUSH_FRAME)
            self._z.close()
        digest = self.blob.commit()
        return Descriptor(self.media_type, digest, self.blob.size)

    def abort(self) -> None:
        self.blob.abort()


@dataclass
class BuildResult:
    manifest_digest: str
    manifest_size: int
    config: dict[str, Any]
    config_size: int
    layers: list[Descriptor]
    new_bytes: int  # bytes of blobs that were not in the store before


@dataclass
class _Collected:
    keep: dict[str, bytes] = field(default_factory=dict)  # name → content of small summary files
    files: list[dict[str, Any]] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=lambda: {"criu": 0, "pages": 0, "rootfsDiff": 0, "data": 0, "engine": 0})


class _TeeReader:
    """Reads a stream while keeping a copy (used for small files summarised into the config)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._s = stream
        self.buf = bytearray()

    def read(self, n: int = -1) -> bytes:
        data = self._s.read(n)
        self.buf += data
        return data


def build_artifact(
    store: OciStore,
    entries: Iterator[Entry],
    *,
    form: str,
    metadata: CheckpointMetadata | dict[str, Any] | None,
    compress: bool,
    parent: str | None,
    params: chunker.ChunkParams = chunker.ChunkParams(),
    version: int = CONFIG_SCHEMA_VERSION,
    pack_params: packing.PackParams | None = None,
    on_blob: Callable[[Descriptor], None] | None = None,
    workers: int | None = None,
    followed: Any = None,
) -> BuildResult:
    """Write every layer and the config into ``store``; returns the manifest (already stored).

    ``version`` 2 (default): pieces packed into blobs (pack.py), deduplicated against the
    pieces of the checkpoints already in ``store`` (the parent's first). 1: the older layout,
    one blob per content-defined chunk group (kept for tests of older artifacts).
    ``on_blob``: called with each blob's descriptor as soon as the blob is complete.
    ``followed``: a follow.Followed (version 2): the pages files a DumpFollower packed while
    CRIU wrote them; its writer takes the rest, and those files are only listed here.
    """
    if version not in READABLE_SCHEMAS:
        raise UsageError(f"artifact format version {version} is unknown; use 1 or 2")
    from gpusnap.packaging import pack as packing

    pack_params = pack_params or packing.PackParams()
    criu = _LayerSink(store, MEDIA_CRIU, compress)
    engine: _LayerSink | None = None
    chunk_layers: list[Descriptor] = []
    col = _Collected()
    new_bytes = 0
    zc = _compressor() if compress and version == 1 else None
    writer: packing.PackWriter | None = None
    pagemaps: dict[str, bytes] = {}
    numbers: dict[int, int] = {}  # followed files: provisional number → index in the file list
    if followed is not None and version == 2:
        writer = followed.writer
    elif version == 2:
        known = packing.known_pieces(store, [parent] if parent else None)
        writer = packing.PackWriter(store, compress=compress, params=pack_params, known=known, on_blob=on_blob, workers=workers)
    try:
        for entry in entries:
            role = classify(entry, form)
            if role in ("pages", "rootfs", "data"):
                assert entry.stream is not None
                if writer is not None:
                    index = len(col.files)
                    base = entry.name.rsplit("/", 1)[-1]
                    done = followed.files.get(entry.name) if followed is not None else None
                    if done is not None:
                        number, offset = done  # packed while CRIU wrote it, or as it appeared after the dump
                        numbers[number] = index
                    elif role == "pages":
                        ranges = ranges_of(pagemaps, base, entry.info.size)
                        raw = getattr(entry.stream, "raw", None)
                        if ranges and pack_params.cut == "vaddr" and isinstance(raw, io.FileIO):
                            offset = writer.add_pages_fd(index, raw.fileno(), entry.info.size, ranges)  # a directory's file
                        else:
                            offset = writer.add_pages(index, entry.stream, entry.info.size, ranges)
                    else:
                        offset = writer.add_cdc(index, entry.stream, entry.info.size)
                else:
                    media = {"pages": MEDIA_PAGES, "rootfs": MEDIA_ROOTFS, "data": MEDIA_DATA}[role] + (ZSTD_SUFFIX if compress else "")
                    offset = 0
                    for group in chunker.groups(chunker.chunks(entry.stream, params, entry.info.size), params):
                        raw_len = len(group)
                        blob = zc.compress(group) if zc else bytes(group)
                        digest = sha256_digest(blob)
                        if not store.has_blob(digest):  # dedup before any write
                            store.put_bytes(blob, digest)
                            new_bytes += len(blob)
                        chunk_layers.append(Descriptor(media, digest, len(blob), {A_FILE: entry.name, A_OFFSET: str(offset), A_LENGTH: str(raw_len)}))
                        offset += raw_len
                if offset != entry.info.size:
                    raise IntegrityError(f"{entry.name}: read {offset} bytes, expected {entry.info.size}; the file changed while being stored")
                col.sizes[{"pages": "pages", "rootfs": "rootfsDiff", "data": "data"}[role]] += offset
                i = entry.info
                col.files.append({"path": entry.name, "size": i.size, "mode": i.mode, "uid": i.uid, "gid": i.gid,
                                  "uname": i.uname, "gname": i.gname, "mtime": int(i.mtime), "role": role})
                continue
            base = entry.name.rsplit("/", 1)[-1]
            inside = _under(entry.name, criu_prefix(form))
            tee = None
            top = inside is not None and "/" not in inside
            if entry.stream is not None and top and entry.info.size <= _KEEP_LIMIT and (_KEEP.match(base) or PAGEMAP_NAME.match(base)):
                tee = _TeeReader(entry.stream)
                entry = Entry(entry.name, entry.info, tee)  # type: ignore[arg-type]
            elif entry.stream is not None and form == "podman-archive" and entry.name in ("config.dump", "spec.dump") and entry.info.size <= _KEEP_LIMIT:
                tee = _TeeReader(entry.stream)
                entry = Entry(entry.name, entry.info, tee)  # type: ignore[arg-type]
            if role == "criu":
                criu.add(entry)
            else:
                if engine is None:
                    engine = _LayerSink(store, MEDIA_ENGINE, compress)
                engine.add(entry)
            col.sizes[role] += entry.info.size if entry.info.isreg() else 0
            if tee is not None:
                if PAGEMAP_NAME.match(base) and top:
                    pagemaps[base] = bytes(tee.buf)
                else:
                    col.keep[base if inside is not None else entry.name] = bytes(tee.buf)
        layers = [criu.finish()]
        if engine is not None:
            layers.append(engine.finish())
        packed = writer.finish() if writer is not None else None
        if followed is not None:
            missing = set(followed.files) - {f["path"] for f in col.files}
            if missing:
                raise IntegrityError(f"{', '.join(sorted(missing))}: packed while the dump wrote it, then gone from the checkpoint")
            if packed is not None:
                packed.renumber_files(numbers)
    except BaseException:
        criu.abort()
        if engine is not None:
            engine.abort()
        if writer is not None:
            writer.abort()
        raise
    layers[0] = Descriptor(layers[0].media_type, layers[0].digest, layers[0].size, {A_TITLE: "criu.tar"})
    if len(layers) > 1:
        layers[1] = Descriptor(layers[1].media_type, layers[1].digest, layers[1].size, {A_TITLE: "engine.tar"})
    if criu_count(criu) == 0 and not col.files:
        raise UsageError(f"no checkpoint files found for form {form}; check the path and --form")
    for d in layers:
        if on_blob is not None:
            on_blob(d)
    chunking: dict[str, Any] = params.to_dict()
    if packed is not None:
        new_bytes = packed.new_bytes
        first_pack = len(layers) + 1
        table = packed.encode_table(first_pack)
        table_digest = store.put_bytes(table)
        table_desc = Descriptor(MEDIA_PIECES, table_digest, len(table), {A_TITLE: "pieces"})
        if on_blob is not None:
            on_blob(table_desc)
        layers.append(table_desc)
        layers.extend(packed.packs)
        chunking = pack_params.to_dict()
    layers.extend(chunk_layers)
    config = make_config(form, col, metadata, compress, parent, params)
    config["schemaVersion"] = version
    config["chunking"] = chunking
    if packed is not None:
        config["pieces"] = {k: v for k, v in packed.stats.items()}
    config_bytes = json.dumps(config, indent=1, sort_keys=True).encode()
    config_digest = store.put_bytes(config_bytes)
    config_desc = Descriptor(MEDIA_CONFIG, config_digest, len(config_bytes))
    if on_blob is not None:
        on_blob(config_desc)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": config_desc.to_dict(),
        "layers": [d.to_dict() for d in layers],
        "annotations": manifest_annotations(config),
    }
    manifest_bytes = json.dumps(manifest, separators=(",", ":")).encode()
    digest = store.put_bytes(manifest_bytes)
    return BuildResult(digest, len(manifest_bytes), config, len(config_bytes), layers, new_bytes)


def criu_count(sink: _LayerSink) -> int:
    return sink.count


# ---- config and annotations -------------------------------------------------------------------
def _json_or_none(data: bytes | None) -> Any:
    if not data:
        return None
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def make_config(
    form: str,
    col: _Collected,
    metadata: CheckpointMetadata | dict[str, Any] | None,
    compress: bool,
    parent: str | None,
    params: chunker.ChunkParams,
) -> dict[str, Any]:
    if isinstance(metadata, CheckpointMetadata):
        meta: dict[str, Any] | None = metadata.to_dict()
    elif metadata is not None:
        meta = dict(metadata)
    else:
        meta = _json_or_none(col.keep.get(METADATA_FILE))
    meta = meta or {}
    podman_cfg = _json_or_none(col.keep.get("config.dump")) or {}
    extra = meta.get("extra") or {}
    engine_name = {"podman-archive": "podman", "docker-dir": "docker"}.get(form, extra.get("engine", "runc"))
    procs: list[dict[str, Any]] = []
    try:
        procs = [p.to_dict() for p in pstree.process_tree({k: v for k, v in col.keep.items() if k.endswith(".img")})]
    except pstree.ImageFormatError:
        procs = []
    sizes = dict(col.sizes)
    sizes["total"] = sum(col.sizes.values())
    created = meta.get("created") or podman_cfg.get("checkpointedTime") or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "schemaVersion": CONFIG_SCHEMA_VERSION,
        "form": form,
        "criuDir": criu_prefix(form),
        "created": created,
        "engine": {"name": engine_name, "version": extra.get("engine_version", "")},
        "container": {
            "id": podman_cfg.get("id") or meta.get("container_id", ""),
            "name": podman_cfg.get("name") or extra.get("container_name") or meta.get("container_id", ""),
        },
        "image": {
            "name": podman_cfg.get("rootfsImageName") or extra.get("image", ""),
            "id": podman_cfg.get("rootfsImageID") or extra.get("image_id", ""),
        },
        "runtime": {"name": podman_cfg.get("runtime") or meta.get("runtime", ""), "version": meta.get("runtime_version", "")},
        "criuVersion": meta.get("criu_version", ""),
        "kernel": meta.get("kernel", ""),
        "arch": meta.get("arch", "") or os.uname().machine,
        "gpus": meta.get("gpus", []),
        "processes": meta.get("processes", []),
        "processTree": procs,
        # A list, not an object: the config is written with sorted keys and step order matters.
        "timings": [{"step": k, "seconds": v} for k, v in (meta.get("timings_s") or {}).items()],
        "sizes": sizes,
        "parent": parent,
        "compression": "zstd" if compress else None,
        "chunking": params.to_dict(),
        "files": col.files,
        "gpusnap": meta or None,
    }


def manifest_annotations(config: dict[str, Any]) -> dict[str, str]:
    a = {
        A_CREATED: config["created"],
        "org.criu.checkpoint.container.name": config["container"]["name"],
        "org.criu.checkpoint.engine.name": config["engine"]["name"],
        "org.criu.checkpoint.engine.version": config["engine"]["version"],
        "org.criu.checkpoint.rootfsImageName": config["image"]["name"],
        "org.criu.checkpoint.rootfsImageID": config["image"]["id"],
        "org.criu.checkpoint.runtime.name": config["runtime"]["name"],
        "org.criu.checkpoint.runtime.version": config["runtime"]["version"],
        "org.criu.checkpoint.criu.version": str(config["criuVersion"]),
        "org.criu.checkpoint.host.arch": config["arch"],
        "org.criu.checkpoint.host.kernel": config["kernel"],
        "io.gpusnap.checkpoint.form": config["form"],
    }
    if config.get("parent"):
        a["io.gpusnap.checkpoint.parent"] = config["parent"]
    return {k: v for k, v in a.items() if v}


# ---- reading an artifact back ---------------------------------------------------------------
@dataclass
class LoadedArtifact:
    digest: str
    manifest: dict[str, Any]
    config: dict[str, Any]
    layers: list[Descriptor]


def load(store: OciStore, digest: str) -> LoadedArtifact:
    manifest = store.manifest(digest)
    if manifest.get("artifactType") != ARTIFACT_TYPE and (manifest.get("config") or {}).get("mediaType") != MEDIA_CONFIG:
        raise UsageError(f"{digest} is not a gpusnap checkpoint artifact (artifactType {manifest.get('artifactType')!r})")
    cfg_desc = Descriptor.from_dict(manifest["config"])
    try:
        config = json.loads(store.read_bytes(cfg_desc.digest))
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise IntegrityError(f"checkpoint config {cfg_desc.digest} is not a JSON object; the artifact is corrupt")
    if config.get("schemaVersion") not in READABLE_SCHEMAS:
        raise UsageError(f"checkpoint config schema {config.get('schemaVersion')} is not supported by this gpusnap; upgrade gpusnap")
    return LoadedArtifact(digest, manifest, config, [Descriptor.from_dict(x) for x in manifest.get("layers", [])])


class _VerifiedBlob(io.RawIOBase):
    """Reads a stored blob, decompressing if needed, and checks its digest at the end."""

    def __init__(self, store: OciStore, desc: Descriptor) -> None:
        self._f = store.open_blob(desc.digest)
        self._h = hashlib.sha256()
        self._desc = desc
        self._n = 0
        self._checked = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        if n:
            self._h.update(memoryview(b)[:n])
            self._n += n
        elif not self._checked:
            self._checked = True
            if "sha256:" + self._h.hexdigest() != self._desc.digest or self._n != self._desc.size:
                raise IntegrityError(f"stored blob {self._desc.digest} is corrupt; run `gpusnap gc` and pull the checkpoint again")
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def _layer_stream(store: OciStore, desc: Descriptor) -> IO[bytes]:
    raw = io.BufferedReader(_VerifiedBlob(store, desc), 1 << 20)
    if desc.media_type.endswith(ZSTD_SUFFIX):
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)  # type: ignore[return-value]
    return raw  # type: ignore[return-value]


def _read_chunk(store: OciStore, desc: Descriptor) -> bytes:
    data = store.read_bytes(desc.digest, limit=chunker.GROUP_MAX * 2)
    if desc.media_type.endswith(ZSTD_SUFFIX):
        data = zstandard.ZstdDecompressor().decompress(data, max_output_size=chunker.GROUP_MAX)
    expected = int(desc.annotations.get(A_LENGTH, len(data)))
    if len(data) != expected:
        raise IntegrityError(f"chunk {desc.digest} holds {len(data)} bytes, the manifest says {expected}; the artifact is corrupt")
    return data


class _ChunkReader(io.RawIOBase):
    """The bytes of one chunked file, chunk after chunk (one chunk in memory at a time)."""

    def __init__(self, store: OciStore, chunks: list[Descriptor]) -> None:
        self._store = store
        self._todo = list(chunks)
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf and self._todo:
            self._buf = memoryview(_read_chunk(self._store, self._todo.pop(0)))
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def _chunk_groups(art: LoadedArtifact) -> dict[str, list[Descriptor]]:
    groups: dict[str, list[Descriptor]] = {}
    for d in art.layers:
        if is_chunk_media(d.media_type):
            name = d.annotations.get(A_FILE)
            if not name:
                raise IntegrityError(f"chunk layer {d.digest} has no {A_FILE} annotation; the artifact is corrupt")
            groups.setdefault(name, []).append(d)
    for chunks in groups.values():
        chunks.sort(key=lambda d: int(d.annotations.get(A_OFFSET, "0")))
    return groups


def _file_info(f: dict[str, Any]) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(f["path"])
    ti.size, ti.mode, ti.mtime = int(f["size"]), int(f["mode"]), int(f["mtime"])
    ti.uid, ti.gid, ti.uname, ti.gname = int(f["uid"]), int(f["gid"]), f.get("uname", ""), f.get("gname", "")
    return ti


def _target_name(name: str, prefix: str | None) -> str | None:
    """Path in the output: ``prefix`` is the CRIU dir to strip, None = keep the whole tree."""
    if prefix is None:
        return name
    inside = _under(name, prefix)
    return inside or None


def iter_tree(store: OciStore, art: LoadedArtifact, prefix: str | None) -> Iterator[tuple[tarfile.TarInfo, IO[bytes] | None]]:
    """Every entry of the checkpoint tree, renamed for the output, content streamed."""
    for d in art.layers:
        if base_media(d.media_type) in (MEDIA_CRIU, MEDIA_ENGINE):
            with _layer_stream(store, d) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
                for m in tar:
                    name = _target_name(check_member(m, what=f"layer {d.digest}"), prefix)
                    if name is None or name == ".":
                        continue
                    m.name = name
                    yield m, tar.extractfile(m) if m.isreg() else None
    if art.config.get("schemaVersion", 1) >= 2:
        yield from _iter_pieced_files(store, art, prefix)
        return
    groups = _chunk_groups(art)
    for f in art.config.get("files", []):
        name = _target_name(f["path"], prefix)
        if name is None:
            continue
        chunks = groups.get(f["path"], [])
        if sum(int(c.annotations.get(A_LENGTH, 0)) for c in chunks) != int(f["size"]):
            raise IntegrityError(f"{f['path']}: chunks do not add up to {f['size']} bytes; the artifact is corrupt")
        try:
            ti = _file_info(f)
        except (KeyError, TypeError, ValueError):
            raise IntegrityError(f"checkpoint config lists a malformed file entry {str(f)[:100]}; the artifact is corrupt") from None
        ti.name = name
        yield ti, io.BufferedReader(_ChunkReader(store, chunks), 1 << 20)


class _PiecedFileReader(io.RawIOBase):
    """The bytes of one v2 file in file order: pieces read from their packs, verified; zeros."""

    def __init__(self, store: OciStore, parts: list[tuple[int, int, lay.Placement | None, Descriptor | None]]) -> None:
        self._store = store
        self._todo = parts  # (file_offset, raw_length, placement or None for zeros, blob)
        self._i = 0
        self._buf = memoryview(b"")
        self._files: dict[str, IO[bytes]] = {}

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf and self._i < len(self._todo):
            _, length, p, blob = self._todo[self._i]
            self._i += 1
            if p is None or blob is None:
                self._buf = memoryview(bytes(length))
                continue
            f = self._files.get(blob.digest)
            if f is None:
                f = self._files[blob.digest] = self._store.open_blob(blob.digest)
            stored = os.pread(f.fileno(), p.stored_length, p.blob_offset)
            self._buf = memoryview(lay.piece_bytes(p, stored)).cast("B")
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
        super().close()


def _iter_pieced_files(store: OciStore, art: LoadedArtifact, prefix: str | None) -> Iterator[tuple[tarfile.TarInfo, IO[bytes] | None]]:
    layout = lay.layout_of(store, art)
    parts: dict[str, list[tuple[int, int, lay.Placement | None, Descriptor | None]]] = {f.path: [] for f in layout.files}
    for plan in layout.blobs:
        for p in plan.placements:
            parts[p.path].append((p.file_offset, p.raw_length, p, plan.descriptor))
    for path, off, length in layout.zeros:
        parts[path].append((off, length, None, None))
    for f in layout.files:
        name = _target_name(f.path, prefix)
        if name is None:
            continue
        ti = tarfile.TarInfo(name)
        ti.size, ti.mode, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = f.size, f.mode, f.mtime, f.uid, f.gid, f.uname, f.gname
        todo = sorted(parts[f.path], key=lambda x: x[0])
        yield ti, io.BufferedReader(_PiecedFileReader(store, todo), 1 << 20)


def write_directory_pieced(store: OciStore, art: LoadedArtifact, prefix: str | None, dest: Path, workers: int | None = None, *,
                           staged: Callable[[], None] | None = None, cancel: threading.Event | None = None,
                           landed: Any = None) -> Path:
    """Materialize a v2 artifact as a directory: tar layers extracted, then every pack blob
    read once, on a thread pool, its pieces verified and pwritten at their offsets (zero runs
    stay holes). Built beside ``dest`` and renamed into place.

    ``staged`` (a restore that overlaps its own preparation with the pages): the pack blobs
    holding any byte of a file other than the pages files come first; once those files are
    complete the directory is renamed into place and ``staged()`` is called, then the pages
    files are written in place. ``cancel``: set by the caller to stop the writers early (raises
    :class:`layout.Cancelled`). Either way a failure leaves nothing at ``dest``.

    ``landed``: as for gpusnap.packaging.fetch.fetch_into (a lazy restore's page server copies
    the pages as they are written).
    """
    from concurrent.futures import ThreadPoolExecutor

    layout = lay.layout_of(store, art)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} already exists and is not an empty directory; choose a new path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.partial-"))
    root = tmp  # where the tree is: ``dest`` once renamed (early when staged)
    fds: dict[str, int] = {}
    stop = threading.Event()  # this writer's own: a failed blob stops the others (never sets the caller's ``cancel``)
    try:
        for d in layout.tar_layers:
            with _layer_stream(store, d) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
                for m in tar:
                    name = _target_name(check_member(m, what=f"layer {d.digest}"), prefix)
                    if name is None or name == ".":
                        continue
                    m.name = name
                    _write_entry(tmp, m, tar.extractfile(m) if m.isreg() else None)
        infos: dict[str, tarfile.TarInfo] = {}
        for f in layout.files:
            name = _target_name(f.path, prefix)
            if name is None:
                continue
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime, ti.uid, ti.gid = f.size, f.mode, f.mtime, f.uid, f.gid
            path = _checked_path(tmp, ti)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            fds[f.path] = fd
            os.ftruncate(fd, f.size)
            infos[f.path] = ti
        # Every piece of a v2 pack is checked by its own digest before it is written, so a lazy
        # restore may copy each range as soon as it is (not only once its blob is done).
        told = (lambda path, off, length: landed.add(infos[path].name, off, length)) if landed is not None else None
        if told is not None:
            for path, off, length in layout.zeros:  # holes from the start
                if path in infos:
                    told(path, off, length)

        def place(plan: lay.BlobPlan) -> int:
            if stop.is_set() or (cancel is not None and cancel.is_set()):
                raise lay.Cancelled()
            wanted = [p for p in plan.placements if p.path in fds]
            if not wanted:
                return 0
            with store.open_blob(plan.descriptor.digest) as blob:
                return lay.place_stream(lay.BlobPlan(plan.descriptor, wanted), blob, fds.__getitem__, told)

        def place_next() -> int:  # the next blob of the second stage, in the order of ``queue`` then
            return place(queue.take())

        def finish(paths: list[str]) -> None:
            for p in paths:
                os.close(fds.pop(p))
                ti = infos[p]
                path = root / ti.name
                os.chmod(path, ti.mode & 0o777)
                if os.geteuid() == 0:
                    os.chown(path, ti.uid, ti.gid)
                os.utime(path, (ti.mtime, ti.mtime))

        late = {f.path for f in layout.files if f.role == lay.STAGED_ROLE and f.path in fds} if staged is not None else set()
        first, rest = lay.split_stages(layout.blobs, late)
        by_name = {infos[p].name: p for p in infos}  # the image directory's names, the layout's paths

        def asked() -> list[tuple[str, int]]:  # the pages a lazy restore's faults wait on
            return [(by_name[n], off) for n, off in landed.wanted() if n in by_name]

        queue = lay.BlobQueue(rest, asked if landed is not None else None)
        n = max(1, workers or usable_cores())
        with ThreadPoolExecutor(n, thread_name_prefix="gpusnap-place") as pool:
            try:
                early = [pool.submit(place, b) for b in first]
                later = [pool.submit(place_next) for _ in rest]  # queued behind the first stage
                for fut in early:
                    fut.result()
                if staged is not None:
                    finish([p for p in infos if p not in late])
                    if dest.exists():
                        dest.rmdir()
                    os.replace(tmp, dest)
                    root = dest
                    if landed is not None:
                        queue.put_first({by_name[k]: v for k, v in landed.first(dest).items() if k in by_name})
                    staged()
                for fut in later:
                    fut.result()
            except BaseException:
                stop.set()  # the queued blobs are skipped, the running ones end
                raise
        if cancel is not None and cancel.is_set():
            raise lay.Cancelled()
        finish([p for p in infos if p in fds])
        if root is tmp:
            if dest.exists():
                dest.rmdir()
            os.replace(tmp, dest)
            root = dest
    except BaseException as exc:
        for fd in fds.values():
            os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise GpusnapError(f"no space left to unpack the checkpoint into {dest.parent} ({exc.strerror}); free space there "
                               "(the gpusnap state directory), then try again") from None
        raise
    return dest


def _checked_path(root: Path, info: tarfile.TarInfo) -> Path:
    name = check_member(info, what="checkpoint")
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    real_root = os.path.realpath(root)
    parent = os.path.realpath(path.parent)
    if parent != real_root and not parent.startswith(real_root + os.sep):
        raise IntegrityError(f"checkpoint entry {info.name!r} would be written outside the destination through a symlink; refusing it")
    return path


def write_directory(entries: Iterator[tuple[tarfile.TarInfo, IO[bytes] | None]], dest: Path) -> Path:
    """Build the tree beside ``dest`` and rename it into place: never a half-written directory."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} already exists and is not an empty directory; choose a new path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.partial-"))
    try:
        for info, stream in entries:
            _write_entry(tmp, info, stream)
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _write_entry(root: Path, info: tarfile.TarInfo, stream: IO[bytes] | None) -> None:
    """Create one checked entry under ``root``; its parent must resolve inside ``root``.

    The realpath check catches symlink chains that each look harmless on their own.
    """
    name = check_member(info, what="checkpoint")
    path = root / name
    real_root = os.path.realpath(root)
    parent = os.path.realpath(path.parent)
    if parent != real_root and not parent.startswith(real_root + os.sep):
        raise IntegrityError(f"checkpoint entry {info.name!r} would be written outside the destination through a symlink; refusing it")
    path.parent.mkdir(parents=True, exist_ok=True)
    if info.isdir():
        path.mkdir(exist_ok=True)
    elif info.issym():
        os.symlink(info.linkname, path)
        return
    elif info.islnk():
        os.link(root / check_member(tarfile.TarInfo(info.linkname), what="checkpoint"), path)
        return
    else:
        with open(path, "wb") as out:
            if stream is not None:
                copied = _copy(stream, out)
                if copied != info.size:
                    raise IntegrityError(f"checkpoint entry {info.name!r}: got {copied} bytes, expected {info.size}")
    os.chmod(path, info.mode & 0o777)
    if os.geteuid() == 0:
        os.chown(path, info.uid, info.gid)
    os.utime(path, (info.mtime, info.mtime))


def _copy(src: IO[bytes], dst: IO[bytes]) -> int:
    n = 0
    while True:
        buf = src.read(4 << 20)
        if not buf:
            return n
        dst.write(buf)
        n += len(buf)


def write_archive(entries: Iterator[tuple[tarfile.TarInfo, IO[bytes] | None]], out: IO[bytes], compression: str) -> None:
    """Stream the tree as a tar (``none``, ``gzip`` or ``zstd``) into ``out``."""
    sink: Any = out
    closer: Callable[[], None] = lambda: None  # noqa: E731
    if compression == "zstd":
        sink = _compressor().stream_writer(out, closefd=False)
        closer = lambda: (sink.flush(zstandard.FLUSH_FRAME), sink.close())  # type: ignore[func-returns-value]  # noqa: E731
    elif compression == "gzip":
        sink = gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1)
        closer = sink.close
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT, bufsize=1 << 20) as tar:
        for info, stream in entries:
            tar.addfile(info, stream)
    closer()


def archive_compression(path: Path) -> str:
    name = path.name
    if name.endswith((".tar.gz", ".tgz", ".gz")):
        return "gzip"
    if name.endswith(".tar"):
        return "none"
    return "zstd"
