"""Recovery after gpusnap-runtime was killed (SIGKILL, OOM, power loss of the caller) mid-flight.

A caught signal rolls a checkpoint or restore back through its steps; SIGKILL cannot be caught.
Then the container may be left running on the CPU with its GPU processes LOCKED or CHECKPOINTED
(their CUDA calls block), and a restore marker may outlive its restore. ``recover`` puts the
container back to a state a retry can start from: every GPU process RUNNING, no stale marker.
It is idempotent and changes nothing for a container that needs no recovery.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpusnap.config import Settings
from gpusnap.gpu.base import GpuBackend, ProcessGpuState
from gpusnap.gpu.group import GpuGroup
from gpusnap.gpu.plan import make_backend
from gpusnap.gpu.suspend import runc_state


@dataclass
class Recovery:
    container_id: str
    status: str  # runc's status of the container
    gpu_processes: int = 0
    moved: dict[str, int] = field(default_factory=dict)  # previous state -> processes brought back
    stale_marker_removed: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.moved) or self.stale_marker_removed


def _marker_owner_alive(text: str) -> bool:
    try:
        pid = int(text.split()[0])
    except (ValueError, IndexError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(container_id: str, settings: Settings, *, root: str | None = None, backend: GpuBackend | None = None) -> Recovery:
    """Bring every GPU process of a running container back to RUNNING; drop a dead restore's marker."""
    state = runc_state(container_id, settings, root)
    rec = Recovery(container_id, str(state.get("status", "")))
    marker = settings.run_dir / "restoring" / container_id
    if marker.exists() and not _marker_owner_alive(marker.read_text()):
        marker.unlink(missing_ok=True)
        rec.stale_marker_removed = True
    if rec.status != "running":
        return rec
    backend = backend or make_backend(settings)
    # Not of_container(): it refuses processes that are not RUNNING, which is what we repair.
    from gpusnap.gpu.procs import container_pids

    procs = backend.find_processes(sorted(container_pids(settings.host, int(state["pid"]))))  # type: ignore[arg-type]
    rec.gpu_processes = len(procs)
    for p in procs:
        s = backend.state(p.host_pid)
        if s != ProcessGpuState.RUNNING:
            rec.moved[s.value] = rec.moved.get(s.value, 0) + 1
    if rec.moved:
        GpuGroup(backend=backend, procs=procs).ensure_running()
    return rec
