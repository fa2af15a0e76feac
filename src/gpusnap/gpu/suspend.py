"""Suspend / resume: move a running container's GPU state to host memory and back, in place.

The container keeps running on the CPU; its CUDA calls block while suspended and its GPU memory
is free for other work. Both directions move all of the container's GPU processes together and
take back what they did on any failure, so a container is either wholly suspended or wholly
running on the GPU.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpusnap.config import Settings
from gpusnap.errors import CheckpointError, GpusnapError, MissingDependencyError, NotFoundError, UsageError
from gpusnap.gpu.base import GpuBackend, ProcessGpuState
from gpusnap.gpu.group import GpuGroup
from gpusnap.gpu.plan import make_backend
from gpusnap.metadata import GpuProcess
from gpusnap.steps import Step, run_steps, signals_as_exceptions


@dataclass
class SuspendRecord:
    container_id: str
    init_pid: int
    processes: list[GpuProcess] = field(default_factory=list)
    gpu_memory_bytes: int = 0  # device memory the container held before suspending
    timings_s: dict[str, float] = field(default_factory=dict)


def runc_state(container_id: str, settings: Settings, root: str | None = None) -> dict[str, object]:
    """``runc state`` of the container (its init PID, status, bundle)."""
    runc = settings.runc or shutil.which("runc")
    if not runc:
        raise MissingDependencyError("runc not found; install runc or set GPUSNAP_RUNC")
    cmd = [runc] + (["--root", root] if root else []) + ["state", container_id]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise NotFoundError(f"container {container_id!r} not found by runc ({res.stderr.strip() or res.stdout.strip()}); check the name and --root")
    return json.loads(res.stdout)


def _record_path(settings: Settings, container_id: str) -> Path:
    return settings.run_dir / "suspended" / f"{container_id}.json"


def _running_init(container_id: str, settings: Settings, root: str | None) -> int:
    state = runc_state(container_id, settings, root)
    if state.get("status") != "running":
        raise UsageError(f"container {container_id!r} is {state.get('status')}, not running; only a running container can be suspended or resumed")
    return int(state["pid"])  # type: ignore[arg-type]


def suspend(container_id: str, settings: Settings, *, root: str | None = None, backend: GpuBackend | None = None) -> SuspendRecord:
    """Lock and checkpoint every GPU process of the container; on failure, leave it running."""
    backend = backend or make_backend(settings)
    init_pid = _running_init(container_id, settings, root)
    t0 = time.perf_counter()
    try:
        group = GpuGroup.of_container(backend, settings.host, init_pid)
    except CheckpointError as exc:  # already suspended, or another checkpoint holds it
        raise UsageError(f"container {container_id!r} cannot be suspended now: {exc}") from None
    if not group.procs:
        raise UsageError(f"container {container_id!r} has no GPU processes; nothing to suspend")
    memory = sum(p.gpu_memory_bytes for p in group.procs)
    with signals_as_exceptions():
        run_steps(
            [
                Step("gpu: lock GPU processes", lambda: group.lock_all(settings.lock_timeout_ms), group.ensure_running),
                Step("gpu: checkpoint GPU state to host memory", group.checkpoint_all, group.ensure_not_checkpointed),
            ]
        )
    timings = {k: round(v, 4) for k, v in group.timings.items()}
    timings["total"] = round(time.perf_counter() - t0, 4)
    rec = SuspendRecord(container_id, init_pid, list(group.procs), memory, timings)
    path = _record_path(settings, container_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(rec), indent=2))
    return rec


def resume(container_id: str, settings: Settings, *, root: str | None = None, backend: GpuBackend | None = None) -> dict[str, float]:
    """Restore and unlock every suspended GPU process; if restore fails part-way, stay wholly suspended."""
    backend = backend or make_backend(settings)
    init_pid = _running_init(container_id, settings, root)
    t0 = time.perf_counter()
    try:
        group = GpuGroup.of_container(backend, settings.host, init_pid, expect=ProcessGpuState.CHECKPOINTED)
    except GpusnapError as exc:
        raise UsageError(f"container {container_id!r} is not suspended: {exc}") from None
    if not group.procs:
        raise UsageError(f"container {container_id!r} has no GPU processes; nothing to resume")
    with signals_as_exceptions():
        run_steps(
            [
                Step("gpu: restore GPU state from host memory", group.restore_all, group.ensure_checkpointed),
                Step("gpu: unlock GPU processes", group.unlock_all),
            ]
        )
    _record_path(settings, container_id).unlink(missing_ok=True)
    timings = {k: round(v, 4) for k, v in group.timings.items()}
    timings["total"] = round(time.perf_counter() - t0, 4)
    return timings
