"""The packaging API other parts of gpusnap call (see docs/DESIGN.md and docs/artifact-format.md)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpusnap.errors import NotFoundError, UsageError
from gpusnap.metadata import CheckpointMetadata
from gpusnap.packaging import artifact as fmt
from gpusnap.packaging.progress import Progress
from gpusnap.packaging.store import MEDIA_OCI_MANIFEST, Descriptor, OciStore, normalize_ref

if TYPE_CHECKING:
    from gpusnap.packaging.crypto import DecryptionKeys, EncryptionConfig
    from gpusnap.packaging.registry import PushResult  # made there; registry is imported lazily (requests)

__all__ = [
    "ArtifactInfo",
    "LayerInfo",
    "StoredCheckpoint",
    "inspect",
    "inspect_path",
    "inspect_remote",
    "remote_config",
    "list_checkpoints",
    "materialize_checkpoint",
    "pull",
    "push",
    "start_push",
    "has_checkpoint",
    "open_remote",
    "fetch_into",
    "remove",
    "gc",
    "store_checkpoint",
    "tag",
    "make_podman_image",
]


@dataclass
class StoredCheckpoint:
    ref: str
    digest: str  # manifest digest
    size: int  # total bytes referenced by the manifest (config + layers)
    new_bytes: int  # bytes that were not in the store before (what dedup did not save)
    layers: int


@dataclass
class LayerInfo:
    media_type: str
    digest: str
    size: int
    role: str
    file: str = ""
    count: int = 1  # chunk layers of one file are summarised as one row


@dataclass
class ArtifactInfo:
    ref: str
    digest: str
    form: str
    container: dict[str, str]
    image: dict[str, str]
    engine: dict[str, str]
    runtime: dict[str, str]
    created: str
    criu_version: str
    kernel: str
    arch: str
    sizes: dict[str, int]
    stored_size: int
    layers: list[LayerInfo]
    process_tree: list[dict[str, Any]]
    gpus: list[dict[str, Any]]
    gpu_processes: list[dict[str, Any]]
    timings: dict[str, float]
    parent: str | None
    annotations: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


# The phases of store_checkpoint (its ``timings``): what a checkpoint waits for after its dump.
STORE_PHASES = ("finish what was stored while dumping", "pack the rest", "publish (durable, then visible)")
# Prefix of what a dump follower did after the dump and before the store began (not a phase of
# the store: its thread did it while the runtime went on).
BESIDE_RUNTIME = "before it, beside the runtime: "


def _check_form(form: str) -> None:
    if form not in fmt.FORMS:
        raise UsageError(f"unknown checkpoint form {form!r}; use one of {', '.join(fmt.FORMS)}")


def store_checkpoint(
    store_dir: Path,
    source: Path,
    *,
    form: str,
    ref: str,
    metadata: CheckpointMetadata | dict[str, Any] | None = None,
    compress: bool = False,
    parent: str | None = None,
    encryption: EncryptionConfig | None = None,
    on_blob: Callable[[Descriptor], None] | None = None,
    workers: int | None = None,
    follower: Any = None,
    timings: dict[str, float] | None = None,
) -> StoredCheckpoint:
    """Package a checkpoint (directory or podman archive) as an artifact tagged ``ref`` in the store.

    ``encryption``: seal every layer (gpusnap.packaging.encrypted) before the tag appears; the
    plaintext blobs are then garbage-collected so only ciphertext stays at rest.
    ``on_blob(desc)``: called as each blob of the artifact is complete and readable through
    the store (``OciStore.open_blob``): packs from a pool thread as they are committed, then the
    tar layers, piece table and config from this thread (docs/artifact-format.md, "Format v2").
    Blobs reused from earlier checkpoints are not reported; an exception from it fails the
    store. Not called with ``encryption`` (the plaintext blobs are not what is pushed).
    ``workers``: threads that read, hash and write (default: one per core).
    ``follower``: the :func:`follow_checkpoint` that watched ``source`` while it was dumped (with
    the same ``compress`` and ``on_blob``); it is finished here, or set aside if what it read does
    not match the finished files, and closed either way.
    ``timings``: filled with the seconds of each phase (STORE_PHASES), for reports.
    """
    try:
        return _store_checkpoint(store_dir, source, form=form, ref=ref, metadata=metadata, compress=compress, parent=parent,
                                 encryption=encryption, on_blob=on_blob, workers=workers, follower=follower,
                                 timings=timings if timings is not None else {})
    finally:
        if follower is not None:
            follower.close()


def follow_checkpoint(store_dir: Path, directory: Path, *, compress: bool = False, parent: str | None = None,
                      on_blob: Callable[[Descriptor], None] | None = None, workers: int | None = None,
                      nice: int = 0) -> Any:
    """Start packing the pages files CRIU writes into ``directory`` (a criu-dir checkpoint being
    dumped; it may not exist yet) while the dump runs. Pass it to :func:`store_checkpoint` once
    the dump succeeded, or call its ``abort()`` and ``close()`` if it failed. See
    gpusnap.packaging.follow. ``nice``: its threads' nice value, so that they give the cores to
    the dump (gpusnap.host.priority). ``workers``: its threads (default: 2 while CRIU dumps,
    follow.beside_dump_workers, then one per core for what is left)."""
    from gpusnap.packaging.follow import DumpFollower

    store = OciStore(Path(store_dir))
    parent_digest = store.resolve(parent).digest if parent else None
    return DumpFollower(store, Path(directory), compress=compress, parent=parent_digest, on_blob=on_blob, workers=workers,
                        nice=nice).start()


def _store_checkpoint(store_dir: Path, source: Path, *, form: str, ref: str, metadata: CheckpointMetadata | dict[str, Any] | None,
                      compress: bool, parent: str | None, encryption: EncryptionConfig | None,
                      on_blob: Callable[[Descriptor], None] | None, workers: int | None, follower: Any,
                      timings: dict[str, float]) -> StoredCheckpoint:
    _check_form(form)
    source = Path(source)
    ref = normalize_ref(ref)
    # A follower packs format v2 pieces of a criu-dir into this store; its packs are pending in
    # its own store object until the tag publishes them, so that object is the one used here.
    usable = (follower is not None and Path(follower.store.root) == Path(store_dir) and form == "criu-dir"
              and encryption is None)
    store = follower.store if usable else OciStore(Path(store_dir))
    if follower is not None and not usable:
        follower.abort()  # another layout, or v1 layers: the store starts from the files
        follower = None
    if form == "podman-archive":
        if not source.is_file():
            raise NotFoundError(f"{source}: no such podman checkpoint archive")
        entries = fmt.iter_archive(source)
    else:
        if not source.is_dir():
            raise NotFoundError(f"{source}: no such checkpoint directory")
        entries = fmt.iter_directory(source)
    parent_digest = store.resolve(parent).digest if parent else None
    with store.writing():
        followed = None
        if follower is not None:  # any other failure of finish() is aborted by close() in store_checkpoint
            from gpusnap.packaging.follow import FollowMismatch

            t0 = time.perf_counter()
            try:
                followed = follower.finish()
            except FollowMismatch:
                follower.abort()  # what it read is not what CRIU left: store the finished files
            timings[STORE_PHASES[0]] = round(time.perf_counter() - t0, 3)
            if followed is not None:
                timings.update((f"{BESIDE_RUNTIME}{k}", v) for k, v in followed.after_dump.items())
        t0 = time.perf_counter()
        try:
            built = fmt.build_artifact(store, entries, form=form, metadata=metadata, compress=compress, parent=parent_digest,
                                      on_blob=on_blob if encryption is None else None,
                                      # Encrypted checkpoints keep format v1: their plaintext is
                                      # not kept at rest, so there are no stored pieces to reference,
                                      # and v1's content-defined blobs still encrypt to the same
                                      # ciphertext (dedup between encrypted checkpoints).
                                      version=2 if encryption is None else 1, workers=workers, followed=followed)
            manifest_digest, manifest_size = built.manifest_digest, built.manifest_size
            if encryption is not None:
                from gpusnap.packaging.encrypted import encrypt_manifest

                manifest_digest, manifest_size = encrypt_manifest(store, manifest_digest, encryption)
        except BaseException:
            store.discard_pending()
            raise
        timings[STORE_PHASES[1]] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        store.tag(ref, Descriptor(MEDIA_OCI_MANIFEST, manifest_digest, manifest_size, artifact_type=fmt.ARTIFACT_TYPE))
        timings[STORE_PHASES[2]] = round(time.perf_counter() - t0, 3)
    if encryption is not None:
        store.gc()  # the plaintext blobs are garbage now: only ciphertext stays at rest
    total = built.manifest_size + built.config_size + sum(d.size for d in built.layers)
    return StoredCheckpoint(ref, manifest_digest, total, built.new_bytes, len(built.layers))


def materialize_checkpoint(store_dir: Path, ref: str, dest: Path, *, form: str, decryption: DecryptionKeys | None = None,
                           staged: Any = None, cancel: Any = None, landed: Any = None) -> Path:
    """Rebuild a checkpoint from the store: a directory (criu-dir, docker-dir) or an archive file.

    An encrypted checkpoint is decrypted into a private temporary store beside ``dest`` first.
    ``staged``/``cancel``: see ``artifact.write_directory_pieced`` (a v2 directory checkpoint
    is renamed into place, and ``staged()`` called, before its pages files are written; other
    forms ignore them and are in place only once whole). ``landed``: as for :func:`fetch_into`
    (told only by v2 directory checkpoints; others report nothing until they are whole).
    """
    _check_form(form)
    store = OciStore(Path(store_dir))
    from gpusnap.packaging.encrypted import decrypted_store, is_encrypted_manifest

    if is_encrypted_manifest(store.manifest(store.resolve(ref).digest)):
        from gpusnap.packaging.crypto import DecryptionKeys as _Keys

        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        with decrypted_store(store, ref, decryption or _Keys(), workdir=Path(dest).parent) as (plain, plain_ref):
            return materialize_checkpoint(plain.root, plain_ref, dest, form=form, staged=staged, cancel=cancel, landed=landed)
    art = fmt.load(store, store.resolve(ref).digest)
    src_form = art.config.get("form")
    dest = Path(dest)
    if form == "podman-archive":
        if src_form != "podman-archive":
            raise UsageError(f"{ref} was made from a {src_form}; a podman archive needs podman's engine files — use --form criu-dir")
        if dest.exists():
            raise UsageError(f"{dest} already exists; choose a new path")
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.partial-")
        try:
            with os.fdopen(fd, "wb") as out:
                fmt.write_archive(fmt.iter_tree(store, art, None), out, fmt.archive_compression(dest))
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return dest
    # criu-dir and docker-dir are the CRIU image directory (docker's adds nothing of its own).
    prefix = None if src_form in ("criu-dir", "docker-dir") else art.config.get("criuDir", "")
    if art.config.get("schemaVersion", 1) >= 2:
        return fmt.write_directory_pieced(store, art, prefix, dest, staged=staged, cancel=cancel, landed=landed)
    return fmt.write_directory(fmt.iter_tree(store, art, prefix), dest)


def _role(media_type: str) -> str:
    base = fmt.base_media(media_type)
    base_pieces = fmt.base_media(fmt.MEDIA_PIECES)
    return {
        fmt.MEDIA_CRIU: "criu",
        fmt.MEDIA_ENGINE: "engine",
        fmt.MEDIA_PAGES: "pages",
        fmt.MEDIA_ROOTFS: "rootfs-diff",
        fmt.MEDIA_DATA: "data",
        fmt.MEDIA_PACK: "pack",
        base_pieces: "pieces",
    }.get(base, "other")


def _piece_rows(layers: list[Descriptor], layout: Any) -> list[LayerInfo]:
    """v2: the tar layers and the piece table as they are, then one row per stored file (the
    packs holding its pieces, the bytes it takes in them) — what v1's chunk rows showed."""
    role_name = {"pages": "pages", "rootfs": "rootfs-diff", "data": "data"}
    rows = [LayerInfo(d.media_type, d.digest, d.size, _role(d.media_type), d.annotations.get(fmt.A_TITLE, ""))
            for d in layers if d.media_type != fmt.MEDIA_PACK]
    for f in layout.files:
        packs: dict[str, None] = {}
        stored: set[tuple[str, int]] = set()
        size = 0
        for plan in layout.blobs:
            for p in plan.placements:
                if p.path == f.path:
                    packs.setdefault(plan.descriptor.digest, None)
                    if (plan.descriptor.digest, p.blob_offset) not in stored:
                        stored.add((plan.descriptor.digest, p.blob_offset))
                        size += p.stored_length
        first = next(iter(packs), "")
        rows.append(LayerInfo(fmt.MEDIA_PACK, first, size, role_name.get(f.role, f.role), f.path, len(packs)))
    return rows


