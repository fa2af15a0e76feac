"""A local OCI image-layout store (no daemon): content-addressed blobs, ``index.json`` tags.

Layout (OCI image-layout 1.0): ``oci-layout``, ``index.json``, ``blobs/sha256/<hex>``, plus
``ingest/`` for blobs being written. A blob is written to ``ingest/``, hashed while written,
made durable (its own fdatasync, at publish if not before, or one syncfs for many), and only then renamed
into ``blobs/`` if its digest matches what was expected: a blob that is visible is always whole
and correct. Identical content (e.g. unchanged memory chunks of two checkpoints) lands on the
same path and is stored once.

Concurrency: ``index.json`` changes happen under an exclusive ``flock``; writers of new content
hold a shared ``gc.lock`` for as long as their blobs are not yet referenced by a tag, and ``gc``
takes it exclusively, so garbage collection never deletes blobs of a checkpoint being stored.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gpusnap.errors import GpusnapError, IntegrityError, NotFoundError, UsageError

MEDIA_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
RESTORED_FILE = "restored.json"  # checkpoints restored from a registry: ref → manifest, blob source

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# A local reference: what a registry reference may be (host[:port]/path:tag), or a bare name.
_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:@]*$")


def _syncfs(path: Path) -> None:
    """Flush the filesystem holding ``path`` (Linux syncfs(2); os has no wrapper for it)."""
    import ctypes

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2
WRITEBACK_EVERY = 4 << 20  # a synced writer asks the kernel to start writing after this many bytes
# publish flushes up to this many unsynced blobs (and bytes) one by one; more take one syncfs.
# A checkpoint's packs are synced as they are sealed, which leaves a few small blobs (the tar
# layers, piece table, config, manifest): a syncfs for those would also wait for every other
# dirty byte on the filesystem (a training job's files, a registry on the same disk).
SYNC_EACH_MAX = 32
SYNC_EACH_MAX_BYTES = 256 << 20
# More than that, up to this many blobs (a checkpoint's packs: ~1000 for 34 GB), are fdatasynced
# on SYNC_THREADS threads: the filesystem's journal commits them together, and unlike a syncfs
# nothing waits for other programs' dirty data. Beyond it, one syncfs.
SYNC_PARALLEL_MAX = 4096
SYNC_THREADS = 16


def _sync_file_range_fn() -> Any:
    """libc's sync_file_range(2) (os has no wrapper), or None where there is none."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _sync_file_range_fn()


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes at ``offset`` of ``fd`` to disk now, without waiting.

    Best effort (an error or no sync_file_range only means the fdatasync at commit has more
    to do): the disk then works while the rest of the blob and the other blobs arrive,
    instead of receiving each blob in one burst at its fdatasync.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict, compare=False)
    artifact_type: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.artifact_type:
            d["artifactType"] = self.artifact_type
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Descriptor":
        try:
            size = d["size"]
            # JSON gives int64 sizes; a float (1e400 parses as inf), a bool or a negative number is a lie.
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"size {size!r} is not a non-negative integer")
            return cls(
                media_type=str(d["mediaType"]),
                digest=validate_digest(str(d["digest"])),
                size=size,
                annotations=dict(d.get("annotations") or {}),
                artifact_type=d.get("artifactType"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"malformed OCI descriptor {d!r}: {exc}; the manifest is corrupt") from None


def validate_digest(digest: str) -> str:
    if not _DIGEST_RE.fullmatch(digest):
        raise IntegrityError(f"unsupported or malformed digest {digest!r}; only sha256:<64 hex> is accepted")
    return digest


def normalize_ref(ref: str) -> str:
    """``name`` → ``name:latest``; keeps ``name:tag`` and ``name@sha256:...``."""
    if not ref or not _REF_RE.fullmatch(ref) or ".." in ref:
        raise UsageError(f"invalid reference {ref!r}: use NAME[:TAG], letters, digits, '.', '_', '-', '/' only")
    if "@" in ref:
        return ref
    last = ref.rsplit("/", 1)[-1]
    return ref if ":" in last else ref + ":latest"


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _storage_error(exc: OSError, root: Path) -> GpusnapError:
    """A full or failing disk under the store as one line (the partial blob is discarded)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return GpusnapError(f"no space left in the store {root} ({exc.strerror}); free space or run `gpusnap gc`, then try again")
    return GpusnapError(f"cannot write to the store {root}: {exc.strerror or exc}; check the disk and permissions")


class BlobWriter:
    """A file in ``ingest/`` hashed as it is written; :meth:`commit` makes it a visible blob.

    ``sync``: :meth:`commit` fdatasyncs the file itself, so the blob needs no syncfs at
    :meth:`OciStore.publish` (for writers that run on several threads at once, e.g. a pull:
    each flush overlaps the other transfers instead of all of them waiting at the end); such a
    writer also starts writeback every ``WRITEBACK_EVERY`` bytes, so the fdatasync finds most
    of the blob already on its way to disk.
    ``buffered``: writes go through a 1 MiB buffer; callers that already write large pieces
    (a pull writes what one ``readinto`` returned) pass False and save a copy.
    """

    def __init__(self, store: "OciStore", *, sync: bool = False, buffered: bool = True) -> None:
        self._store = store
        self._sync = sync
        fd, name = tempfile.mkstemp(dir=store.ingest_dir, prefix="blob-")
        self._file: IO[bytes] = os.fdopen(fd, "wb", buffering=(1 << 20) if buffered else 0)
        self._path = Path(name)
        self._hash = hashlib.sha256()
        self.size = 0
        self._done = False
        self._written_back = 0  # bytes handed to _start_writeback so far (synced writers)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._done:
            # An aborted layer's tar/zstd writers may still flush when garbage-collected.
            return len(data)
        self._hash.update(data)
        try:
            written = self._file.write(data)
            if written is not None and written < len(data):  # unbuffered: a short write is possible
                view = memoryview(data)
                while written < len(view):
                    n = self._file.write(view[written:])
                    if not n:
                        raise OSError(errno.EIO, "short write")
                    written += n
        except OSError as exc:
            raise _storage_error(exc, self._store.root) from None
        self.size += len(data)
        if self._sync and WRITEBACK_EVERY and self.size - self._written_back >= WRITEBACK_EVERY:
            self._file.flush()
            _start_writeback(self._file.fileno(), self._written_back, self.size - self._written_back)
            self._written_back = self.size
        return len(data)

    def flush(self) -> None:  # tarfile and zstandard call it
        pass

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()

    def commit(self, expected_digest: str | None = None, expected_size: int | None = None) -> str:
        """Verify and publish; on a mismatch the data is deleted and :class:`IntegrityError` raised."""
        digest = self.digest
        try:
            if expected_digest is not None and digest != expected_digest:
                raise IntegrityError(
                    f"blob digest mismatch: expected {expected_digest}, got {digest}; the data was discarded"
                )
            if expected_size is not None and self.size != expected_size:
                raise IntegrityError(
                    f"blob {digest} size mismatch: expected {expected_size} bytes, got {self.size}; the data was discarded"
                )
            try:
                if self._sync:
                    self._file.flush()
                    os.fdatasync(self._file.fileno())
                self._file.close()
            except OSError as exc:
                raise _storage_error(exc, self._store.root) from None
            self._store._adopt(digest, self._path, durable=self._sync)
            self._done = True
            return digest
        finally:
            if not self._done:
                self.abort()

    def abort(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:
                pass  # closing flushes the buffer; on a full disk that fails too, and the data goes anyway
        self._path.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> "BlobWriter":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if not self._done:
            self.abort()


class PlacedBlobWriter:
    """A file in ``ingest/`` filled by ``pwritev`` at given offsets (a pack of format v2: its
    pieces are written as soon as they are placed, so no read window waits for the whole pack).

    Writes that arrive in order (each at the end of the previous one: one thread per pack) are
    hashed as they are written, from the caller's buffers; if any arrived out of order, the file
    is read back and hashed at :meth:`commit` instead (a memcpy from the page cache more).
    ``kick``: start writeback as each write lands (see _start_writeback). ``sync``: fdatasync at
    commit; without it the blob is made durable at :meth:`OciStore.publish` with the others.
    """

    HASH_CHUNK = 1 << 20

    def __init__(self, store: "OciStore", *, sync: bool = False, kick: bool = True) -> None:
        self._store = store
        self._sync = sync
        self._kick = kick
        self.fd, name = tempfile.mkstemp(dir=store.ingest_dir, prefix="pack-")
        self._path = Path(name)
        self._done = False
        self._hash = hashlib.sha256()
        self._hashed = 0  # bytes hashed in order so far; -1 once a write came out of order

    def pwrite(self, views: list[Any], offset: int) -> int:
        """Write ``views`` (buffers) back to back at ``offset``; returns the bytes written."""
        total = 0
        try:
            for i in range(0, len(views), 512):  # IOV_MAX is 1024
                batch = [memoryview(v).cast("B") for v in views[i:i + 512]]
                want = sum(len(v) for v in batch)
                done = os.pwritev(self.fd, batch, offset)
                while done < want:  # a short write: go on from where it stopped
                    rest: list[memoryview] = []
                    skip = done
                    for v in batch:
                        if skip >= len(v):
                            skip -= len(v)
                            continue
                        rest.append(v[skip:])
                        skip = 0
                    n = os.pwritev(self.fd, rest, offset + done)
                    if n <= 0:
                        raise OSError(errno.EIO, "short write")
                    done += n
                if self._hashed == offset:
                    for v in batch:
                        self._hash.update(v)
                    self._hashed += want
                else:
                    self._hashed = -1
                offset += want
                total += want
        except OSError as exc:
            raise _storage_error(exc, self._store.root) from None
        if self._kick:
            _start_writeback(self.fd, offset - total, total)
        return total

    def commit(self, size: int, scratch: bytearray | None = None) -> str:
        """Hash the ``size`` bytes of the file, make them durable (``sync``) and add the blob as
        pending; returns its digest. On any failure the file is removed."""
        try:
            in_order = self._hashed == size
            h = self._hash if in_order else hashlib.sha256()
            pos = size if in_order else 0
            try:
                if os.fstat(self.fd).st_size != size:
                    raise IntegrityError(f"pack file is {os.fstat(self.fd).st_size} bytes, expected {size}; a write was lost")
                view = memoryview(scratch if scratch is not None else bytearray(0 if in_order else self.HASH_CHUNK))
                while pos < size:
                    n = os.preadv(self.fd, [view[: min(len(view), size - pos)]], pos)
                    if n <= 0:
                        raise IntegrityError(f"pack file ended at {pos} of {size} bytes; a write was lost")
                    h.update(view[:n])
                    pos += n
                if self._sync:
                    os.fdatasync(self.fd)
                os.close(self.fd)
                self.fd = -1
            except OSError as exc:
                raise _storage_error(exc, self._store.root) from None
            digest = "sha256:" + h.hexdigest()
            self._store._adopt(digest, self._path, durable=self._sync)
            self._done = True
            return digest
        finally:
            if not self._done:
                self.abort()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._path.unlink(missing_ok=True)
        self._done = True


@dataclass
class TagEntry:
    ref: str
    descriptor: Descriptor


class OciStore:
    """An OCI image layout directory used as gpusnap's local checkpoint store."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._pending: dict[str, Path] = {}
        self._unsynced: set[str] = set()  # pending blobs whose data may not be on disk yet
        self._pending_lock = threading.Lock()
        self.blobs_dir = self.root / "blobs" / "sha256"
        self.ingest_dir = self.root / "ingest"
        # Checkpoints hold whole process memories: only the owner may read the store (0700 dirs,
        # 0600 files). mkdir's mode is masked by the umask, hence the explicit chmod.
        fresh = not self.root.exists()
        for d in (self.root, self.root / "blobs", self.blobs_dir, self.ingest_dir):
            if not d.exists():
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
                os.chmod(d, 0o700)
        if fresh:
            os.chmod(self.root, 0o700)
        layout = self.root / "oci-layout"
        if not layout.exists():
            self._atomic_write(layout, json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        if not (self.root / "index.json").exists():
            with self._index_lock():
                if not (self.root / "index.json").exists():
                    self._write_index({"schemaVersion": 2, "mediaType": MEDIA_OCI_INDEX, "manifests": []})

    def _adopt(self, digest: str, path: Path, *, durable: bool) -> None:
        """A blob written to ``path`` under ingest/ whose digest is ``digest``: dropped if the store
        has it already, else private to root and pending until the next commit."""
        if self.has_blob(digest):
            path.unlink()
        else:
            os.chmod(path, 0o600)
            self._add_pending(digest, path, durable=durable)

    # ---- blobs --------------------------------------------------------------------------------
    # Verified blobs wait in ingest/ ("pending") until :meth:`publish`, which makes all of them
    # durable, then renames them into blobs/. A blob in blobs/ is therefore always whole,
    # verified and on disk. Two ways to durability: a pull's writers fdatasync each blob as it
    # completes (``writer(sync=True)``), overlapping the flush with the other transfers; the
    # pack writer (its writeback started as each piece is written) and single-threaded writers
    # (a v1 chunker, the small blobs of store_checkpoint) leave their blobs unsynced and publish
    # flushes them: one by one when they are few (SYNC_EACH_MAX), on SYNC_THREADS threads up to
    # SYNC_PARALLEL_MAX, else with one syncfs (which also waits for unrelated dirty data on the
    # same filesystem). The packs were once fdatasynced one by one as sealed: a journal commit
    # and a device flush per 32 MiB. Synced at publish instead, the store of a real 5 GB image
    # took 2.34-2.56 s against 2.52-3.30 on one H100 host, and the same as before on another
    # (bench/results/gpu-h100-e2e-2026-11-27-fourteenth); publish of ~1000 packs takes 0.08 s.
    def _add_pending(self, digest: str, path: Path, *, durable: bool = False) -> None:
        with self._pending_lock:
            if digest in self._pending:
                path.unlink()
            else:
                # Named after its digest (plus the writer's own tag, so two writers never
                # share a file) so that another OciStore of the same root — e.g. an upload
                # started from store_checkpoint's on_blob — can open it before publish.
                named = path.with_name(f"{digest.split(':', 1)[1]}.{path.name}.pending")
                os.replace(path, named)
                path = named
                self._pending[digest] = path
                if not durable:
                    self._unsynced.add(digest)

    def publish(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, {}
            unsynced, self._unsynced = self._unsynced, set()
        if not pending:
            return
        if unsynced:
            self._make_durable([pending[d] for d in unsynced if d in pending])
        for digest, path in pending.items():
            final = self.blobs_dir / digest.split(":", 1)[1]
            if final.exists():
                path.unlink(missing_ok=True)
            else:
                os.replace(path, final)
        _fsync_dir(self.blobs_dir)

    def _make_durable(self, paths: list[Path]) -> None:
        try:
            # The count first: many blobs (a v1 chunker's) take the syncfs without a stat each.
            many = len(paths) > SYNC_EACH_MAX or sum(p.stat().st_size for p in paths) > SYNC_EACH_MAX_BYTES
        except OSError as exc:
            raise _storage_error(exc, self.root) from None
        if len(paths) > SYNC_PARALLEL_MAX:
            _syncfs(self.root)
        elif many:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(SYNC_THREADS, len(paths)), thread_name_prefix="gpusnap-sync") as pool:
                list(pool.map(self._fdatasync_path, paths))
        else:
            for path in paths:
                self._fdatasync_path(path)

    def _fdatasync_path(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _storage_error(exc, self.root) from None

    def discard_pending(self) -> None:
        """Drop every blob this store object wrote but did not publish (a failed operation)."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
            self._unsynced = set()
        for path in pending.values():
            path.unlink(missing_ok=True)

    def blob_path(self, digest: str) -> Path:
        digest = validate_digest(digest)
        pending = self._pending.get(digest)
        return pending if pending is not None else self.blobs_dir / digest.split(":", 1)[1]

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def writer(self, *, sync: bool = False, buffered: bool = True) -> BlobWriter:
        return BlobWriter(self, sync=sync, buffered=buffered)

    def placed_writer(self, *, sync: bool = False, kick: bool = True) -> "PlacedBlobWriter":
        return PlacedBlobWriter(self, sync=sync, kick=kick)

    def put_bytes(self, data: bytes, expected_digest: str | None = None, *, sync: bool = False) -> str:
        with self.writer(sync=sync) as w:
            w.write(data)
            return w.commit(expected_digest, len(data) if expected_digest else None)

    def read_bytes(self, digest: str, *, limit: int = 64 << 20) -> bytes:
        path = self.blob_path(digest)
        if not path.is_file():
            raise NotFoundError(f"blob {digest} is not in the store {self.root}; pull the checkpoint again")
        if path.stat().st_size > limit:
            raise IntegrityError(f"blob {digest} is larger than {limit} bytes; it is not a manifest or config")
        data = path.read_bytes()
        if sha256_digest(data) != digest:
            raise IntegrityError(f"blob {digest} in {self.root} is corrupt (digest mismatch); run `gpusnap gc` and pull again")
        return data

    def open_blob(self, digest: str) -> IO[bytes]:
        """The blob's bytes; also a blob another writer of this store committed but has not
        published yet (it is whole and verified; only not yet referenced by a tag)."""
        path = self.blob_path(digest)
        try:
            return open(path, "rb")
        except FileNotFoundError:
            for pending in self.ingest_dir.glob(f"{digest.split(':', 1)[1]}.*.pending"):
                try:
                    return open(pending, "rb")
                except FileNotFoundError:
                    continue
            raise NotFoundError(f"blob {digest} is not in the store {self.root}; pull the checkpoint again") from None

    # ---- locks --------------------------------------------------------------------------------
    @contextmanager
    def _flock(self, name: str, mode: int) -> Iterator[None]:
        fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)

    def _index_lock(self) -> Any:
        return self._flock(".index.lock", fcntl.LOCK_EX)

    def writing(self) -> Any:
        """Hold while adding blobs that no tag references yet (keeps ``gc`` away)."""
        return self._flock(".gc.lock", fcntl.LOCK_SH)

    # ---- index --------------------------------------------------------------------------------
    def _atomic_write(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise _storage_error(exc, self.root) from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read_index(self) -> dict[str, Any]:
        try:
            return json.loads((self.root / "index.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise IntegrityError(f"{self.root / 'index.json'} is unreadable ({exc}); restore or delete the store") from None

    def _write_index(self, index: dict[str, Any]) -> None:
        self._atomic_write(self.root / "index.json", json.dumps(index, indent=2).encode())

    def tags(self) -> list[TagEntry]:
        out = []
        for m in self._read_index().get("manifests", []):
            ref = (m.get("annotations") or {}).get(ANNOTATION_REF_NAME)
            if ref:
                out.append(TagEntry(ref, Descriptor.from_dict(m)))
        return sorted(out, key=lambda t: t.ref)

    def tag(self, ref: str, desc: Descriptor) -> None:
        ref = normalize_ref(ref)
        self.publish()  # a tag never points at blobs that are not durable and visible
        if not self.has_blob(desc.digest):
            raise NotFoundError(f"cannot tag {ref}: manifest {desc.digest} is not in the store")
        with self._index_lock():
            index = self._read_index()
            manifests = [m for m in index.get("manifests", []) if (m.get("annotations") or {}).get(ANNOTATION_REF_NAME) != ref]
            entry = Descriptor(desc.media_type, desc.digest, desc.size, {**desc.annotations, ANNOTATION_REF_NAME: ref}, desc.artifact_type)
            manifests.append(entry.to_dict())
            index["manifests"] = manifests
            self._write_index(index)

    def resolve(self, ref: str) -> Descriptor:
        if ref.startswith("sha256:"):
            digest = validate_digest(ref)
            for t in self.tags():
                if t.descriptor.digest == digest:
                    return t.descriptor
            raise NotFoundError(f"no checkpoint with manifest {ref} in {self.root}; see `gpusnap ls`")
        ref = normalize_ref(ref)
        for t in self.tags():
            if t.ref == ref:
                return t.descriptor
        raise NotFoundError(f"no checkpoint named {ref} in {self.root}; see `gpusnap ls`")

    def untag(self, ref: str) -> Descriptor:
        desc = self.resolve(ref)
        ref_n = ref if ref.startswith("sha256:") else normalize_ref(ref)
        with self._index_lock():
            index = self._read_index()
            index["manifests"] = [
                m for m in index.get("manifests", [])
                if not ((m.get("annotations") or {}).get(ANNOTATION_REF_NAME) == ref_n or m.get("digest") == ref_n)
            ]
            self._write_index(index)
        return desc

    def manifest(self, digest: str) -> dict[str, Any]:
        try:
            return json.loads(self.read_bytes(digest))
        except json.JSONDecodeError:
            raise IntegrityError(f"manifest {digest} is not JSON; the store is corrupt") from None

    # ---- garbage collection -------------------------------------------------------------------
    def referenced(self) -> set[str]:
        """Every blob reachable from a tag (manifests, configs, layers, index children)."""
        seen: set[str] = set()
        todo = [t.descriptor for t in self.tags()] + self.restored_roots()
        while todo:
            d = todo.pop()
            if d.digest in seen:
                continue
            seen.add(d.digest)
            if d.media_type in (MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST, MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST) and self.has_blob(d.digest):
                m = self.manifest(d.digest)
                if "config" in m:
                    todo.append(Descriptor.from_dict(m["config"]))
                todo.extend(Descriptor.from_dict(x) for x in m.get("layers", []))
                todo.extend(Descriptor.from_dict(x) for x in m.get("manifests", []))
        return seen

    def restored_roots(self) -> list[Descriptor]:
        """Manifests of checkpoints restored straight from a registry (gpusnap.packaging.fetch,
        ``restored.json``): the store keeps their manifest and config, not their blobs, which
        stay in the registry; gc must not take those small blobs away."""
        try:
            data = json.loads((self.root / RESTORED_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return []
        out = []
        for rec in data.values() if isinstance(data, dict) else []:
            try:
                out.append(Descriptor.from_dict(rec["manifest"]))
            except (KeyError, TypeError, IntegrityError):
                continue
        return out

    def gc(self) -> tuple[int, int]:
        """Delete unreferenced blobs and stale ingest files; returns (blobs removed, bytes freed)."""
        with self._flock(".gc.lock", fcntl.LOCK_EX):
            keep = {d.split(":", 1)[1] for d in self.referenced()}
            removed = freed = 0
            for p in self.blobs_dir.iterdir():
                if p.name not in keep:
                    freed += p.stat().st_size
                    p.unlink()
                    removed += 1
            # With the exclusive lock held no writer is active: anything in ingest/ is debris.
            for p in self.ingest_dir.iterdir():
                freed += p.stat().st_size
                p.unlink()
            return removed, freed

    def disk_usage(self) -> int:
        return sum(p.stat().st_size for p in self.blobs_dir.iterdir())
