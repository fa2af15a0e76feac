"""``--engine cri``: checkpoint and restore a pod's container over the node's CRI socket.

Checkpoint is what the kubelet's checkpoint API does (CheckpointContainer into
``/var/lib/kubelet/checkpoints``; the container keeps running), optionally followed by turning
the archive into a checkpoint image and pushing it. Restore checks the checkpoint against this
node first (architecture, GPU model and count, driver, CRIU), then makes a pod sandbox and a
container whose image is the checkpoint image, as ``crictl runp``/``create``/``start`` would;
on a kubelet-managed node the same restore is a Pod whose image is the checkpoint image
(docs/kubernetes.md). Every failure after the sandbox exists removes it again.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpusnap.config import Settings
from gpusnap.cri.client import (
    DEFAULT_SOCKET,
    CriClient,
    CriError,
    kubelet_checkpoint_name,
)
from gpusnap.cri.image import (
    ANN_CRIU_NAME,
    archive_to_image,
    goarch,
    is_checkpoint_manifest,
    metadata_from_annotations,
    read_archive,
)
from gpusnap.errors import (
    IncompatibleHostError,
    NotFoundError,
    RestoreError,
    UsageError,
)
from gpusnap.metadata import CheckpointMetadata

KUBELET_CHECKPOINTS = Path("/var/lib/kubelet/checkpoints")
DEFAULT_HANDLER = "gpusnap"


@dataclass(frozen=True)
class CriTarget:
    namespace: str
    pod: str
    container: str  # "" = the pod's only container


def parse_target(text: str, namespace: str = "default") -> CriTarget:
    """``POD``, ``POD/CONTAINER`` or ``NAMESPACE/POD/CONTAINER``."""
    parts = text.split("/")
    if not all(parts) or len(parts) > 3:
        raise UsageError(f"{text!r} is not POD, POD/CONTAINER or NAMESPACE/POD/CONTAINER")
    if len(parts) == 3:
        return CriTarget(parts[0], parts[1], parts[2])
    return CriTarget(namespace, parts[0], parts[1] if len(parts) == 2 else "")


def find_container(client: CriClient, target: CriTarget) -> tuple[Any, Any]:
    """The ready pod and running container ``target`` names (NotFoundError listing what is there)."""
    pods = [p for p in client.list_pods() if p.metadata.name == target.pod and p.metadata.namespace == target.namespace
            and p.state == client.api.pb.SANDBOX_READY]
    if not pods:
        have = sorted(f"{p.metadata.namespace}/{p.metadata.name}" for p in client.list_pods() if p.state == client.api.pb.SANDBOX_READY)
        raise NotFoundError(f"no ready pod {target.namespace}/{target.pod} on {client.socket}; ready pods: {', '.join(have) or 'none'}")
    pod = pods[0]
    running = [c for c in client.list_containers(pod.id) if c.state == client.api.pb.CONTAINER_RUNNING]
    if target.container:
        match = [c for c in running if c.metadata.name == target.container]
    else:
        match = running if len(running) == 1 else []
    if not match:
        names = ", ".join(sorted(c.metadata.name for c in running)) or "none"
        what = f"no running container {target.container!r}" if target.container else "not exactly one running container"
        raise NotFoundError(f"pod {target.namespace}/{target.pod} has {what}; its running containers: {names} (name one as POD/CONTAINER)")
    return pod, match[0]


@dataclass
class CriCheckpoint:
    archive: str
    namespace: str
    pod: str
    container: str
    container_id: str
    seconds: float
    gpu_state: bool  # the archive holds gpusnap-runtime's record (so GPU state, if any, is in it)
    image: str = ""  # local store tag of the checkpoint image
    pushed: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint(settings: Settings, target: CriTarget, *, socket: str = DEFAULT_SOCKET, output: Path | None = None,
               checkpoint_dir: Path = KUBELET_CHECKPOINTS, push: str | None = None, insecure: bool = False,
               proto: Path | None = None, timeout: float = 600) -> CriCheckpoint:
    """CheckpointContainer, as the kubelet's checkpoint API calls it; with ``push``, the archive
    becomes a checkpoint image in gpusnap's store and is pushed there."""
    with CriClient(socket, proto=proto) as client:
        _, ctr = find_container(client, target)
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        location = output or checkpoint_dir / kubelet_checkpoint_name(target.pod, target.namespace, ctr.metadata.name, stamp)
        if location.exists():
            raise UsageError(f"{location} exists; remove it or pass another --output")
        location.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            client.checkpoint(ctr.id, str(location), timeout=timeout)
        except CriError as exc:
            location.unlink(missing_ok=True)  # a partial archive is nobody's checkpoint
            raise _checkpoint_failed(exc) from None
        seconds = time.monotonic() - started
    archive = read_archive(location)
    result = CriCheckpoint(str(location), target.namespace, target.pod, ctr.metadata.name, ctr.id, round(seconds, 3), archive.meta is not None)
    if archive.meta is None:
        result.notes.append("the pod's runtime handler is not gpusnap-runtime: the archive holds no GPU state (use a RuntimeClass with handler gpusnap)")
    if push:
        image = archive_to_image(settings.store_dir, location, f"cri/{target.namespace}/{target.pod}-{ctr.metadata.name}:{uuid.uuid4().hex[:12]}")
        from gpusnap.packaging.api import push as push_image

        push_image(settings.store_dir, image.ref, push, insecure=insecure)
        result.image, result.pushed = image.ref, push
    return result


def _checkpoint_failed(exc: CriError) -> Exception:
    from gpusnap.errors import CheckpointError

    return CheckpointError(f"{exc}; the container is still running")


# ---- restore ------------------------------------------------------------------------------