def _layer_rows(layers: list[Descriptor]) -> list[LayerInfo]:
    rows: list[LayerInfo] = []
    by_file: dict[str, LayerInfo] = {}
    for d in layers:
        role = _role(d.media_type)
        name = d.annotations.get(fmt.A_FILE) or d.annotations.get(fmt.A_TITLE, "")
        if fmt.is_chunk_media(d.media_type) or d.media_type == fmt.MEDIA_PACK:
            row = by_file.get(name)
            if row is None:
                row = by_file[name] = LayerInfo(d.media_type, d.digest, 0, role, name, 0)
                rows.append(row)
            row.size += d.size
            row.count += 1
        else:
            rows.append(LayerInfo(d.media_type, d.digest, d.size, role, name))
    return rows


def _info_from(ref: str, digest: str, config: dict[str, Any], layers: list[Descriptor], annotations: dict[str, str],
               layout: Any = None) -> ArtifactInfo:
    gpusnap_meta = config.get("gpusnap") or {}
    return ArtifactInfo(
        ref=ref,
        digest=digest,
        form=config.get("form", ""),
        container=config.get("container", {}),
        image=config.get("image", {}),
        engine=config.get("engine", {}),
        runtime=config.get("runtime", {}),
        created=config.get("created", ""),
        criu_version=str(config.get("criuVersion", "")),
        kernel=config.get("kernel", ""),
        arch=config.get("arch", ""),
        sizes=config.get("sizes", {}),
        stored_size=sum(d.size for d in layers),
        layers=_piece_rows(layers, layout) if layout is not None else _layer_rows(layers),
        process_tree=config.get("processTree", []),
        gpus=config.get("gpus", []) or gpusnap_meta.get("gpus", []),
        gpu_processes=config.get("processes", []) or gpusnap_meta.get("processes", []),
        timings={t["step"]: float(t["seconds"]) for t in config.get("timings", [])} or dict(gpusnap_meta.get("timings_s", {})),
        parent=config.get("parent"),
        annotations=annotations,
    )


