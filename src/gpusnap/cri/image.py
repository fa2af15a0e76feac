"""Kubelet checkpoint archives, and the checkpoint images containerd 2.x and CRI-O restore from.

The kubelet's checkpoint API (``POST /checkpoint/{namespace}/{pod}/{container}``) has the
runtime write a tar under ``/var/lib/kubelet/checkpoints/``: ``config.dump``, ``spec.dump``,
``status.dump`` (containerd), ``checkpoint/`` (CRIU's images, gpusnap-runtime's ``gpusnap.json``
among them), ``rootfs-diff.tar``, logs. A pod restores it when its container image is a
*checkpoint image*: one layer that unpacks to exactly those files, and an annotation naming the
checkpointed container. containerd 2.x looks for ``org.criu.checkpoint.container.name`` (the name
checkpointctl defines) among the annotations of the image's target manifest; CRI-O for
``io.kubernetes.cri-o.annotations.checkpoint.name``. The image built here carries both, plus
gpusnap's own (``io.gpusnap.checkpoint.*``) so that a restore can refuse a node of another
architecture or GPU model before it asks the runtime for anything.
"""

from __future__ import annotations

import gzip
import json
import platform
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gpusnap.errors import IntegrityError, NotFoundError, UsageError
from gpusnap.metadata import METADATA_FILE, CheckpointMetadata
from gpusnap.packaging.safetar import safe_name

ANN_CRIU_NAME = "org.criu.checkpoint.container.name"  # containerd 2.x: "this is a checkpoint image"
ANN_CRIO_NAME = "io.kubernetes.cri-o.annotations.checkpoint.name"  # CRI-O's equivalent
ANN_CRIU_POD = "org.criu.checkpoint.pod.name"
ANN_CRIU_NAMESPACE = "org.criu.checkpoint.pod.namespace"
ANN_CRIU_ROOTFS = "org.criu.checkpoint.rootfsImageName"
ANN_CRIU_RUNTIME = "org.criu.checkpoint.runtime.name"
ANN_CRIU_ENGINE = "org.criu.checkpoint.engine.name"
ANN_ARCH = "io.gpusnap.checkpoint.arch"
ANN_GPUS = "io.gpusnap.checkpoint.gpus"  # "2x NVIDIA H200" style, for people and `inspect`
ANN_METADATA = "io.gpusnap.checkpoint.metadata"  # gpusnap.json, compact: the host check's input
ANN_CREATED = "org.opencontainers.image.created"

MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
REQUIRED = ("config.dump", "spec.dump")
MAX_JSON = 16 << 20  # the .dump files are a few KB; anything near this is not one
GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}


def goarch(machine: str | None = None) -> str:
    m = machine or platform.machine()
    return GOARCH.get(m, m)


@dataclass
class KubeletArchive:
    """What a checkpoint archive says about itself (read, checked, nothing unpacked)."""

    path: Path
    compression: str  # "none" | "gzip"
    config: dict[str, Any]  # config.dump
    spec: dict[str, Any]  # spec.dump
    status: dict[str, Any] = field(default_factory=dict)  # status.dump (containerd)
    meta: CheckpointMetadata | None = None  # checkpoint/gpusnap.json: made through gpusnap-runtime
    names: list[str] = field(default_factory=list)

    @property
    def container_name(self) -> str:
        md = self.status.get("metadata") or {}
        labels = (self.spec.get("annotations") or {})
        return str(md.get("name") or labels.get("io.kubernetes.cri.container-name") or self.config.get("name") or "checkpoint")

    @property
    def pod(self) -> tuple[str, str]:
        ann = self.spec.get("annotations") or {}
        return str(ann.get("io.kubernetes.cri.sandbox-name", "")), str(ann.get("io.kubernetes.cri.sandbox-namespace", ""))

    @property
    def arch(self) -> str:
        return goarch(self.meta.arch) if self.meta and self.meta.arch else ""


