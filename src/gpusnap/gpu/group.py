"""All GPU processes of one container, moved together so the cut is consistent.

Every operation acts on the whole group and, if it fails part-way, takes back what it did to the
processes it had already handled before raising, so callers see all-or-nothing. The undo
operations are idempotent and state-aware (they ask the driver first), so rollback after a
partial failure, a signal or a process that exited never makes things worse.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpusnap.config import HostPaths
from gpusnap.errors import CheckpointError, GpusnapError, RollbackError, UnsupportedError
from gpusnap.gpu.base import GpuBackend, ProcessGone, ProcessGpuState
from gpusnap.gpu.compat import pairs_for
from gpusnap.gpu.procs import container_pids
from gpusnap.gpu.unsupported import bystanders_reason
from gpusnap.metadata import GpuInfo, GpuProcess


def container_processes(host: HostPaths, init_pid: int, pids: list[int] | None) -> set[int]:
    """Every host PID of the container: the cgroup's processes (``pids``, what the shim saw) and
    its PID namespace's (from ``init_pid``). A process that left the cgroup, or one the cgroup
    listing missed, is still part of the cut."""
    found = set(pids or [])
    if init_pid > 0:
        found.update(container_pids(host, init_pid))
    return found


@dataclass
class GpuGroup:
    backend: GpuBackend
    procs: list[GpuProcess] = field(default_factory=list)
    clock: Callable[[], float] = time.perf_counter
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def pids(self) -> list[int]:
        return [p.host_pid for p in self.procs]

    # -- discovery -----------------------------------------------------------------------------
    @classmethod
    def of_container(
        cls, backend: GpuBackend, host: HostPaths, init_pid: int, pids: list[int] | None = None, *, expect: ProcessGpuState = ProcessGpuState.RUNNING,
        refuse_bystanders: bool = False,
    ) -> "GpuGroup":
        """Find the GPU processes among the container's PIDs; refuse unsupported ones up front.
        With ``refuse_bystanders`` (a checkpoint, which CRIU follows) also refuse the container
        when one of its other processes holds NVIDIA device files."""
        found = container_processes(host, init_pid, pids)
        procs = backend.find_processes(sorted(found))
        for p in procs:
            reason = backend.unsupported_reason(p.host_pid)
            if reason:
                raise UnsupportedError(f"{reason}; nothing was changed")
            state = backend.state(p.host_pid)
            if state != expect:
                hint = "run `gpusnap resume` first" if state == ProcessGpuState.CHECKPOINTED else "wait for the other checkpoint to end"
                raise CheckpointError(f"GPU process {p.ns_pid} (host PID {p.host_pid}) is {state.value}, expected {expect.value}; {hint}")
        if refuse_bystanders:
            cuda = {p.host_pid for p in procs}
            reason = bystanders_reason(host.proc, sorted(found - cuda))
            if reason:
                raise UnsupportedError(f"{reason}; nothing was changed")
        return cls(backend=backend, procs=procs)

    def gpus(self) -> list[GpuInfo]:
        """The host GPUs these processes use (all of them when the backend cannot tell)."""
        used = {u for p in self.procs for u in p.gpu_uuids}
        gpus = self.backend.describe()
        return [g for g in gpus if g.uuid in used] if used else gpus

    # -- forward operations with partial rollback ------------------------------------------------
    def _each(self, name: str, op: Callable[[int], None], back: Callable[[int], None] | None) -> None:
        done: list[int] = []
        start = self.clock()
        try:
            for pid in self.pids:
                op(pid)
                done.append(pid)
        except BaseException as exc:  # noqa: BLE001 - signals too: leave nothing half-done
            if back is not None:
                errors = _try_all(back, list(reversed(done)))
                if errors:
                    raise RollbackError(f"{exc} — and taking back {name} failed: {'; '.join(errors)}") from exc
            raise
        self.timings[name] = self.timings.get(name, 0.0) + self.clock() - start

    def lock_all(self, timeout_ms: int) -> None:
        self._each("gpu_lock", lambda pid: self.backend.lock(pid, timeout_ms), self.backend.unlock)

    def checkpoint_all(self) -> None:
        self._each("gpu_checkpoint", self.backend.checkpoint, lambda pid: self.backend.restore(pid))

    def restore_all(self, remap: dict[str, str] | None = None) -> None:
        """Restore every process; with ``remap`` (old -> new GPU UUID, every checkpointed GPU),
        each process gets the pairs of the GPUs it was checkpointed on."""
        used = {p.host_pid: p.gpu_uuids for p in self.procs}
        self._each("gpu_restore", lambda pid: self.backend.restore(pid, pairs_for(remap or {}, used.get(pid, []))), self.backend.checkpoint)

    def unlock_all(self) -> None:
        self._each("gpu_unlock", self.backend.unlock, None)

    # -- state-aware undo (idempotent) -------------------------------------------------------------
    def _settle(self, want: ProcessGpuState, moves: dict[ProcessGpuState, Callable[[int], None]]) -> None:
        def one(pid: int) -> None:
            for _ in range(3):
                state = self.backend.state(pid)
                if state == want or state not in moves:
                    return
                moves[state](pid)

        errors = _try_all(one, self.pids)
        if errors:
            raise RollbackError("GPU state could not be put back: " + "; ".join(errors))

    def ensure_running(self) -> None:
        """Whatever each process's state, bring it back to RUNNING (restore, then unlock)."""
        self._settle(
            ProcessGpuState.RUNNING,
            {ProcessGpuState.CHECKPOINTED: lambda pid: self.backend.restore(pid), ProcessGpuState.LOCKED: self.backend.unlock},
        )

    def ensure_not_checkpointed(self) -> None:
        self._settle(ProcessGpuState.LOCKED, {ProcessGpuState.CHECKPOINTED: lambda pid: self.backend.restore(pid)})

    def ensure_checkpointed(self) -> None:
        self._settle(
            ProcessGpuState.CHECKPOINTED,
            {ProcessGpuState.RUNNING: lambda pid: self.backend.lock(pid, 10_000), ProcessGpuState.LOCKED: self.backend.checkpoint},
        )


def _try_all(fn: Callable[[int], None], pids: list[int]) -> list[str]:
    """Run ``fn`` on every PID, collecting failures; a process that is gone needs nothing."""
    errors: list[str] = []
    for pid in pids:
        try:
            fn(pid)
        except ProcessGone:
            continue
        except GpusnapError as exc:
            errors.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - report, keep going with the other processes
            errors.append(f"host PID {pid}: {exc}")
    return errors
