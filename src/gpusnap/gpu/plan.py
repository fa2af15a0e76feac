"""The GPU steps spliced around ``runc checkpoint`` / ``runc restore``, and picking the backend.

Checkpoint: find every GPU process of the container (its whole PID namespace or cgroup), lock
them all (with the configured timeout), then checkpoint them all: a consistent cut. Each step
carries a state-aware undo, so a failure anywhere later (CRIU, a signal, a full disk) puts every
process back to RUNNING. With ``--leave-running`` the state is restored and unlocked once CRIU
is done. Restore: check the host against gpusnap.json before anything changes; after runc has
restored the processes, find their new host PIDs by their PIDs inside the container, restore
their GPU state (remapping GPUs when they differ) and unlock them. The GPUs that take the state
are those the restored spec was given (gpusnap.io/assigned-gpus, written by the injection from
gpusnap.io/gpus or NVIDIA_VISIBLE_DEVICES), else any of this host's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.config import HostPaths, Settings
from gpusnap.errors import IncompatibleHostError, MissingDependencyError, RestoreError, UnsupportedError, UsageError
from gpusnap.gpu.base import ContainerRef, GpuBackend, GpuPlan, NoGpuPlan, ProcessGpuState
from gpusnap.gpu.group import GpuGroup, container_processes
from gpusnap.gpu.compat import check_host
from gpusnap.gpu.procs import container_pids, host_pid_by_ns_pid
from gpusnap.gpu.selection import assigned_gpus
from gpusnap.gpu.unsupported import bystanders_reason, uses_nvidia_devices
from gpusnap.metadata import CheckpointMetadata, GpuProcess, merge_restore_timings
from gpusnap.steps import Step


# CRIU's first error when it met a device file (an fd or a mapping) it cannot save.
DEVICE_FILE_ERRORS = ("non-regular mapping", "handle_device_vma", "Can't dump file")


@dataclass
class _Run:
    """What one checkpoint or restore has found and done so far (shared by its steps)."""

    group: GpuGroup | None = None
    started: float = 0.0
    mark: float = 0.0  # end of the last GPU step before runc ran
    remap: dict[str, str] = field(default_factory=dict)


class CudaPlan:
    """The plan for a backend with the CUDA driver's checkpoint semantics (NVIDIA or stand-in)."""

    def __init__(self, backend: GpuBackend, settings: Settings, clock: Callable[[], float] = time.perf_counter) -> None:
        self.backend = backend
        self.settings = settings
        self.clock = clock
        self._ckpt = _Run()
        self._rest = _Run()

    # -- checkpoint ------------------------------------------------------------------------------
    def before_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata) -> list[Step]:
        run = self._ckpt = _Run()

        def find() -> int:
            run.started = self.clock()
            group = GpuGroup.of_container(self.backend, self.settings.host, ref.init_pid, ref.cgroup_procs or None, refuse_bystanders=True)
            group.clock = self.clock
            run.group = group
            meta.gpu_backend = self.backend.name
            meta.processes = list(group.procs)
            meta.gpus = group.gpus() if group.procs else []
            run.mark = self.clock()
            return len(group.procs)

        def lock() -> None:
            assert run.group is not None
            run.group.lock_all(self.settings.lock_timeout_ms)
            run.mark = self.clock()

        def checkpoint() -> None:
            assert run.group is not None
            run.group.checkpoint_all()
            run.mark = self.clock()

        def undo_lock() -> None:
            if run.group is not None:
                run.group.ensure_running()

        def undo_checkpoint() -> None:
            if run.group is not None:
                run.group.ensure_not_checkpointed()

        return [
            Step("gpu: find GPU processes", find),
            Step("gpu: lock GPU processes", lock, undo_lock),
            Step("gpu: checkpoint GPU state to host memory", checkpoint, undo_checkpoint),
        ]

    def dump_failure(self, ref: ContainerRef, criu_error: str | None) -> Exception | None:
        """CRIU failed on a device file or mapping and a process other than the checkpointed
        CUDA processes holds NVIDIA device files now: one that took them after the check before
        the GPU steps (torch.compile's pool forks its workers some seconds after the first
        compile). Named as that check names it, rather than as CRIU's bare error."""
        if not criu_error or not any(k in criu_error for k in DEVICE_FILE_ERRORS):
            return None
        host = self.settings.host
        pids = container_processes(host, ref.init_pid, ref.cgroup_procs)
        cuda = {p.host_pid for p in self._ckpt.group.procs} if self._ckpt.group is not None else set()
        reason = bystanders_reason(host.proc, sorted(pids - cuda))
        if reason is None:
            return None
        return UnsupportedError(f"{reason}; they took them while the checkpoint ran, and CRIU failed on them (CRIU: {criu_error})")

    def after_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata, leave_running: bool) -> list[Step]:
        run = self._ckpt

        def record_dump() -> None:
            # runc checkpoint ran between our last step and this one.
            meta.timings_s["criu_dump"] = round(self.clock() - run.mark, 4)

        def resume() -> None:
            if run.group is not None and run.group.procs:
                run.group.restore_all()
                run.group.unlock_all()

        def finish() -> None:
            group = run.group
            if group is not None:
                for key in ("gpu_lock", "gpu_checkpoint", "gpu_restore", "gpu_unlock"):
                    if key in group.timings:
                        meta.timings_s[key] = round(group.timings[key], 4)
            meta.timings_s["total"] = round(self.clock() - run.started, 4)
            meta.leave_running = leave_running
            if image_dir.is_dir():
                meta.write(image_dir)

        steps = [Step("gpu: record dump time", record_dump)]
        if leave_running:
            steps.append(Step("gpu: restore GPU state and unlock (leave running)", resume))
        steps.append(Step("gpu: write metadata", finish))
        return steps

    # -- restore ---------------------------------------------------------------------------------
    def before_restore(self, image_dir: Path, meta: CheckpointMetadata | None, ref: ContainerRef | None = None) -> list[Step]:
        run = self._rest = _Run()
        if meta is None or not meta.processes:
            return []

        def host_check() -> None:
            run.started = self.clock()
            # Read when the step runs: the restore flow fills ref.annotations from the spec the
            # modifiers have just written.
            targets = assigned_gpus(ref.annotations) if ref is not None else None
            run.remap = check_host(meta, self.backend.status(), self.backend.supports_remap(), targets)
            run.mark = self.clock()

        return [Step("gpu: check this host can take the GPU state", host_check)]

    def after_restore(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata | None) -> list[Step]:
        run = self._rest
        if meta is None or not meta.processes:
            return []
        timings: dict[str, float] = {}

        def map_pids() -> dict[int, int]:
            timings["runc_restore"] = round(self.clock() - run.mark, 4)
            pids = ref.cgroup_procs or container_pids(self.settings.host, ref.init_pid)
            by_ns = host_pid_by_ns_pid(self.settings.host, pids)
            procs: list[GpuProcess] = []
            for p in meta.processes:
                if p.ns_pid not in by_ns:
                    raise RestoreError(f"GPU process {p.ns_pid} ({p.comm}) of the checkpoint is not in the restored container; the image is incomplete")
                procs.append(GpuProcess(host_pid=by_ns[p.ns_pid], ns_pid=p.ns_pid, gpu_memory_bytes=p.gpu_memory_bytes, gpu_uuids=p.gpu_uuids, comm=p.comm, gpu_memory_by_uuid=p.gpu_memory_by_uuid))
            group = GpuGroup(backend=self.backend, procs=procs, clock=self.clock)
            for p in procs:
                state = self.backend.state(p.host_pid)
                if state != ProcessGpuState.CHECKPOINTED:
                    raise RestoreError(f"restored GPU process {p.ns_pid} (host PID {p.host_pid}) is {state.value}, expected checkpointed")
            run.group = group
            return {p.ns_pid: p.host_pid for p in procs}

        def restore() -> None:
            assert run.group is not None
            run.group.restore_all(run.remap)

        def unlock() -> None:
            assert run.group is not None
            run.group.unlock_all()

        def record() -> None:
            assert run.group is not None
            timings.update({k: round(v, 4) for k, v in run.group.timings.items()})
            timings["total"] = round(self.clock() - run.started, 4)
            meta.extra["restore_timings_s"] = timings
            if run.remap:
                meta.extra["restore_gpu_remap"] = dict(run.remap)
            merge_restore_timings(image_dir, {"timings_s": timings, "gpu_remap": run.remap})

        return [
            Step("gpu: map restored processes to host PIDs", map_pids),
            Step("gpu: restore GPU state from host memory", restore),
            Step("gpu: unlock GPU processes", unlock),
            Step("gpu: record restore timings", record),
        ]


