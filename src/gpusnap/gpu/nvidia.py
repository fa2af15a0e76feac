"""The NVIDIA backend: the CUDA driver's checkpoint API through NVIDIA's ``cuda-bindings``.

``cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock,GetState}`` act on another process by PID
(CUDA >= 12.8, driver >= 570); restore onto GPUs with other UUIDs needs CUDA 13 / driver >= 580.
GPU identities and per-process memory come from NVML (``nvidia-ml-py``). Both packages are the
optional ``nvidia`` extra, imported only here, so CPU-only installs stay small.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from gpusnap.config import HostPaths
from gpusnap.errors import MissingDependencyError, UnsupportedError
from gpusnap.gpu.base import GpuCallError, GpuLockTimeout, GpuStatus, ProcessGone, ProcessGpuState
from gpusnap.gpu.unsupported import process_reason
from gpusnap.metadata import GpuInfo

MIN_CUDA_API = 12080  # cuCheckpoint* appeared in CUDA 12.8 (driver 570)
MIN_CUDA_API_REMAP = 13000  # GPU UUID pairs in the restore arguments: CUDA 13.0 (driver 580)

_STATES = {
    0: ProcessGpuState.RUNNING,
    1: ProcessGpuState.LOCKED,
    2: ProcessGpuState.CHECKPOINTED,
    3: ProcessGpuState.FAILED,
}


def _cuda_version_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def uuid_bytes(uuid: str) -> bytes:
    """``GPU-b44ed0df-bdc9-...`` (NVML's form) -> the 16 raw bytes of a CUuuid."""
    hexpart = uuid.removeprefix("GPU-").replace("-", "")
    if len(hexpart) != 32:
        raise ValueError(f"not a GPU UUID: {uuid!r}")
    return bytes.fromhex(hexpart)


@dataclass
class NvidiaBackend:
    host: HostPaths = field(default_factory=HostPaths)
    name: str = "nvidia"
    _drv: Any = field(default=None, init=False, repr=False)
    _nvml: Any = field(default=None, init=False, repr=False)
    _api: int = field(default=0, init=False, repr=False)

    # -- loading -------------------------------------------------------------------------------
    def _driver(self) -> Any:
        if self._drv is not None:
            return self._drv
        try:
            from cuda.bindings import driver
        except ImportError:
            raise MissingDependencyError(
                "the NVIDIA backend needs NVIDIA's cuda-bindings; install gpusnap[nvidia] (pip install 'gpusnap[nvidia]')"
            ) from None
        if not hasattr(driver, "cuCheckpointProcessLock"):
            raise MissingDependencyError(
                "installed cuda-bindings has no checkpoint API (cuCheckpointProcess*); upgrade to cuda-bindings >= 12.8"
            )
        try:
            (err,) = driver.cuInit(0)
            err2, version = driver.cuDriverGetVersion()
        except Exception as exc:  # the bindings raise when libcuda.so.1 cannot be loaded
            raise MissingDependencyError(f"cannot load the NVIDIA driver library libcuda.so.1 ({exc}); install the NVIDIA driver") from None
        if err != driver.CUresult.CUDA_SUCCESS:
            raise MissingDependencyError(f"the NVIDIA driver did not initialise (cuInit: {err.name}); check the driver and /dev/nvidia*")
        if version < MIN_CUDA_API:
            raise MissingDependencyError(
                f"the NVIDIA driver supports CUDA {_cuda_version_text(version)}, which has no checkpoint API; "
                "install driver >= 570 (CUDA >= 12.8)"
            )
        self._api = version
        self._drv = driver
        return driver

    def _nvml_lib(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        try:
            import pynvml
        except ImportError:
            raise MissingDependencyError("the NVIDIA backend needs nvidia-ml-py (NVML); install gpusnap[nvidia]") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise MissingDependencyError(f"NVML did not initialise ({exc}); check the NVIDIA driver") from None
        self._nvml = pynvml
        return pynvml

    def available(self) -> bool:
        try:
            self._driver()
            return True
        except MissingDependencyError:
            return False

    # -- calls ---------------------------------------------------------------------------------
    def _check(self, call: str, pid: int, result: tuple[Any, ...]) -> tuple[Any, ...]:
        drv = self._drv
        err = result[0]
        if err == drv.CUresult.CUDA_SUCCESS:
            return result
        name = getattr(err, "name", str(err))
        from gpusnap.gpu.procs import exited

        if exited(self.host.proc, pid):
            raise ProcessGone(call, pid, f"{name} (the process no longer exists)")
        if err == drv.CUresult.CUDA_ERROR_TIMEOUT:
            raise GpuLockTimeout(call, pid, name, "the process kept the GPU busy past the lock timeout; retry or raise lock_timeout_ms")
        if err == drv.CUresult.CUDA_ERROR_NOT_SUPPORTED:
            raise UnsupportedError(
                f"the CUDA driver cannot {call} host PID {pid} (CUDA_ERROR_NOT_SUPPORTED): it uses a feature "
                "the checkpoint API does not cover (managed memory, MPS, IPC); nothing was changed"
            )
        raise GpuCallError(call, pid, name)

    def state(self, host_pid: int) -> ProcessGpuState:
        drv = self._driver()
        res = drv.cuCheckpointProcessGetState(host_pid)
        self._check("get-state", host_pid, res)
        return _STATES.get(int(getattr(res[1], "value", res[1])), ProcessGpuState.FAILED)

    def _is_cuda(self, host_pid: int) -> bool:
        # Processes without a CUDA context answer CUDA_ERROR_NOT_INITIALIZED (seen on driver 580).
        drv = self._driver()
        return drv.cuCheckpointProcessGetState(host_pid)[0] == drv.CUresult.CUDA_SUCCESS

    def lock(self, host_pid: int, timeout_ms: int) -> None:
        drv = self._driver()
        args = drv.CUcheckpointLockArgs()
        args.timeoutMs = max(0, int(timeout_ms))
        self._check("lock", host_pid, drv.cuCheckpointProcessLock(host_pid, args))

    def checkpoint(self, host_pid: int) -> None:
        drv = self._driver()
        self._check("checkpoint", host_pid, drv.cuCheckpointProcessCheckpoint(host_pid, None))

    def restore(self, host_pid: int, uuid_remap: dict[str, str] | None = None) -> None:
        drv = self._driver()
        args = drv.CUcheckpointRestoreArgs()
        if uuid_remap:
            if not self.supports_remap():
                raise UnsupportedError(
                    f"restoring onto other GPUs needs driver >= 580 (CUDA 13); this driver is CUDA {_cuda_version_text(self._api)}"
                )
            pairs = []
            for old, new in uuid_remap.items():
                pair = drv.CUcheckpointGpuPair()
                pair.oldUuid = self._cuuuid(old)
                pair.newUuid = self._cuuuid(new)
                pairs.append(pair)
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
        self._check("restore", host_pid, drv.cuCheckpointProcessRestore(host_pid, args))

    def _cuuuid(self, uuid: str) -> Any:
        # CUuuid's bytes are read-only in cuda-bindings; it is built over a 16-byte buffer and
        # copied by value when assigned into the pair, so the buffer may go away afterwards.
        buf = ctypes.create_string_buffer(uuid_bytes(uuid), 16)
        return self._drv.CUuuid(ctypes.addressof(buf))

    def unlock(self, host_pid: int) -> None:
        drv = self._driver()
        self._check("unlock", host_pid, drv.cuCheckpointProcessUnlock(host_pid, None))

    def supports_remap(self) -> bool:
        self._driver()
        return self._api >= MIN_CUDA_API_REMAP

    # -- discovery -----------------------------------------------------------------------------
    def status(self) -> list[GpuStatus]:
        nv = self._nvml_lib()
        self._driver()
        driver_version = nv.nvmlSystemGetDriverVersion()
        cuda = _cuda_version_text(self._api)
        out: list[GpuStatus] = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            try:
                mig = bool(nv.nvmlDeviceGetMigMode(h)[0])
            except nv.NVMLError:  # GPUs without MIG support answer NOT_SUPPORTED
                mig = False
            info = GpuInfo(
                index=i,
                uuid=nv.nvmlDeviceGetUUID(h),
                name=nv.nvmlDeviceGetName(h),
                memory_total_bytes=int(mem.total),
                driver_version=driver_version,
                cuda_version=cuda,
            )
            out.append(GpuStatus(info=info, memory_free_bytes=int(mem.free), mig_enabled=mig))
        return out

    def describe(self) -> list[GpuInfo]:
        return [s.info for s in self.status()]

    def _memory_by_pid(self) -> dict[int, dict[str, int]]:
        nv = self._nvml_lib()
        out: dict[int, dict[str, int]] = {}
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid = nv.nvmlDeviceGetUUID(h)
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                used = p.usedGpuMemory or 0
                out.setdefault(int(p.pid), {})[uuid] = out.get(int(p.pid), {}).get(uuid, 0) + int(used)
        return out

    def process_memory(self, host_pid: int) -> dict[str, int]:
        return self._memory_by_pid().get(host_pid, {})

    def find_processes(self, host_pids: list[int]) -> list[Any]:
        from gpusnap.gpu.procs import gpu_process

        mem = self._memory_by_pid()
        return [gpu_process(self.host.proc, pid, mem.get(pid, {})) for pid in host_pids if self._is_cuda(pid)]

    def unsupported_reason(self, host_pid: int) -> str | None:
        reason = process_reason(self.host, host_pid)
        if reason:
            return reason
        used = self.process_memory(host_pid)
        for s in self.status():
            if s.mig_enabled and (s.info.uuid in used or not used):
                return f"GPU {s.info.uuid} has MIG mode on; the CUDA checkpoint API cannot save MIG instances; use a GPU with MIG off"
        return None
