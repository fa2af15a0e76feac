"""A gpusnap checkpoint artifact (taken on a podman, docker or runc-direct host) made into the
checkpoint image a Kubernetes node restores: the reverse of :func:`gpusnap.cri.image.archive_to_image`.

containerd 2.x restores a pod's container from an image whose single layer unpacks to what the
kubelet's checkpoint archive holds. Of that, its CRI code reads ``config.dump`` (checkpointctl's
ContainerConfig: the base image to pull by ``rootfsImageRef`` = NAME@DIGEST, a parseable
``rootfsImageName``, ``checkpointedTime``), ``spec.dump`` (an OCI spec; only its annotations are
read) and ``status.dump`` (a CRI ContainerStatus in JSON: name, base image, labels and
annotations the new container takes over); its runc shim hands ``checkpoint/`` to ``runc
restore`` and applies ``rootfs-diff.tar`` (if there) to the new root filesystem first. CRI-O
reads the same files. A gpusnap artifact has the CRIU images and the gpusnap record; the rest is
derived here from its config, or the conversion is refused saying what to pass:

- the base image: the artifact's ``image.name`` (podman, docker), resolved to its digest in its
  registry; a runc-direct container ran on a directory no registry holds, so ``base_image``
  must name an image with the same files;
- the spec: podman's ``spec.dump``, runc-direct's bundle config, or a minimal one (docker);
- the root filesystem's changes: podman's ``rootfs-diff.tar``; a runc-direct overlay container's
  writable layer is over a host directory and is refused.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpusnap.cri.image import ANN_CRIU_ENGINE, CheckpointImage, archive_to_image, goarch
from gpusnap.errors import IncompatibleHostError, IntegrityError, UsageError

ANN_SOURCE = "io.gpusnap.checkpoint.source"  # the artifact the image was made from (manifest digest)
ANN_FORM = "io.gpusnap.checkpoint.form"
RUNC_DIRECT_RECORD = "runc-direct.json"  # gpusnap.engines.runc_direct.BUNDLE_RECORD (not imported: it pulls in the engine)
RUNC_DIRECT_UPPER = "rootfs-upper.tar"
SKIP_FROM_PODMAN = ("config.dump", "spec.dump", "status.dump")  # rewritten in the form the CRI runtimes read
CRIO_SPEC_ANNOTATIONS = "io.kubernetes.cri-o.Annotations"
RUNTIMES = ("containerd", "cri-o")
# Bind mounts an engine makes that a containerd container never has. runc restore maps only the
# new spec's bind mounts for CRIU, so a dumped one without a counterpart fails the restore late,
# inside CRIU: refused here instead. (CRI-O makes /run/.containerenv in its containers too.)
ENGINE_ONLY_BINDS = ("/run/.containerenv",)


@dataclass
class Source:
    """The artifact as found: its config (the conversion's input) and where it was read."""

    ref: str
    digest: str
    config: dict[str, Any]
    remote: bool


def _is_remote(ref: str) -> bool:
    first, _, rest = ref.partition("/")
    return bool(rest) and ("." in first or ":" in first or first == "localhost")


def _rfc3339(text: str) -> str:
    """Go's time.Time reads RFC 3339 only; the artifact's ``created`` may have a ``+00:00``."""
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00")) if text else datetime.now(timezone.utc)
    except ValueError:
        dt = datetime.now(timezone.utc)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_convertible(src: Source, *, base_image: str | None, arch: str | None) -> str:
    """Refuse, from the config alone (before any layer moves), what cannot become a CRI
    checkpoint image; returns the image's GOARCH."""
    cfg = src.config
    form = cfg.get("form")
    if form not in ("criu-dir", "docker-dir", "podman-archive"):
        raise UsageError(f"{src.ref} is not a gpusnap checkpoint (form {form!r}); name an artifact made by gpusnap checkpoint --push")
    made_on = goarch(str(cfg.get("arch") or "")) if cfg.get("arch") else ""
    target = arch or goarch()
    if made_on and made_on != target:
        raise IncompatibleHostError(f"{src.ref} is a checkpoint for {made_on} and the image would be for {target}: a node of another "
                                    f"architecture cannot restore it; convert it for {made_on} nodes (--arch {made_on})")
    engine = str((cfg.get("engine") or {}).get("name") or "")
    image = str((cfg.get("image") or {}).get("name") or "")
    if not base_image:
        if engine in ("runc", "runc-direct") or not image:
            raise UsageError(f"{src.ref} ran on a root filesystem directory ({image or 'unnamed'}), not a registry image; pass --base-image "
                             "IMAGE: an image with the same files, which the node pulls as the container's root filesystem")
    return made_on or target


@dataclass
class BaseImage:
    name: str  # as the restored container reports it (status.dump, rootfsImageName)
    ref: str  # NAME@DIGEST of its manifest (or index): what containerd pulls
    image_id: str  # hex of its config digest for ``arch``: CRI-O's local image ID


def resolve_base_image(name: str, *, arch: str, insecure: bool, need_id: bool = True) -> BaseImage:
    """The base image's digest and, for the node's architecture, its image ID, asked of its
    registry (two small requests; an index costs one more). Nothing is pulled. A name with a
    digest needs no registry unless the image ID is asked for (``need_id``: CRI-O)."""
    from gpusnap.errors import GpusnapError
    from gpusnap.packaging.registry import RegistryClient, RemoteRef
    from gpusnap.packaging.store import MEDIA_DOCKER_LIST, MEDIA_OCI_INDEX

    ref = RemoteRef.parse(name)
    repo = f"{ref.registry}/{ref.repository}"
    shown = f"{repo}:{ref.tag}" if ref.tag else repo
    if ref.digest and not need_id:
        return BaseImage(shown, f"{repo}@{ref.digest}", "")
    try:
        client = RegistryClient(ref.registry, insecure=insecure)
        data, media, digest = client.get_manifest(ref.repository, ref.reference)
        manifest = json.loads(data)
        if media in (MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST) or "manifests" in manifest:
            picked = [m for m in manifest.get("manifests", []) if (m.get("platform") or {}).get("architecture") == arch
                      and (m.get("platform") or {}).get("os", "linux") == "linux"]
            if not picked:
                raise UsageError(f"the base image {name} has no linux/{arch} image; pass an image for the checkpoint's architecture")
            data, _, _ = client.get_manifest(ref.repository, picked[0]["digest"])
            manifest = json.loads(data)
        config_digest = str((manifest.get("config") or {}).get("digest") or "")
    except UsageError:
        raise
    except GpusnapError as exc:
        raise type(exc)(f"cannot resolve the base image {name} to a digest ({exc}); check the name, or pass --base-image") from None
    except (ValueError, AttributeError):
        raise UsageError(f"the base image {name} has no readable manifest; pass another --base-image") from None
    if not config_digest.startswith("sha256:"):
        raise UsageError(f"the base image {name} is not a container image (its manifest has no config); pass another --base-image")
    return BaseImage(shown, f"{repo}@{digest}", config_digest.removeprefix("sha256:"))


@contextmanager
def _artifact_store(store_dir: Path, ref: str, digest: str, *, insecure: bool, work: Path) -> Iterator[tuple[Path, str]]:
    """(store, ref) holding the whole artifact: the user's store when it has ``ref``, else a
    private one under ``work`` the registry's copy is pulled into (removed with ``work``, so the
    user's store never keeps a half-converted pull)."""
    from gpusnap.packaging import api

    if api.has_checkpoint(store_dir, ref):
        yield store_dir, ref
        return
    tmp = work / "store"
    api.pull(tmp, ref, insecure=insecure)
    from gpusnap.packaging.store import OciStore

    if OciStore(tmp).resolve(ref).digest != digest:
        raise IntegrityError(f"{ref} changed in the registry while it was converted (the tag moved); run the conversion again")
    yield tmp, ref


def _refuse_encrypted(ref: str, manifest: dict[str, Any]) -> None:
    from gpusnap.packaging.encrypted import is_encrypted_manifest

    if is_encrypted_manifest(manifest):
        raise UsageError(f"{ref} is encrypted and a checkpoint image cannot be (containerd unpacks it as it is); restore it with "
                         "gpusnap restore --decrypt-key, or checkpoint without --encrypt for Kubernetes")


def open_source(store_dir: Path, ref: str, *, insecure: bool) -> Source:
    from gpusnap.packaging import api

    if api.has_checkpoint(store_dir, ref):
        from gpusnap.packaging.store import OciStore

        store = OciStore(Path(store_dir))
        desc = store.resolve(ref)
        manifest = store.manifest(desc.digest)
        _refuse_encrypted(ref, manifest)
        config = json.loads(store.blob_path(manifest["config"]["digest"]).read_bytes())
        return Source(ref, desc.digest, config, remote=False)
    if not _is_remote(ref):
        raise UsageError(f"{ref} is not in the local store ({store_dir}) and is not a registry reference (HOST[:PORT]/REPOSITORY:TAG)")
    digest, manifest, config = api.remote_config(ref, insecure=insecure, sealed_ok=True)
    _refuse_encrypted(ref, manifest)
    return Source(ref, digest, config, remote=True)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(mtime)
    tar.addfile(info, io.BytesIO(data))


def _add_tree(tar: tarfile.TarFile, root: Path, prefix: str, skip: tuple[str, ...] = ()) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = Path(dirpath).relative_to(root)
        for f in sorted(filenames):
            if (rel / f).as_posix() in skip:
                continue
            p = Path(dirpath) / f
            if p.is_symlink() or not p.is_file():
                raise UsageError(f"checkpoint file {rel / f} is not a regular file; containerd restores only files and directories")
            tar.add(p, arcname=f"{prefix}{(rel / f).as_posix()}", recursive=False)


def dump_files(src: Source, base: BaseImage, spec: dict[str, Any] | None, *, runtime: str = "containerd") -> dict[str, bytes]:
    """config.dump, status.dump and (``spec`` given) spec.dump, as ``runtime`` reads them.

    The one field the two read differently is ``rootfsImageRef``: containerd pulls it
    (NAME@DIGEST), CRI-O takes it as the ID of an image already on the node. CRI-O also needs
    the spec annotation ``io.kubernetes.cri-o.Annotations`` (the original CRI annotations, JSON)."""
    cfg = src.config
    name = str((cfg.get("container") or {}).get("name") or (cfg.get("container") or {}).get("id") or "checkpoint")
    cid = str((cfg.get("container") or {}).get("id") or name)
    created = _rfc3339(str(cfg.get("created") or ""))
    config = {
        "id": cid, "name": name, "rootfsImage": base.name, "rootfsImageName": base.name,
        "rootfsImageRef": base.image_id if runtime == "cri-o" else base.ref,
        "runtime": "io.containerd.runc.v2", "createdTime": created, "checkpointedTime": created,
        "restoredTime": "0001-01-01T00:00:00Z", "restored": False,
    }
    status = {
        "id": cid, "metadata": {"name": name}, "state": 1,
        "image": {"image": base.name, "user_specified_image": base.name}, "image_ref": base.ref,
        "labels": {"io.kubernetes.container.name": name}, "annotations": {},
    }
    out = {"config.dump": json.dumps(config).encode(), "status.dump": json.dumps(status).encode()}
    if spec is not None:
        ann = dict(spec.get("annotations") or {})
        ann.setdefault(CRIO_SPEC_ANNOTATIONS, "{}")
        out["spec.dump"] = json.dumps({**spec, "annotations": ann}).encode()
    return out


def check_binds(src: Source, spec: dict[str, Any], runtime: str) -> None:
    if runtime != "containerd":
        return
    binds = [str(m.get("destination")) for m in spec.get("mounts") or []
             if isinstance(m, dict) and (m.get("type") == "bind" or "bind" in (m.get("options") or []) or "rbind" in (m.get("options") or []))]
    missing = [b for b in binds if b in ENGINE_ONLY_BINDS]
    if missing:
        raise UsageError(f"{src.ref} had the bind mount {', '.join(missing)}, which a containerd container never has, so CRIU cannot "
                         "restore it there; restore it with gpusnap restore (podman), or convert it for CRI-O nodes (--cri-runtime cri-o)")


def build_layer(store_dir: Path, ref: str, src: Source, dest: Path, base: BaseImage, *, runtime: str = "containerd") -> Path:
    """Write the kubelet-archive-shaped tar the checkpoint image's layer is, from the artifact
    materialized through the packaging API."""
    from gpusnap.packaging import api

    work = dest.parent
    form = src.config.get("form")
    now = datetime.now(timezone.utc).timestamp()
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as out:
        if form == "podman-archive":
            exported = api.materialize_checkpoint(store_dir, ref, work / "podman.tar", form="podman-archive")
            spec: dict[str, Any] | None = None
            with tarfile.open(exported, "r:*") as podman:
                for m in podman:
                    if m.name == "spec.dump" and m.isreg():
                        f = podman.extractfile(m)
                        spec = json.loads(f.read()) if f else None
                    if m.name in SKIP_FROM_PODMAN:
                        continue
                    if not (m.isreg() or m.isdir()):
                        continue  # runtimes write only files and directories; containerd drops the rest
                    out.addfile(m, podman.extractfile(m) if m.isreg() else None)
            if not isinstance(spec, dict):
                raise UsageError(f"{src.ref}: its podman export has no readable spec.dump; take the checkpoint again")
            check_binds(src, spec, runtime)
            for n, data in dump_files(src, base, spec, runtime=runtime).items():
                _add_bytes(out, n, data, now)
            exported.unlink()
            return dest
        criu = api.materialize_checkpoint(store_dir, ref, work / "criu", form="criu-dir")
        spec: dict[str, Any] = {"ociVersion": "1.0.2", "annotations": {}}
        record = criu / RUNC_DIRECT_RECORD
        if record.is_file():
            portable = json.loads(record.read_text())
            if (criu / RUNC_DIRECT_UPPER).exists() or (portable.get("record") or {}).get("rootfs") == "overlay":
                raise UsageError(f"{src.ref} ran on an overlay over a host directory, whose changes no image holds; "
                                 "restore it with gpusnap restore on a host with that directory instead")
            spec = portable.get("spec") or spec
        for n, data in dump_files(src, base, spec, runtime=runtime).items():
            _add_bytes(out, n, data, now)
        _add_tree(out, criu, "checkpoint/")
    shutil.rmtree(work / "criu", ignore_errors=True)
    return dest


def artifact_to_image(store_dir: Path, ref: str, image_ref: str, *, base_image: str | None = None, arch: str | None = None,
                      insecure: bool = False, runtime: str = "containerd") -> CheckpointImage:
    """Make the CRI checkpoint image of the gpusnap artifact ``ref`` (a tag in the store at
    ``store_dir``, or a registry reference: pulled into a private store that is removed after),
    tagged ``image_ref`` in ``store_dir``; push it with :func:`gpusnap.packaging.api.push`.

    Refused before any layer is read: an artifact of another architecture than ``arch`` (GOARCH,
    default this host's), one whose container ran on a directory (runc-direct) without
    ``base_image``. ``runtime``: ``containerd`` (pulls the base image by digest) or ``cri-o``
    (expects it on the node, by image ID). A base image that cannot be resolved to a digest is refused
    before anything is written. On any failure the store is as it was."""
    if runtime not in RUNTIMES:
        raise UsageError(f"unknown CRI runtime {runtime!r}; use one of {', '.join(RUNTIMES)}")
    store_dir = Path(store_dir)
    src = open_source(store_dir, ref, insecure=insecure)
    image_arch = check_convertible(src, base_image=base_image, arch=arch)
    base = resolve_base_image(base_image or str(src.config["image"]["name"]), arch=image_arch, insecure=insecure,
                              need_id=runtime == "cri-o")
    store_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".cri-image-", dir=store_dir.parent))
    try:
        with _artifact_store(store_dir, ref, src.digest, insecure=insecure, work=work) as (sdir, sref):
            name = str((src.config.get("container") or {}).get("name") or "checkpoint")
            (work / "layer").mkdir()
            layer = build_layer(sdir, sref, src, work / "layer" / f"checkpoint-{name}.tar", base, runtime=runtime)
            return archive_to_image(store_dir, layer, image_ref, arch=image_arch,
                                    extra_annotations={ANN_SOURCE: src.digest, ANN_FORM: str(src.config.get("form") or ""),
                                                       ANN_CRIU_ENGINE: str((src.config.get("engine") or {}).get("name") or "")})
    finally:
        shutil.rmtree(work, ignore_errors=True)