class NoDriverPlan(NoGpuPlan):
    """``auto`` on a host without a usable GPU driver: no GPU work, but refuse GPU checkpoints."""

    def __init__(self, why: str, host: HostPaths | None = None) -> None:
        self.why = why
        self.host = host or HostPaths()

    def before_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata) -> list[Step]:
        def refuse_gpu_users() -> None:
            # Without the driver API the GPU state cannot be saved; CRIU would fail later on the
            # open /dev/nvidia* files with a less helpful message.
            pids = ref.cgroup_procs or (container_pids(self.host, ref.init_pid) if ref.init_pid > 0 else [])
            users = [p for p in pids if uses_nvidia_devices(self.host.proc, p)]
            if users:
                raise MissingDependencyError(f"host PID(s) {', '.join(map(str, users))} of the container use an NVIDIA GPU but {self.why}")

        return [Step("gpu: check for GPU processes", refuse_gpu_users)]

    def before_restore(self, image_dir: Path, meta: CheckpointMetadata | None, ref: ContainerRef | None = None) -> list[Step]:
        if meta is None or not meta.processes:
            return []

        def refuse() -> None:
            raise IncompatibleHostError(f"the checkpoint holds GPU state but this host cannot restore it ({self.why}); restore on a GPU host")

        return [Step("gpu: check this host can take the GPU state", refuse)]


def make_backend(settings: Settings) -> GpuBackend:
    spec = settings.gpu_backend
    if spec.startswith("standin:"):
        from gpusnap.gpu.standin import StandinBackend, parse_backend

        return StandinBackend(parse_backend(spec), host=settings.host)
    if spec in ("nvidia", "auto"):
        from gpusnap.gpu.nvidia import NvidiaBackend

        return NvidiaBackend(host=settings.host)
    raise UsageError(f"gpu_backend {spec!r} is not known; use auto, nvidia, none or standin:<dir>")


def make_gpu_plan(settings: Settings) -> GpuPlan:
    """The plan for ``settings.gpu_backend``: ``auto``, ``nvidia``, ``none`` or ``standin:<dir>``."""
    spec = settings.gpu_backend
    if spec == "none":
        return NoGpuPlan()
    backend = make_backend(settings)
    if spec == "auto":
        try:
            backend._driver()  # type: ignore[attr-defined]
        except MissingDependencyError as exc:
            return NoDriverPlan(str(exc), settings.host)
    elif spec == "nvidia":
        backend._driver()  # type: ignore[attr-defined]  # refuse now, with the reason
    return CudaPlan(backend, settings)
