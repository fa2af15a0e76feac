"""Talking to a node's container runtime over the Kubernetes CRI (containerd 2.x, CRI-O).

The CRI message and service types are compiled at run time from the CRI ``api.proto`` of the
node (grpcio-tools' in-process compiler, ``grpc.protos_and_services``) rather than shipped as
generated code: the proto is Kubernetes' file (not ours to copy), the node's copy matches the
runtime it talks to, and no generated module can go stale against the installed protobuf.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from gpusnap.errors import GpusnapError, MissingDependencyError, UsageError

# Where packages put the CRI api.proto (Debian/Ubuntu: golang-k8s-cri-api-dev).
PROTO_CANDIDATES = (
    Path("/usr/share/gocode/src/k8s.io/cri-api/pkg/apis/runtime/v1/api.proto"),
    Path("/usr/local/share/gpusnap/cri-api/api.proto"),
)
PROTO_ENV = "GPUSNAP_CRI_PROTO"
DEFAULT_SOCKET = "/run/containerd/containerd.sock"
# The module name the compiled proto gets: unique so it cannot clash with an application's own "api".
_MODULE = "gpusnap_cri_runtime_v1"


def find_proto(explicit: Path | None = None) -> Path:
    """The CRI api.proto to compile: ``explicit``, $GPUSNAP_CRI_PROTO, or a packaged copy."""
    cands = [explicit] if explicit else ([Path(os.environ[PROTO_ENV])] if os.environ.get(PROTO_ENV) else list(PROTO_CANDIDATES))
    for c in cands:
        if c is not None and c.is_file():
            return c
    raise MissingDependencyError(
        f"the Kubernetes CRI api.proto was not found ({', '.join(str(c) for c in cands)}); install golang-k8s-cri-api-dev "
        f"(Debian/Ubuntu) or set {PROTO_ENV} to k8s.io/cri-api's pkg/apis/runtime/v1/api.proto"
    )


@dataclass(frozen=True)
class CriApi:
    """The compiled CRI: ``pb`` holds the messages (RunPodSandboxRequest, ...), ``services`` the stubs."""

    pb: ModuleType
    services: ModuleType
    grpc: Any


def load(proto: Path | None = None) -> CriApi:
    """Compile (once per process and proto: Python's module cache keeps it) and return the CRI types."""
    try:
        import grpc
        from grpc_tools import protoc  # noqa: F401  (protos_and_services needs it)
    except ModuleNotFoundError as exc:
        raise MissingDependencyError(f"Python module {exc.name} is missing; install gpusnap[k8s] (grpcio, grpcio-tools) for the CRI engine") from None
    src = find_proto(proto)
    # Keyed by the file's content: the same proto compiles once per process, another one (a
    # node's newer CRI) gets its own modules instead of the first one's.
    name = f"{_MODULE}_{hashlib.sha256(src.read_bytes()).hexdigest()[:12]}"
    if f"{name}_pb2" in sys.modules:
        return CriApi(sys.modules[f"{name}_pb2"], sys.modules[f"{name}_pb2_grpc"], grpc)
    # protos_and_services resolves the proto through sys.path: a private directory holds a copy
    # under our module name for just this call.
    with tempfile.TemporaryDirectory(prefix="gpusnap-cri-") as tmp:
        shutil.copyfile(src, Path(tmp) / f"{name}.proto")
        sys.path.insert(0, tmp)
        try:
            pb, services = grpc.protos_and_services(f"{name}.proto")
        except Exception as exc:  # noqa: BLE001 - protoc reports a bad proto as any error
            raise UsageError(f"{src} could not be compiled as the CRI api.proto ({exc}); point {PROTO_ENV} at k8s.io/cri-api's api.proto") from None
        finally:
            sys.path.remove(tmp)
    sys.modules[f"{name}_pb2"] = pb
    sys.modules[f"{name}_pb2_grpc"] = services
    return CriApi(pb, services, grpc)


class CriError(GpusnapError):
    """A CRI call failed; the message carries the runtime's own words."""


class CriClient:
    """The two CRI services on one socket, with every call turned into a one-line error."""

    def __init__(self, socket: str = DEFAULT_SOCKET, *, timeout: float = 120, proto: Path | None = None) -> None:
        if not Path(socket).exists():
            raise MissingDependencyError(f"no CRI socket at {socket}; start containerd (or CRI-O) or pass --cri-socket")
        self.api = load(proto)
        self.socket = socket
        self.timeout = timeout
        self._channel = self.api.grpc.insecure_channel(f"unix://{socket}")
        self.runtime = self.api.services.RuntimeServiceStub(self._channel)
        self.images = self.api.services.ImageServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def msg(self, name: str, **fields: Any) -> Any:
        return getattr(self.api.pb, name)(**fields)

    def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        service = self.images if method in _IMAGE_METHODS else self.runtime
        try:
            return getattr(service, method)(request, timeout=timeout or self.timeout)
        except self.api.grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            raise CriError(f"CRI {method} failed ({code}): {detail}") from None

    # ---- the calls the kubelet makes, as gpusnap uses them ----------------------------------

    def version(self) -> Any:
        return self.call("Version", self.msg("VersionRequest", version="v1"))

    def list_pods(self) -> list[Any]:
        return list(self.call("ListPodSandbox", self.msg("ListPodSandboxRequest")).items)

    def list_containers(self, pod_id: str = "") -> list[Any]:
        flt = self.msg("ContainerFilter", pod_sandbox_id=pod_id) if pod_id else None
        req = self.msg("ListContainersRequest", filter=flt) if flt is not None else self.msg("ListContainersRequest")
        return list(self.call("ListContainers", req).containers)

    def container_status(self, container_id: str) -> Any:
        return self.call("ContainerStatus", self.msg("ContainerStatusRequest", container_id=container_id, verbose=True))

    def pod_status(self, pod_id: str) -> Any:
        return self.call("PodSandboxStatus", self.msg("PodSandboxStatusRequest", pod_sandbox_id=pod_id, verbose=True))

    def checkpoint(self, container_id: str, location: str, timeout: float = 600) -> None:
        self.call("CheckpointContainer", self.msg("CheckpointContainerRequest", container_id=container_id, location=location, timeout=int(timeout)),
                  timeout=timeout + 30)

    def run_pod(self, config: Any, runtime_handler: str = "") -> str:
        return str(self.call("RunPodSandbox", self.msg("RunPodSandboxRequest", config=config, runtime_handler=runtime_handler)).pod_sandbox_id)

    def create_container(self, pod_id: str, config: Any, sandbox_config: Any) -> str:
        req = self.msg("CreateContainerRequest", pod_sandbox_id=pod_id, config=config, sandbox_config=sandbox_config)
        return str(self.call("CreateContainer", req).container_id)

    def start_container(self, container_id: str) -> None:
        self.call("StartContainer", self.msg("StartContainerRequest", container_id=container_id))

    def stop_container(self, container_id: str, timeout: int = 0) -> None:
        self.call("StopContainer", self.msg("StopContainerRequest", container_id=container_id, timeout=timeout))

    def remove_container(self, container_id: str) -> None:
        self.call("RemoveContainer", self.msg("RemoveContainerRequest", container_id=container_id))

    def stop_pod(self, pod_id: str) -> None:
        self.call("StopPodSandbox", self.msg("StopPodSandboxRequest", pod_sandbox_id=pod_id))

    def remove_pod(self, pod_id: str) -> None:
        self.call("RemovePodSandbox", self.msg("RemovePodSandboxRequest", pod_sandbox_id=pod_id))

    def pull_image(self, image: str, sandbox_config: Any = None) -> str:
        req = self.msg("PullImageRequest", image=self.msg("ImageSpec", image=image), sandbox_config=sandbox_config)
        return str(self.call("PullImage", req).image_ref)

    def image_status(self, image: str) -> Any:
        return self.call("ImageStatus", self.msg("ImageStatusRequest", image=self.msg("ImageSpec", image=image))).image

    def remove_image(self, image: str) -> None:
        self.call("RemoveImage", self.msg("RemoveImageRequest", image=self.msg("ImageSpec", image=image)))


_IMAGE_METHODS = {"ListImages", "ImageStatus", "PullImage", "RemoveImage", "ImageFsInfo"}


def kubelet_checkpoint_name(pod: str, namespace: str, container: str, stamp: str) -> str:
    """The file name the kubelet gives a checkpoint archive (checkpoint-<pod>_<ns>-<container>-<time>.tar)."""
    return f"checkpoint-{pod}_{namespace}-{container}-{stamp}.tar"
