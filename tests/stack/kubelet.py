"""The kubelet's side of CRI, for tests: :class:`Kubelet` makes the calls the kubelet makes
(RunPodSandbox with a RuntimeClass handler, PullImage, CreateContainer, StartContainer,
CheckpointContainer into its checkpoint directory, StopPodSandbox/RemovePodSandbox) against a
:class:`stack.cri.Containerd2`; and reading a container's CRI log. No pytest here: the CPU
integration tests (tests/integration/cri) and the GPU suite (tests/gpu) both use it."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from stack.cri import Containerd2, container_config, sandbox_config
from stack.registry import Registry

from gpusnap.cri.client import CriClient, kubelet_checkpoint_name


@dataclass
class Pod:
    name: str
    namespace: str
    id: str
    sandbox: Any  # PodSandboxConfig
    container: str = ""  # container ID
    container_name: str = ""
    log: Path = Path()


@dataclass
class Kubelet:
    """The node: containerd, its registry, and the CRI calls the kubelet would make."""

    base: Path
    ctrd: Containerd2
    registry: Registry
    cri: CriClient
    standin: Path
    image: str  # a busybox image in the registry
    pods: list[Pod] = field(default_factory=list)

    @property
    def checkpoint_dir(self) -> Path:
        """Where the kubelet writes checkpoint archives (/var/lib/kubelet/checkpoints on a node)."""
        d = self.base / "var" / "lib" / "kubelet" / "checkpoints"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def run(self, name: str, handler: str, image: str, *, args: list[str] | None = None, envs: dict[str, str] | None = None,
            namespace: str = "default", mounts: list[tuple[str, str, bool]] = (), devices: list[str] = ()) -> Pod:  # type: ignore[assignment]
        """RunPodSandbox (runtime_handler = the RuntimeClass's handler), PullImage,
        CreateContainer, StartContainer: one pod with one container named ``name``."""
        pod = self.create(name, handler, image, args=args, envs=envs, namespace=namespace, mounts=mounts, devices=devices)
        self.cri.start_container(pod.container)
        return pod

    def create(self, name: str, handler: str, image: str, *, args: list[str] | None = None, envs: dict[str, str] | None = None,
               namespace: str = "default", mounts: list[tuple[str, str, bool]] = (), devices: list[str] = ()) -> Pod:  # type: ignore[assignment]
        """:meth:`run` up to CreateContainer (the container is created, not started)."""
        pod = self.create_pod(name, handler, namespace)
        self.cri.pull_image(image, pod.sandbox)
        cfg = self.container_config(name, image, args=args, envs=envs, mounts=mounts, devices=devices)
        pod.container, pod.container_name = self.cri.create_container(pod.id, cfg, pod.sandbox), name
        pod.log = Path(pod.sandbox.log_directory) / name / "0.log"
        return pod

    def create_pod(self, name: str, handler: str, namespace: str = "default") -> Pod:
        """RunPodSandbox with ``handler`` (a RuntimeClass's handler)."""
        logs = self.base / "var" / "log" / "pods" / f"{namespace}_{name}_{uuid.uuid4().hex[:8]}"
        sb = sandbox_config(self.cri.api, name, namespace, log_dir=logs)
        pod = Pod(name, namespace, self.cri.run_pod(sb, handler), sb)
        self.pods.append(pod)
        return pod

    def container_config(self, name: str, image: str, *, args: list[str] | None = None, envs: dict[str, str] | None = None,
                         mounts: list[tuple[str, str, bool]] = (), devices: list[str] = ()) -> Any:  # type: ignore[assignment]
        return container_config(self.cri.api, name, image, ["-c", args[0]] if args else [], envs=envs, mounts=mounts, devices=devices,
                                log_path=f"{name}/0.log")

    def checkpoint(self, pod: Pod) -> Path:
        """What ``POST /checkpoint/{namespace}/{pod}/{container}`` makes the kubelet do."""
        stamp = datetime.now().strftime("%Y-%m-%dT%H:%M:%S")
        location = self.checkpoint_dir / kubelet_checkpoint_name(pod.name, pod.namespace, pod.container_name, stamp)
        self.cri.checkpoint(pod.container, str(location))
        return location

    def remove(self, pod: Pod) -> None:
        self.cri.stop_pod(pod.id)
        self.cri.remove_pod(pod.id)
        self.pods.remove(pod)

    def state(self, pod: Pod) -> str:
        return str(self.cri.api.pb.ContainerState.Name(self.cri.container_status(pod.container).status.state))


def processes_with(marker: str) -> list[int]:
    """PIDs of host processes whose environment holds ``marker`` (NAME=value)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker.encode() in (p / "environ").read_bytes().split(b"\0"):
                    out.append(int(p.name))
            except OSError:
                continue
    return out


def numbers(log: Path, since: float = 0.0) -> list[int]:
    """The counter's numbers in a CRI log file (``<RFC 3339 time> stdout F <n>``), those logged
    at or after ``since`` (epoch seconds) only when given."""
    out = []
    try:
        text = log.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        m = re.fullmatch(r"(\S+) stdout F (\d+)", line)
        if not m:
            continue
        if since:
            ts = m.group(1)
            # Go writes up to 9 fractional digits; Python's fromisoformat takes 6.
            ts = re.sub(r"\.(\d{6})\d*", r".\1", ts).replace("Z", "+00:00")
            if datetime.fromisoformat(ts).timestamp() < since:
                continue
        out.append(int(m.group(2)))
    return out


def wait_numbers(log: Path, count: int, since: float = 0.0, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = numbers(log, since)
        if len(got) >= count:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{log}: {count} numbers not logged in {timeout}s; got {numbers(log, since)[-10:]}")