def inspect(store_dir: Path, ref: str, *, decryption: DecryptionKeys | None = None, file_rows: bool = True) -> ArtifactInfo:
    """What the artifact ``ref`` holds. An encrypted one shows its full config only with
    ``decryption``; without it, what its manifest annotations say (form, engine, host).
    ``file_rows=False``: a v2 artifact's layers as its manifest lists them, without reading its
    piece table into per-file rows (a restore needs the config only; the table of a large
    checkpoint is hundreds of thousands of pieces)."""
    store = OciStore(Path(store_dir))
    try:
        desc = store.resolve(ref)
    except NotFoundError:
        # Restored straight from a registry: the store has its manifest and config only.
        from gpusnap.packaging.fetch import find_restored

        found = find_restored(store, ref)
        if found is None:
            raise
        desc = found
    manifest = store.manifest(desc.digest)
    from gpusnap.packaging import encrypted

    if encrypted.is_encrypted_manifest(manifest):
        config = encrypted.decrypt_config(store, manifest, decryption) if decryption else encrypted.config_from_annotations(manifest)
        layers = [Descriptor.from_dict(x) for x in manifest.get("layers", [])]
        return _info_from(ref, desc.digest, config, layers, manifest.get("annotations", {}))
    art = fmt.load(store, desc.digest)
    layout = None
    if file_rows and art.config.get("schemaVersion", 1) >= 2:
        from gpusnap.packaging.layout import layout_of

        layout = layout_of(store, art)
    return _info_from(ref, desc.digest, art.config, art.layers, art.manifest.get("annotations", {}), layout)


