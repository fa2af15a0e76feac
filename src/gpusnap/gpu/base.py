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

from gpusnap.errors import CheckpointError
from gpusnap.metadata import CheckpointMetadata, GpuInfo, GpuProcess
from gpusnap.steps import Step


class ProcessGpuState(str, Enum):
    """The CUDA driver's per-process checkpoint states (other vendors map onto these)."""

    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"


class GpuCallError(CheckpointError):
    """A driver checkpoint call failed for one process (``call`` on host PID ``pid``: ``code``)."""

    def __init__(self, call: str, pid: int, code: str, hint: str = "") -> None:
        self.call, self.pid, self.code = call, pid, code
        super().__init__(f"GPU {call} of host PID {pid} failed: {code}" + (f"; {hint}" if hint else ""))


class GpuLockTimeout(GpuCallError):
    """The lock did not get in before its timeout: the process stays RUNNING."""


class ProcessGone(GpuCallError):
    """The process no longer exists (it exited, or runc checkpoint already stopped it)."""


@dataclass
class GpuStatus:
    """A host GPU as restore's host check needs it."""

    info: GpuInfo
    memory_free_bytes: int
    mig_enabled: bool = False


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

    def status(self) -> list[GpuStatus]:
        """The host's GPUs with free memory and MIG mode (for restore's host check)."""

    def process_memory(self, host_pid: int) -> dict[str, int]:
        """GPU UUID -> bytes of device memory that ``host_pid`` holds now."""

    def unsupported_reason(self, host_pid: int) -> str | None:
        """Why this process's GPU state cannot be checkpointed (managed memory, MPS, MIG), or None."""

    def supports_remap(self) -> bool:
        """True when restore can move state onto GPUs with other UUIDs (driver >= 580)."""


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

    def before_restore(self, image_dir: Path, meta: CheckpointMetadata | None, ref: ContainerRef | None = None) -> list[Step]:
        """Check this host (the GPUs ``ref.annotations`` give the restored container, when
        known at the time the step runs) can take the checkpoint; refuse before anything changes."""

    def after_restore(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata | None) -> list[Step]:
        """Map restored processes to their new host PIDs, restore GPU state and unlock."""

    def dump_failure(self, ref: ContainerRef, criu_error: str | None) -> Exception | None:
        """What a failed dump (CRIU's first error: ``criu_error``) was about, when the plan can
        tell better than runc: an error to raise instead of runc's own, or None."""


class NoGpuPlan:
    """The plan for hosts or containers without GPU state: nothing to splice."""

    def before_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata) -> list[Step]:
        return []

    def after_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata, leave_running: bool) -> list[Step]:
        return []

    def before_restore(self, image_dir: Path, meta: CheckpointMetadata | None, ref: ContainerRef | None = None) -> list[Step]:
        return []

    def after_restore(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata | None) -> list[Step]:
        return []

    def dump_failure(self, ref: ContainerRef, criu_error: str | None) -> Exception | None:
        return None
