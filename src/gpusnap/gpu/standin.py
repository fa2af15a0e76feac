"""A scripted stand-in for the CUDA driver's checkpoint API, for CI machines without a GPU.

Selected with ``gpu_backend = "standin:<dir>"``. It enforces the driver's per-process state
machine exactly as the real driver answers it (seen on driver 580):

    RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING

and any other call is ``CUDA_ERROR_ILLEGAL_STATE``; a lock that times out leaves the process
RUNNING; a checkpoint refused as not supported leaves it LOCKED.

Because the runtime shim, the CLI and the tests are separate processes, and CRIU gives restored
processes new host PIDs, the state lives in files under ``<dir>`` keyed by a token that the
"CUDA process" carries in its environment (``GPUSNAP_STANDIN_CUDA=<token>``), which
``/proc/PID/environ`` shows and CRIU restores with the process. Files under ``<dir>``:

- ``procs/<token>.json``: ``{"state": ..., "gpu": uuid}`` (written by the stand-in);
- ``calls.log``: one line per call, ``<call> <token> <host-pid> <result>`` (for tests);
- ``gpus.json`` (optional): the fake GPUs, a list of objects with ``uuid``, ``name``,
  ``memory_total_bytes``, ``memory_free_bytes``, ``mig_enabled``, ``driver_version``,
  ``cuda_version``; and ``remap`` (bool, default true) in ``driver.json``;
- ``faults.json`` (optional): injected failures, a list of ``{"call": "lock"|"checkpoint"|
  "restore"|"unlock", "token": "<token>"|"*", "error": "failed"|"timeout"|"not_supported"|"delay:<seconds>",
  "times": N}``; each match consumes one of ``times`` (default 1).

Other environment markers of a stand-in CUDA process: ``GPUSNAP_STANDIN_GPU_MB`` (device memory
held while RUNNING or LOCKED, default 64), ``GPUSNAP_STANDIN_GPU`` (UUID of its GPU, default the
first), ``GPUSNAP_STANDIN_MANAGED=1`` (it uses managed memory: refused like the real driver).
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.config import HostPaths
from gpusnap.errors import UnsupportedError, UsageError
from gpusnap.gpu.base import GpuCallError, GpuLockTimeout, GpuStatus, ProcessGone, ProcessGpuState
from gpusnap.gpu.procs import environ, exited, gpu_process
from gpusnap.gpu.unsupported import mps_reason, mig_env_reason
from gpusnap.metadata import GpuInfo, GpuProcess

TOKEN_ENV = "GPUSNAP_STANDIN_CUDA"
MEM_ENV = "GPUSNAP_STANDIN_GPU_MB"
GPU_ENV = "GPUSNAP_STANDIN_GPU"
MANAGED_ENV = "GPUSNAP_STANDIN_MANAGED"

DEFAULT_GPU = {
    "uuid": "GPU-00000000-0000-0000-0000-5354414e4431",
    "name": "gpusnap stand-in GPU",
    "memory_total_bytes": 80 << 30,
    "memory_free_bytes": 80 << 30,
    "mig_enabled": False,
    "driver_version": "580.159.04",
    "cuda_version": "13.0",
}

# Legal transitions: call -> (state required, state after).
_TRANSITIONS = {
    "lock": (ProcessGpuState.RUNNING, ProcessGpuState.LOCKED),
    "checkpoint": (ProcessGpuState.LOCKED, ProcessGpuState.CHECKPOINTED),
    "restore": (ProcessGpuState.CHECKPOINTED, ProcessGpuState.LOCKED),
    "unlock": (ProcessGpuState.LOCKED, ProcessGpuState.RUNNING),
}


def parse_backend(spec: str) -> Path:
    _, _, d = spec.partition(":")
    if not d:
        raise UsageError(f"gpu_backend {spec!r}: the stand-in needs a state directory, e.g. standin:/tmp/gpu-standin")
    return Path(d)


def frozen(host: HostPaths, pid: int) -> bool:
    """Whether ``pid`` sits in a frozen cgroup (v2 ``cgroup.events``, v1 ``freezer.state``)."""
    try:
        lines = (host.proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            for base in ("", "unified"):  # the unified hierarchy: alone, or beside v1 (hybrid)
                try:
                    if "frozen 1" in (host.sys / "fs" / "cgroup" / base / rel / "cgroup.events").read_text().splitlines():
                        return True
                except OSError:
                    pass
        elif "freezer" in controllers.split(","):
            try:
                if (host.sys / "fs" / "cgroup" / "freezer" / rel / "freezer.state").read_text().strip() != "THAWED":
                    return True
            except OSError:
                pass
    return False


@dataclass
class StandinBackend:
    state_dir: Path
    host: HostPaths = field(default_factory=HostPaths)
    name: str = "standin"

    def __post_init__(self) -> None:
        (self.state_dir / "procs").mkdir(parents=True, exist_ok=True)

    # -- files ---------------------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.state_dir / ".lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _read_json(self, name: str, default: Any) -> Any:
        path = self.state_dir / name
        if not path.is_file():
            return default
        return json.loads(path.read_text())

    def _write_json(self, name: str, data: Any) -> None:
        path = self.state_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)

    def _log(self, call: str, token: str, pid: int, result: str) -> None:
        with open(self.state_dir / "calls.log", "a") as fh:
            fh.write(f"{call} {token} {pid} {result}\n")

    def _gpus(self) -> list[dict[str, Any]]:
        return [dict(DEFAULT_GPU, **g) for g in self._read_json("gpus.json", [DEFAULT_GPU])]

    def _token(self, call: str, pid: int) -> str:
        token = environ(self.host.proc, pid).get(TOKEN_ENV)
        if token:
            return token
        # A process that ended (or ended and is not reaped yet: a zombie has no environment)
        # is gone, as the real backend reports it, not a process that never used CUDA.
        if exited(self.host.proc, pid):
            raise ProcessGone(call, pid, "CUDA_ERROR_INVALID_VALUE (the process no longer exists)")
        raise GpuCallError(call, pid, "CUDA_ERROR_NOT_INITIALIZED")

    def _proc_record(self, token: str, pid: int) -> dict[str, Any]:
        rec = self._read_json(f"procs/{token}.json", None)
        if rec is None:
            gpu = environ(self.host.proc, pid).get(GPU_ENV) or self._gpus()[0]["uuid"]
            rec = {"state": ProcessGpuState.RUNNING.value, "gpu": gpu}
        elif rec.get("imaged_gpu") and rec.get("pid") not in (None, pid):
            # Another process with this token after a checkpoint: a CRIU copy of the image taken
            # while CHECKPOINTED. As with the real driver it starts CHECKPOINTED on the imaged GPU,
            # whatever the original did since (a --leave-running checkpoint resumes it).
            rec = {"state": ProcessGpuState.CHECKPOINTED.value, "gpu": rec["imaged_gpu"], "imaged_gpu": rec["imaged_gpu"]}
        return rec

    def _take_fault(self, call: str, token: str) -> str | None:
        faults = self._read_json("faults.json", [])
        for f in faults:
            if f.get("call") == call and f.get("token", "*") in ("*", token) and f.get("times", 1) > 0:
                f["times"] = f.get("times", 1) - 1
                self._write_json("faults.json", faults)
                return str(f.get("error", "failed"))
        return None

    # -- the state machine -----------------------------------------------------------------------
    def _transition(self, call: str, pid: int, timeout_ms: int = 0, gpu: str | None = None) -> None:
        with self._locked():
            token = self._token(call, pid)
            rec = self._proc_record(token, pid)
            state = ProcessGpuState(rec["state"])
            need, after = _TRANSITIONS[call]
            if frozen(self.host, pid):
                # The real driver's calls are answered by the process itself: with the process
                # frozen (an engine paused its container) they wait for ever. Fail instead.
                self._log(call, token, pid, "FROZEN")
                raise GpuCallError(call, pid, "the process is frozen (cgroup freezer): the CUDA driver would wait for it for ever")
            if state != need:
                self._log(call, token, pid, f"ILLEGAL_STATE({state.value})")
                raise GpuCallError(call, pid, f"CUDA_ERROR_ILLEGAL_STATE (process is {state.value.upper()})")
            fault = self._take_fault(call, token)
            if fault is None and call == "checkpoint" and environ(self.host.proc, pid).get(MANAGED_ENV) == "1":
                fault = "not_supported"
            if fault is not None and fault.startswith("delay:"):
                # A slow driver call (fault-injection tests kill the runtime while it waits).
                self._log(call, token, pid, f"INJECTED({fault})")
                time.sleep(float(fault.split(":", 1)[1]))
                fault = None
            if fault is not None:
                self._log(call, token, pid, f"INJECTED({fault})")
                if fault == "timeout":
                    time.sleep(min(timeout_ms, 2000) / 1000)  # the real lock waits out its timeout
                    raise GpuLockTimeout(call, pid, "CUDA_ERROR_TIMEOUT", "the process kept the GPU busy past the lock timeout")
                if fault == "not_supported":
                    raise UnsupportedError(
                        f"the CUDA driver cannot {call} host PID {pid} (CUDA_ERROR_NOT_SUPPORTED): it uses a feature "
                        "the checkpoint API does not cover (managed memory, MPS, IPC); nothing was changed"
                    )
                raise GpuCallError(call, pid, "CUDA_ERROR_UNKNOWN (injected)")
            rec["state"] = after.value
            rec["pid"] = pid
            if gpu is not None:
                rec["gpu"] = gpu
            if call == "checkpoint":
                rec["imaged_gpu"] = rec["gpu"]
            self._write_json(f"procs/{token}.json", rec)
            self._log(call, token, pid, "OK")

    def available(self) -> bool:
        return True

    def state(self, host_pid: int) -> ProcessGpuState:
        with self._locked():
            token = self._token("get-state", host_pid)
            if frozen(self.host, host_pid):  # the real driver asks the process, which never answers
                self._log("get-state", token, host_pid, "FROZEN")
                raise GpuCallError("get-state", host_pid, "the process is frozen (cgroup freezer): the CUDA driver would wait for it for ever")
            return ProcessGpuState(self._proc_record(token, host_pid)["state"])

    def lock(self, host_pid: int, timeout_ms: int) -> None:
        self._transition("lock", host_pid, timeout_ms=timeout_ms)

    def checkpoint(self, host_pid: int) -> None:
        self._transition("checkpoint", host_pid)

    def restore(self, host_pid: int, uuid_remap: dict[str, str] | None = None) -> None:
        new_gpu = None
        if uuid_remap:
            if not self.supports_remap():
                raise UnsupportedError("restoring onto other GPUs needs driver >= 580 (CUDA 13)")
            with self._locked():
                old = self._proc_record(self._token("restore", host_pid), host_pid)["gpu"]
            if old not in uuid_remap:
                # The real driver wants every checkpointed GPU in the pair list.
                raise GpuCallError("restore", host_pid, f"CUDA_ERROR_INVALID_VALUE (GPU {old} missing from the remap pairs)")
            new_gpu = uuid_remap[old]
        self._transition("restore", host_pid, gpu=new_gpu)

    def unlock(self, host_pid: int) -> None:
        self._transition("unlock", host_pid)

    def supports_remap(self) -> bool:
        return bool(self._read_json("driver.json", {}).get("remap", True))

    # -- discovery -----------------------------------------------------------------------------
    def status(self) -> list[GpuStatus]:
        out = []
        for i, g in enumerate(self._gpus()):
            info = GpuInfo(
                index=i,
                uuid=g["uuid"],
                name=g["name"],
                memory_total_bytes=int(g["memory_total_bytes"]),
                driver_version=g["driver_version"],
                cuda_version=g["cuda_version"],
                vendor="standin",
            )
            out.append(GpuStatus(info=info, memory_free_bytes=int(g["memory_free_bytes"]), mig_enabled=bool(g["mig_enabled"])))
        return out

    def describe(self) -> list[GpuInfo]:
        return [s.info for s in self.status()]

    def process_memory(self, host_pid: int) -> dict[str, int]:
        env = environ(self.host.proc, host_pid)
        token = env.get(TOKEN_ENV)
        if not token:
            return {}
        with self._locked():
            rec = self._proc_record(token, host_pid)
        if rec["state"] == ProcessGpuState.CHECKPOINTED.value:
            return {}  # like the real driver: checkpointed state holds no device memory
        return {rec["gpu"]: int(env.get(MEM_ENV, "64")) << 20}

    def find_processes(self, host_pids: list[int]) -> list[GpuProcess]:
        return [gpu_process(self.host.proc, pid, self.process_memory(pid)) for pid in host_pids if environ(self.host.proc, pid).get(TOKEN_ENV)]

    def unsupported_reason(self, host_pid: int) -> str | None:
        if environ(self.host.proc, host_pid).get(MANAGED_ENV) == "1":
            return f"host PID {host_pid} uses CUDA managed (unified) memory, which the CUDA checkpoint API cannot save; allocate with cudaMalloc instead"
        reason = mps_reason(self.host, host_pid) or mig_env_reason(self.host.proc, host_pid)
        if reason:
            return reason
        used = self.process_memory(host_pid)
        for s in self.status():
            if s.mig_enabled and s.info.uuid in used:
                return f"GPU {s.info.uuid} has MIG mode on; the CUDA checkpoint API cannot save MIG instances; use a GPU with MIG off"
        return None