def _open(path: Path) -> tuple[IO[bytes], str]:
    try:
        raw = open(path, "rb")
    except FileNotFoundError:
        raise NotFoundError(f"no checkpoint archive at {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    magic = raw.read(2)
    raw.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb"), "gzip"  # type: ignore[return-value]
    return raw, "none"


def read_archive(path: Path) -> KubeletArchive:
    """Check every entry of a kubelet checkpoint archive and read its metadata files.

    Refused (IntegrityError) when an entry could land outside the directory it is unpacked to
    (absolute name, ``..``), or is anything but a regular file or directory: the runtimes only
    ever write those, and containerd silently drops the rest, so a link or device in one is no
    checkpoint's doing. A missing ``config.dump``/``spec.dump``/``checkpoint/`` is a UsageError."""
    path = Path(path)
    fh, compression = _open(path)
    found: dict[str, bytes] = {}
    names: list[str] = []
    has_criu = False
    try:
        with fh, tarfile.open(fileobj=fh, mode="r|") as tar:
            for m in tar:
                name = safe_name(m.name, what=f"checkpoint archive {path.name}")
                if m.issym() or m.islnk():
                    raise IntegrityError(f"checkpoint archive {path.name}: entry {m.name!r} is a link ({m.linkname!r}); "
                                         "runtimes write only files and directories: refusing the archive")
                if not (m.isreg() or m.isdir()):
                    raise IntegrityError(f"checkpoint archive {path.name}: entry {m.name!r} is a device, fifo or unknown type; refusing the archive")
                names.append(name)
                if name == "checkpoint" or name.startswith("checkpoint/"):
                    has_criu = True
                if name in (*REQUIRED, "status.dump", f"checkpoint/{METADATA_FILE}") and m.isreg():
                    if m.size > MAX_JSON:
                        raise IntegrityError(f"checkpoint archive {path.name}: {name} is {m.size} bytes, not a checkpoint's metadata; refusing the archive")
                    f = tar.extractfile(m)
                    found[name] = f.read() if f else b""
    except tarfile.TarError as exc:
        raise IntegrityError(f"{path} is not a readable tar archive ({exc}); is it a kubelet checkpoint archive?") from None
    except (EOFError, OSError, gzip.BadGzipFile) as exc:
        raise IntegrityError(f"{path} is truncated or corrupt ({exc}); take the checkpoint again") from None
    missing = [n for n in REQUIRED if n not in found] + ([] if has_criu else ["checkpoint/"])
    if missing:
        raise UsageError(f"{path} lacks {', '.join(missing)}: not a kubelet checkpoint archive (from the kubelet's checkpoint API)")

    def load(name: str) -> dict[str, Any]:
        try:
            data = json.loads(found[name])
        except ValueError as exc:
            raise IntegrityError(f"checkpoint archive {path.name}: {name} is not JSON ({exc}); take the checkpoint again") from None
        if not isinstance(data, dict):
            raise IntegrityError(f"checkpoint archive {path.name}: {name} is not a JSON object; take the checkpoint again")
        return data

    meta = None
    if f"checkpoint/{METADATA_FILE}" in found:
        try:
            meta = CheckpointMetadata.from_dict(load(f"checkpoint/{METADATA_FILE}"))
        except (TypeError, ValueError) as exc:
            raise IntegrityError(f"checkpoint archive {path.name}: checkpoint/{METADATA_FILE} is unreadable ({exc})") from None
    return KubeletArchive(path=path, compression=compression, config=load("config.dump"), spec=load("spec.dump"),
                          status=load("status.dump") if "status.dump" in found else {}, meta=meta, names=names)


def gpu_summary(meta: CheckpointMetadata | None) -> str:
    if meta is None or not meta.gpus:
        return ""
    counts: dict[str, int] = {}
    for g in meta.gpus:
        counts[g.name] = counts.get(g.name, 0) + 1
    return ", ".join(f"{n}x {name}" for name, n in sorted(counts.items()))


def image_annotations(archive: KubeletArchive) -> dict[str, str]:
    """The annotations of the checkpoint image's manifest (empty values left out)."""
    pod, namespace = archive.pod
    ann = {
        ANN_CRIU_NAME: archive.container_name,
        ANN_CRIO_NAME: archive.container_name,
        ANN_CRIU_POD: pod,
        ANN_CRIU_NAMESPACE: namespace,
        ANN_CRIU_ROOTFS: str(archive.config.get("rootfsImageName") or archive.config.get("rootfsImage") or ""),
        ANN_CRIU_RUNTIME: str(archive.config.get("runtime") or ""),
        ANN_CRIU_ENGINE: "containerd" if archive.status else "",
        ANN_CREATED: str(archive.config.get("checkpointedTime") or ""),
        ANN_ARCH: archive.arch,
        ANN_GPUS: gpu_summary(archive.meta),
    }
    if archive.meta is not None:
        d = archive.meta.to_dict()
        d.pop("timings_s", None)
        ann[ANN_METADATA] = json.dumps(d, separators=(",", ":"), sort_keys=True)
    return {k: v for k, v in ann.items() if v}


def metadata_from_annotations(annotations: dict[str, str]) -> CheckpointMetadata | None:
    text = annotations.get(ANN_METADATA)
    if not text:
        return None
    try:
        return CheckpointMetadata.from_dict(json.loads(text))
    except (TypeError, ValueError) as exc:
        raise IntegrityError(f"annotation {ANN_METADATA} is not gpusnap checkpoint metadata ({exc}); rebuild the checkpoint image") from None


@dataclass
class CheckpointImage:
    ref: str  # tag in the gpusnap store
    digest: str  # manifest digest
    layer_size: int
    annotations: dict[str, str]


def archive_to_image(store_dir: Path, archive_path: Path, image_ref: str, *, arch: str | None = None,
                     extra_annotations: dict[str, str] | None = None) -> CheckpointImage:
    """Store a kubelet checkpoint archive as a checkpoint image (tag ``image_ref`` in the gpusnap
    store at ``store_dir``); ``gpusnap push`` (or :func:`gpusnap.packaging.api.push`) uploads it.

    The archive itself becomes the one uncompressed layer, byte for byte when it is a plain tar
    (its digest is then also its diff ID); the runtimes unpack that layer and read it exactly as
    they would the archive. ``arch`` (GOARCH) defaults to the checkpoint's, else this host's.
    ``extra_annotations`` are added to (and override) those read from the archive."""
    from gpusnap.packaging.store import (
        MEDIA_OCI_MANIFEST,
        Descriptor,
        OciStore,
        normalize_ref,
    )

    archive = read_archive(Path(archive_path))
    image_ref = normalize_ref(image_ref)
    annotations = {k: v for k, v in {**image_annotations(archive), **(extra_annotations or {})}.items() if v}
    store = OciStore(Path(store_dir))
    with store.writing():
        w = store.writer()
        try:
            fh, _ = _open(archive.path)
            with fh:
                shutil.copyfileobj(fh, w, 1 << 20)  # type: ignore[misc]
            layer_digest = w.commit()
        except BaseException:
            w.abort()
            store.discard_pending()
            raise
        layer_size = store.blob_path(layer_digest).stat().st_size
        created = annotations.get(ANN_CREATED)
        config = {
            **({"created": created} if created else {}),
            "architecture": arch or archive.arch or goarch(),
            "os": "linux",
            "config": {"Labels": {k: v for k, v in annotations.items() if k != ANN_METADATA}},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            "history": [{**({"created": created} if created else {}), "created_by": f"gpusnap cri image {archive.path.name}"}],
        }
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_digest = store.put_bytes(config_bytes)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MEDIA_OCI_MANIFEST,
            "config": {"mediaType": MEDIA_IMAGE_CONFIG, "digest": config_digest, "size": len(config_bytes)},
            "layers": [{"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": layer_size,
                        "annotations": {"org.opencontainers.image.title": archive.path.name}}],
            "annotations": annotations,
        }
        data = json.dumps(manifest, separators=(",", ":")).encode()
        digest = store.put_bytes(data)
        store.tag(image_ref, Descriptor(MEDIA_OCI_MANIFEST, digest, len(data)))
    return CheckpointImage(image_ref, digest, layer_size, annotations)


def is_checkpoint_manifest(manifest: dict[str, Any]) -> bool:
    ann = manifest.get("annotations") or {}
    return isinstance(ann, dict) and (ANN_CRIU_NAME in ann or ANN_CRIO_NAME in ann)