@dataclass
class CheckpointSource:
    """What restore knows about a checkpoint before asking the runtime anything."""

    image: str  # what CreateContainer gets: a registry reference or a local archive path
    arch: str  # GOARCH, "" when unknown
    meta: CheckpointMetadata | None
    container_name: str
    remote: bool


def describe_source(source: str, *, insecure: bool = False) -> CheckpointSource:
    """A kubelet archive on this node, or a checkpoint image in a registry (manifest and config
    read, no layer pulled)."""
    path = Path(source)
    if path.exists():
        archive = read_archive(path)
        return CheckpointSource(str(path.absolute()), archive.arch, archive.meta, archive.container_name, False)
    if "/" not in source:
        raise NotFoundError(f"{source} is neither a file nor a registry reference (host/repo:tag)")
    from gpusnap.packaging.registry import RegistryClient, RemoteRef

    ref = RemoteRef.parse(source)
    client = RegistryClient(ref.registry, insecure=insecure)
    data, _, _ = client.get_manifest(ref.repository, ref.reference)
    manifest = json.loads(data)
    if "manifests" in manifest:
        raise UsageError(f"{source} is an image index; a checkpoint image is a single manifest (push the one for this node's platform)")
    if not is_checkpoint_manifest(manifest):
        raise UsageError(f"{source} is not a checkpoint image (no {ANN_CRIU_NAME} annotation); make one with `gpusnap checkpoint --engine cri --push`")
    ann = manifest.get("annotations") or {}
    config = _small_blob(client, ref.repository, manifest["config"]["digest"])
    arch = str(config.get("architecture") or ann.get("io.gpusnap.checkpoint.arch") or "")
    return CheckpointSource(source, arch, metadata_from_annotations(ann), str(ann.get(ANN_CRIU_NAME, "")), True)


def _small_blob(client: Any, repo: str, digest: str) -> dict[str, Any]:
    """An image config (a few KB), digest-checked."""
    from gpusnap.errors import IntegrityError
    from gpusnap.packaging.store import sha256_digest

    r = client.request("GET", f"/v2/{repo}/blobs/{digest}", scope=f"repository:{repo}:pull")
    with r:
        data = r.content[: 4 << 20]
    if sha256_digest(data) != digest:
        raise IntegrityError(f"the image config {digest} from {client.registry}/{repo} does not match its digest; refusing it")
    try:
        config = json.loads(data)
    except ValueError:
        raise IntegrityError(f"the image config {digest} from {client.registry}/{repo} is not JSON; refusing it") from None
    return config if isinstance(config, dict) else {}


def check_node(source: CheckpointSource, settings: Settings) -> None:
    """Refuse, before any CRI call, a checkpoint this node cannot restore."""
    from gpusnap.host.facts import gather, require_compatible

    if source.arch and source.arch != goarch():
        raise IncompatibleHostError(f"{source.image} is a checkpoint for {source.arch} and this node is {goarch()}; restore it on a {source.arch} node")
    require_compatible(source.meta, gather(settings, with_gpus=bool(source.meta and source.meta.processes)), what=source.image)


@dataclass
class CriRestore:
    pod_id: str
    container_id: str
    namespace: str
    pod: str
    container: str
    image: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def restore(settings: Settings, source: str, *, pod: str, namespace: str = "default", container: str = "", handler: str = DEFAULT_HANDLER,
            socket: str = DEFAULT_SOCKET, host_network: bool = False, insecure: bool = False, proto: Path | None = None,
            log_dir: Path | None = None) -> CriRestore:
    """Check, then RunPodSandbox + PullImage + CreateContainer(image = the checkpoint) +
    StartContainer; anything that fails after the sandbox exists removes the sandbox."""
    src = describe_source(source, insecure=insecure)
    check_node(src, settings)
    name = container or src.container_name or pod
    started = time.monotonic()
    with CriClient(socket, proto=proto) as client:
        pb = client.api.pb
        ns_opts = pb.NamespaceOption(network=pb.NODE if host_network else pb.POD, pid=pb.CONTAINER)
        logs = log_dir or Path("/var/log/pods") / f"{namespace}_{pod}_{uuid.uuid4()}"
        sandbox = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=pod, namespace=namespace, uid=str(uuid.uuid4()), attempt=0),
            log_directory=str(logs),
            labels={"io.kubernetes.pod.name": pod, "io.kubernetes.pod.namespace": namespace},
            linux=pb.LinuxPodSandboxConfig(security_context=pb.LinuxSandboxSecurityContext(namespace_options=ns_opts)),
        )
        pod_id = client.run_pod(sandbox, handler)
        try:
            if src.remote:
                client.pull_image(src.image, sandbox)
            config = pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name=name, attempt=0),
                image=pb.ImageSpec(image=src.image, user_specified_image=src.image),
                log_path=f"{name}/0.log",
                labels={"io.kubernetes.container.name": name, "io.kubernetes.pod.name": pod, "io.kubernetes.pod.namespace": namespace},
                linux=pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(namespace_options=ns_opts)),
            )
            ctr_id = client.create_container(pod_id, config, sandbox)
            client.start_container(ctr_id)
        except CriError as exc:
            _remove_pod(client, pod_id)
            raise RestoreError(f"{exc}; the pod sandbox was removed again") from None
        except BaseException:
            _remove_pod(client, pod_id)
            raise
    return CriRestore(pod_id, ctr_id, namespace, pod, name, src.image, round(time.monotonic() - started, 3))


def _remove_pod(client: CriClient, pod_id: str) -> None:
    for call in (client.stop_pod, client.remove_pod):
        try:
            call(pod_id)
        except CriError:
            pass  # RemovePodSandbox after a failed stop still tries; what is left shows in the message's pod list