def remote_config(remote: str, *, insecure: bool = False, decryption: DecryptionKeys | None = None,
                  sealed_ok: bool = False) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(manifest digest, manifest, config) of an artifact in a registry: two small downloads, no layer.

    An encrypted artifact's config is sealed: the keys are checked against the manifest first
    (a wrong or missing key fails here, before anything else is downloaded), then it is
    decrypted in memory; with ``sealed_ok`` and no keys, its manifest annotations stand in.
    """
    import hashlib

    from gpusnap.errors import GpusnapError, IntegrityError
    from gpusnap.packaging.registry import RegistryClient, RemoteRef, check_manifest_shape
    from gpusnap.packaging.store import MEDIA_DOCKER_LIST, MEDIA_OCI_INDEX

    source = RemoteRef.parse(remote)
    client = RegistryClient(source.registry, insecure=insecure)
    data, media, digest = client.get_manifest(source.repository, source.reference)
    if media in (MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST):
        raise UsageError(f"{remote} is an index of several images, not a checkpoint; name one manifest by digest")
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):
        raise IntegrityError(f"manifest of {remote} is not JSON") from None
    check_manifest_shape(manifest, remote)
    config_desc = manifest["config"]
    if int(config_desc.get("size", 0)) > 16 << 20:
        raise GpusnapError(f"{remote}: the artifact's config is {config_desc['size']} bytes, too large for checkpoint metadata")
    from gpusnap.packaging import encrypted

    sealed = str(config_desc.get("mediaType", "")).endswith("+encrypted")
    if sealed and decryption is None and sealed_ok:
        return digest, manifest, encrypted.config_from_annotations(manifest)
    resp = client.request("GET", f"/v2/{source.repository}/blobs/{config_desc['digest']}", scope=f"repository:{source.repository}:pull")
    blob = resp.content
    if "sha256:" + hashlib.sha256(blob).hexdigest() != config_desc["digest"]:
        raise IntegrityError(f"the config blob of {remote} does not match its digest {config_desc['digest']}; the registry served other bytes")
    if sealed:
        import io

        from gpusnap.packaging import crypto

        keys = decryption or crypto.DecryptionKeys()
        encrypted.check_keys_fit(manifest, keys)
        out = io.BytesIO()
        crypto.decrypt_stream(io.BytesIO(blob), out, annotations=config_desc.get("annotations") or {}, keys=keys)
        blob = out.getvalue()
    try:
        config = json.loads(blob)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise GpusnapError(f"{remote} is not a gpusnap checkpoint (its config is not a JSON object); check the reference")
    return digest, manifest, config


def inspect_remote(remote: str, *, insecure: bool = False, decryption: DecryptionKeys | None = None) -> ArtifactInfo:
    """What the artifact ``remote`` in a registry holds, from its manifest and config alone
    (nothing is stored, no layer is downloaded). Layers are listed as the manifest has them: the
    per-file rows :func:`inspect` shows for a v2 artifact come from its layout table, a blob."""
    from gpusnap.packaging.registry import RemoteRef

    digest, manifest, config = remote_config(remote, insecure=insecure, decryption=decryption, sealed_ok=True)
    layers = [Descriptor.from_dict(x) for x in manifest.get("layers", [])]
    return _info_from(str(RemoteRef.parse(remote)), digest, config, layers, manifest.get("annotations", {}))


def inspect_path(path: Path, *, form: str | None = None) -> ArtifactInfo:
    """Inspect a checkpoint on disk (a CRIU/docker directory or a podman archive) without storing it.

    Builds the artifact in a throw-away store so the answer is exactly what ``store`` would record.
    """
    path = Path(path)
    if form is None:
        form = "criu-dir" if path.is_dir() else "podman-archive"
    with tempfile.TemporaryDirectory(prefix="gpusnap-inspect-") as tmp:
        stored = store_checkpoint(Path(tmp), path, form=form, ref="inspect:latest")
        info = inspect(Path(tmp), "inspect:latest")
        info.ref = str(path)
        info.digest = stored.digest
        return info


def list_checkpoints(store_dir: Path) -> list[dict[str, Any]]:
    store = OciStore(Path(store_dir))
    rows = []
    for t in store.tags():
        row: dict[str, Any] = {"ref": t.ref, "digest": t.descriptor.digest, "type": t.descriptor.artifact_type or t.descriptor.media_type}
        try:
            m = store.manifest(t.descriptor.digest)
            layers = [Descriptor.from_dict(x) for x in m.get("layers", [])]
            row["size"] = sum(d.size for d in layers)
            row["layers"] = len(layers)
            row["created"] = (m.get("annotations") or {}).get(fmt.A_CREATED, "")
            row["container"] = (m.get("annotations") or {}).get("org.criu.checkpoint.container.name", "")
        except Exception as exc:  # noqa: BLE001 - one broken entry must not hide the others
            row.update(size=0, layers=0, created="", container=f"(unreadable: {exc})")
        rows.append(row)
    return rows


def tag(store_dir: Path, ref: str, new_ref: str) -> str:
    store = OciStore(Path(store_dir))
    store.tag(new_ref, store.resolve(ref))
    return normalize_ref(new_ref)


def remove(store_dir: Path, ref: str) -> str:
    """Untag ``ref`` (blobs stay until :func:`gc`, which keeps those other tags still use), or
    forget the record of a checkpoint restored straight from a registry."""
    store = OciStore(Path(store_dir))
    try:
        return store.untag(ref).digest
    except NotFoundError:
        from gpusnap.packaging.fetch import forget_restored

        desc = forget_restored(store, ref)
        if desc is None:
            raise
        return desc.digest


def has_checkpoint(store_dir: Path, ref: str) -> bool:
    """Whether ``ref`` is a whole checkpoint in the store (a tag; a checkpoint restored
    straight from a registry, whose blobs are not here, is not)."""
    if not (Path(store_dir) / "index.json").is_file():
        return False  # asking the store would create an empty one
    try:
        OciStore(Path(store_dir)).resolve(ref)
        return True
    except NotFoundError:
        return False


def gc(store_dir: Path) -> tuple[int, int]:
    return OciStore(Path(store_dir)).gc()


# ---- podman-compatible checkpoint image ---------------------------------------------------------
PODMAN_ANNOTATIONS = {
    "name": ("container", "name"),
    "rootfsImageName": ("image", "name"),
    "rawImageName": ("image", "name"),
    "rootfsImageID": ("image", "id"),
    "runtime.name": ("runtime", "name"),
    "runtime.version": ("runtime", "version"),
}


def make_podman_image(store_dir: Path, ref: str, image_ref: str) -> StoredCheckpoint:
    """Make the podman checkpoint image of a podman artifact: one uncompressed layer holding the
    export's files, with podman's ``io.podman.annotations.checkpoint.*`` annotations, so that
    ``podman container restore IMAGE`` restores it. Tagged ``image_ref`` in the store."""
    store = OciStore(Path(store_dir))
    art = fmt.load(store, store.resolve(ref).digest)
    if art.config.get("form") != "podman-archive":
        raise UsageError(f"{ref} was made from a {art.config.get('form')}; only podman checkpoints can become podman checkpoint images")
    image_ref = normalize_ref(image_ref)
    with store.writing():
        w = store.writer()
        try:
            fmt.write_archive(fmt.iter_tree(store, art, None), w, "none")  # type: ignore[arg-type]
            layer_digest = w.commit()
        except BaseException:
            w.abort()
            store.discard_pending()
            raise
        layer_size = store.blob_path(layer_digest).stat().st_size
        cfg = art.config
        image_config = {
            "created": cfg.get("created"),
            "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(cfg.get("arch", ""), cfg.get("arch", "amd64")),
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            "history": [{"created": cfg.get("created"), "created_by": "gpusnap checkpoint image"}],
        }
        config_bytes = json.dumps(image_config, sort_keys=True).encode()
        config_digest = store.put_bytes(config_bytes)
        annotations = {f"io.podman.annotations.checkpoint.{k}": cfg.get(a, {}).get(b, "") for k, (a, b) in PODMAN_ANNOTATIONS.items()}
        gm = cfg.get("gpusnap") or {}
        annotations.update({
            "io.podman.annotations.checkpoint.criu.version": str(cfg.get("criuVersion", "")),
            "io.podman.annotations.checkpoint.host.arch": cfg.get("arch", ""),
            "io.podman.annotations.checkpoint.host.kernel": cfg.get("kernel", ""),
            "io.podman.annotations.checkpoint.podman.version": cfg.get("engine", {}).get("version", "") or gm.get("extra", {}).get("engine_version", ""),
            fmt.A_CREATED: cfg.get("created", ""),
        })
        annotations = {k: v for k, v in annotations.items() if v}
        annotations.setdefault("io.podman.annotations.checkpoint.name", cfg.get("container", {}).get("id", "checkpoint"))
        manifest = {
            "schemaVersion": 2,
            "mediaType": MEDIA_OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": len(config_bytes)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer_size}],
            "annotations": annotations,
        }
        data = json.dumps(manifest, separators=(",", ":")).encode()
        digest = store.put_bytes(data)
        store.tag(image_ref, Descriptor(MEDIA_OCI_MANIFEST, digest, len(data)))
    return StoredCheckpoint(image_ref, digest, layer_size + len(config_bytes), layer_size, 1)


# Re-exported here because they are part of the packaging API (registry.py holds the code).
def push(store_dir: Path, ref: str, remote: str, *, insecure: bool = False, progress: Progress | None = None, subject: str | None = None,
         encryption: EncryptionConfig | None = None, processes: int | None = None) -> PushResult:
    """Upload the artifact ``ref`` to ``remote`` (``host[:port]/repo[:tag]``).

    ``subject``: an image reference in the same repository (e.g. the application image); the
    artifact is attached to it through the manifest's ``subject`` and the referrers API.
    ``encryption``: push an encrypted copy of a plaintext checkpoint (nothing readable leaves).
    ``processes``: transfer processes for the uploads (0: none; None: from the size and cores).
    """
    from gpusnap.packaging.registry import push_artifact

    store = OciStore(Path(store_dir))
    if encryption is None:
        return push_artifact(store, ref, remote, insecure=insecure, progress=progress, subject=subject, processes=processes)
    from gpusnap.packaging.encrypted import encrypt_tag, is_encrypted_manifest

    if is_encrypted_manifest(store.manifest(store.resolve(ref).digest)):
        return push_artifact(store, ref, remote, insecure=insecure, progress=progress, subject=subject, processes=processes)
    tmp_ref = f"{normalize_ref(ref)}-encrypting-{os.getpid()}"
    encrypt_tag(store, ref, encryption, new_ref=tmp_ref)
    try:
        return push_artifact(store, tmp_ref, remote, insecure=insecure, progress=progress, subject=subject, processes=processes)
    finally:
        store.untag(tmp_ref)


def start_push(store_dir: Path, remote: str, *, insecure: bool = False, progress: Progress | None = None,
               nice: int = 0, processes: int | None = None) -> Any:
    """A push that runs while the checkpoint is stored (``checkpoint --push``): pass its
    ``on_blob`` to :func:`store_checkpoint`, then call ``finish(ref)`` (the PushResult) or, if
    the store failed, ``cancel()``. See gpusnap.packaging.registry.PipelinedPush. ``nice``: its
    uploads' nice value (gpusnap.host.priority); ``processes``: transfer processes for them
    (0: none; None: from the cores)."""
    from gpusnap.packaging.registry import PipelinedPush

    return PipelinedPush(OciStore(Path(store_dir)), remote, insecure=insecure, progress=progress, nice=nice, processes=processes)


def open_remote(remote: str, *, insecure: bool = False) -> Any:
    """A checkpoint in a registry with its manifest and config fetched and verified, nothing
    else (gpusnap.packaging.fetch.RemoteCheckpoint): its ``config`` for the host check, and
    ``direct`` — whether :func:`fetch_into` can restore it without a pull."""
    from gpusnap.packaging.fetch import open_remote as _open

    return _open(remote, insecure=insecure)


def fetch_into(store_dir: Path, remote: Any, dest: Path, *, progress: Progress | None = None, staged: Any = None,
               cancel: Any = None, processes: int | None = None, map_files: bool = False,
               timings: dict[str, float] | None = None, landed: Any = None) -> Any:
    """Write the checkpoint ``remote`` (from :func:`open_remote`) as the image directory
    ``dest`` straight from the registry: each byte written once, every blob and piece verified
    as it lands, nothing at ``dest`` on failure. The store records only the manifest, the
    config and where the blobs are. Returns a gpusnap.packaging.fetch.FetchResult.
    ``staged``/``cancel``: as for :func:`materialize_checkpoint` (gpusnap.packaging.fetch);
    ``processes``: transfer processes (None: chosen from the size and the cores; 0: none);
    ``map_files``, ``timings``, ``landed``: as for gpusnap.packaging.fetch.fetch_into."""
    from gpusnap.packaging.fetch import fetch_into as _fetch

    return _fetch(OciStore(Path(store_dir)), remote, dest, progress=progress, staged=staged, cancel=cancel, processes=processes,
                  map_files=map_files, timings=timings, landed=landed)


def pull(store_dir: Path, remote: str, *, insecure: bool = False, progress: Progress | None = None,
         decryption: DecryptionKeys | None = None) -> str:
    """Download ``remote`` into the store, verifying every byte; returns the local ref (= ``remote``).

    ``decryption``: for an encrypted checkpoint, check that one of these keys opens it before
    downloading anything (it stays encrypted at rest; restore decrypts it).
    """
    from gpusnap.packaging.registry import RegistryClient, RemoteRef, pull_artifact

    client = None
    if decryption is not None:
        from gpusnap.packaging.encrypted import check_keys_fit

        source = RemoteRef.parse(remote)
        client = RegistryClient(source.registry, insecure=insecure)
        data, _, _ = client.get_manifest(source.repository, source.reference)
        try:
            manifest = json.loads(data)
        except ValueError:
            manifest = None  # not JSON: pull_artifact reports it
        if isinstance(manifest, dict):
            check_keys_fit(manifest, decryption)
    return pull_artifact(OciStore(Path(store_dir)), remote, insecure=insecure, progress=progress, client=client)

