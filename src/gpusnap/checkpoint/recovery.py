"""Recovery after gpusnap-runtime was killed (SIGKILL, OOM, power loss of the caller) mid-flight.

A caught signal rolls a checkpoint or restore back through its steps; SIGKILL cannot be caught.
Then the container may be left running on the CPU with its GPU processes LOCKED or CHECKPOINTED
(their CUDA calls block), and a restore marker may outlive its restore.

Every checkpoint and restore of a container holds an exclusive ``flock`` on
``<run_dir>/locks/<id>.lock`` (:func:`operation_lock`); the kernel drops it when the process
dies, however it dies. So a GPU process found LOCKED or CHECKPOINTED while that lock is free
(and the container is not deliberately suspended) is debris of a killed run: the next checkpoint
heals it first (:func:`heal`), and ``gpusnap recover`` does the same on demand, with the stale
restore marker. Both are idempotent.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.config import HostPaths, Settings
from gpusnap.errors import CheckpointError, GpusnapError
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


def lock_path(settings: Settings, container_id: str) -> Path:
    return settings.run_dir / "locks" / f"{container_id}.lock"


@contextmanager
def operation_lock(settings: Settings, container_id: str, *, error: type[GpusnapError] = CheckpointError) -> Iterator[None]:
    """Hold the container's operation lock; refuse at once if a live gpusnap holds it."""
    path = lock_path(settings, container_id)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise error(f"another gpusnap checkpoint or restore of {container_id} is running; wait for it to end and try again") from None
        yield
    finally:
        os.close(fd)


def is_suspended(settings: Settings, container_id: str) -> bool:
    """``gpusnap suspend`` leaves GPU processes CHECKPOINTED on purpose; that is not debris."""
    return (settings.run_dir / "suspended" / f"{container_id}.json").exists()


def heal(backend: GpuBackend, host: HostPaths, init_pid: int, pids: list[int] | None = None) -> dict[str, int]:
    """Under :func:`operation_lock`: bring GPU processes a killed run left behind back to RUNNING.

    Returns ``{previous state: count}`` of what it moved (empty when nothing needed it).
    """
    from gpusnap.gpu.procs import container_pids

    found = set(pids or [])
    if init_pid > 0:
        found.update(container_pids(host, init_pid))
    procs = backend.find_processes(sorted(found))
    moved: dict[str, int] = {}
    for p in procs:
        s = backend.state(p.host_pid)
        if s != ProcessGpuState.RUNNING:
            moved[s.value] = moved.get(s.value, 0) + 1
    if moved:
        GpuGroup(backend=backend, procs=procs).ensure_running()
    return moved


def recover(container_id: str, settings: Settings, *, root: str | None = None, backend: GpuBackend | None = None) -> Recovery:
    """Bring every GPU process of a running container back to RUNNING; drop a dead restore's marker."""
    with operation_lock(settings, container_id):
        return _recover(container_id, settings, root, backend)


def _recover(container_id: str, settings: Settings, root: str | None, backend: GpuBackend | None) -> Recovery:
    state = runc_state(container_id, settings, root)
    rec = Recovery(container_id, str(state.get("status", "")))
    marker = settings.run_dir / "restoring" / container_id
    if marker.exists() and not _marker_owner_alive(marker.read_text()):
        marker.unlink(missing_ok=True)
        rec.stale_marker_removed = True
    if rec.status != "running":
        return rec
    if is_suspended(settings, container_id):
        raise CheckpointError(f"{container_id} is suspended on purpose (gpusnap suspend); use `gpusnap resume {container_id}`")
    backend = backend or make_backend(settings)
    # Not GpuGroup.of_container(): it refuses processes that are not RUNNING, which is what we repair.
    from gpusnap.gpu.procs import container_pids

    rec.gpu_processes = len(backend.find_processes(sorted(container_pids(settings.host, int(state["pid"])))))  # type: ignore[arg-type]
    rec.moved = heal(backend, settings.host, int(state["pid"]))  # type: ignore[arg-type]
    return rec
