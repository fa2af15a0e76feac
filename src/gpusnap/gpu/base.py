"""The vendor-neutral GPU backend interface and the plan that runs it around CRIU.

A :class:`GpuBackend` knows how to find the GPU processes of a container and move their GPU
state between device and host memory. A :class:`GpuPlan` turns a backend into the
:class:`~gpusnap.steps.Step` lists that the runtime shim splices around runc's checkpoint and
restore, so rollback stays structural (each step carries its undo).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

from gpusnap.metadata import CheckpointMetadata, GpuInfo, GpuProcess
from gpusnap.steps import Step


class ProcessGpuState(str, Enum):
    """The CUDA driver's per-process checkpoint states (other vendors map onto these)."""

    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"


class GpuBackend(Protocol):
    name: str

    def available(self) -> bool:
        """True when the driver and its checkpoint API can be used on this host."""

    def describe(self) -> list[GpuInfo]:
        """The host's GPUs."""

    def find_processes(self, host_pids: list[int]) -> list[GpuProcess]:
        """Those of ``host_pids`` that hold GPU state."""

    def state(self, host_pid: int) -> ProcessGpuState: ...

    def lock(self, host_pid: int, timeout_ms: int) -> None: ...

    def checkpoint(self, host_pid: int) -> None:
        """Move the (locked) process's GPU state into its host memory; releases device memory."""

    def restore(self, host_pid: int, uuid_remap: dict[str, str] | None = None) -> None:
        """Move the checkpointed state back onto the GPU(s), optionally onto other GPUs."""

    def unlock(self, host_pid: int) -> None: ...


@dataclass
class ContainerRef:
    """What the shim knows about a container when the GPU plan runs."""

    container_id: str
    init_pid: int  # host PID of the container's init process (0 when not running)
    bundle: Path
    annotations: dict[str, str] = field(default_factory=dict)
    cgroup_procs: list[int] = field(default_factory=list)  # every host PID of the container


class GpuPlan(Protocol):
    """Steps the shim splices around ``runc checkpoint`` / ``runc restore``."""

    def before_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata) -> list[Step]:
        """Find GPU processes, lock them all, checkpoint them all (each with its undo)."""

    def after_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata, leave_running: bool) -> list[Step]:
        """With ``leave_running``: restore and unlock so the container goes on."""

    def before_restore(self, image_dir: Path, meta: CheckpointMetadata | None) -> list[Step]:
        """Check this host can take the checkpoint; refuse before anything changes."""

    def after_restore(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata | None) -> list[Step]:
        """Map restored processes to their new host PIDs, restore GPU state and unlock."""


class NoGpuPlan:
    """The plan for hosts or containers without GPU state: nothing to splice."""

    def before_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata) -> list[Step]:
        return []

    def after_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata, leave_running: bool) -> list[Step]:
        return []

    def before_restore(self, image_dir: Path, meta: CheckpointMetadata | None) -> list[Step]:
        return []

    def after_restore(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata | None) -> list[Step]:
        return []
