"""Facts about this host, and whether it can take a given checkpoint.

Restore reads the checkpoint's metadata first and refuses, before anything changes, when this
host differs in a way CRIU or the GPU driver cannot bridge: another CPU architecture, fewer or
other GPUs, another driver branch, CRIU missing or too old, an older kernel.
"""

from __future__ import annotations

import platform
import re
import shutil
import socket
import subprocess
from collections import Counter
from dataclasses import dataclass, field

from gpusnap.config import Settings
from gpusnap.criu.locate import MIN_VERSION, probe_criu
from gpusnap.errors import IncompatibleHostError, MissingDependencyError, UsageError
from gpusnap.gpu.base import GpuStatus
from gpusnap.metadata import CheckpointMetadata, GpuInfo

@dataclass
class HostFacts:
    arch: str
    kernel: str
    hostname: str
    criu_path: str | None
    criu_version: str  # "" when CRIU is missing or does not run
    gpus: list[GpuInfo] = field(default_factory=list)
    driver_version: str = ""
    # From the GPU backend (gpusnap.gpu): what restore's GPU step will see. None when the
    # backend cannot be used here; gpu_reason then says why.
    gpu_status: list[GpuStatus] | None = None
    supports_remap: bool = False
    gpu_reason: str = ""


def version_tuple(text: str) -> tuple[int, ...]:
    nums = re.findall(r"\d+", text.split("-")[0])
    return tuple(int(n) for n in nums[:3])


def host_gpus() -> tuple[list[GpuInfo], str]:
    """NVIDIA GPUs of this host and the driver version, through nvidia-smi when present.

    nvidia-smi is used because it ships with every driver install, while NVML's Python
    bindings are an optional extra; a host without it has no usable NVIDIA GPU here.
    """
    smi = shutil.which("nvidia-smi")
    if not smi:
        return [], ""
    try:
        proc = subprocess.run(
            [smi, "--query-gpu=index,uuid,name,memory.total,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=60, check=False,
        )
    except OSError:
        return [], ""
    if proc.returncode != 0:
        return [], ""
    gpus: list[GpuInfo] = []
    driver = ""
    for line in proc.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        driver = parts[4]
        mem = int(float(parts[3])) * 1024 * 1024 if parts[3].replace(".", "").isdigit() else 0
        gpus.append(GpuInfo(index=int(parts[0]), uuid=parts[1], name=parts[2], memory_total_bytes=mem, driver_version=driver))
    return gpus, driver


def backend_gpus(settings: Settings) -> tuple[list[GpuStatus] | None, bool, str]:
    """The GPUs as the configured GPU backend sees them (the stand-in in CPU CI), or why not."""
    if settings.gpu_backend == "none":
        return None, False, "gpu_backend is none"
    from gpusnap.gpu.plan import make_backend

    try:
        backend = make_backend(settings)
        return backend.status(), backend.supports_remap(), ""
    except (MissingDependencyError, UsageError) as exc:
        return None, False, str(exc)


def gather(settings: Settings, *, with_gpus: bool = True) -> HostFacts:
    path, version = probe_criu(settings)
    facts = HostFacts(
        arch=platform.machine(),
        kernel=platform.release(),
        hostname=socket.gethostname(),
        criu_path=path,
        criu_version=version,
    )
    if not with_gpus:
        return facts
    status, remap, reason = backend_gpus(settings)
    if status is not None:
        facts.gpu_status, facts.supports_remap = status, remap
        facts.gpus = [s.info for s in status]
        facts.driver_version = status[0].info.driver_version if status else ""
    else:
        # The backend cannot run (no driver, or no cuda-bindings/NVML installed): nvidia-smi
        # still names the GPUs so the message can say what this host has.
        facts.gpus, facts.driver_version = host_gpus()
        facts.gpu_reason = reason
    return facts


def problems(meta: CheckpointMetadata, facts: HostFacts) -> list[str]:
    """Every reason this host cannot take the checkpoint, each a clause saying what differs."""
    out: list[str] = []
    if meta.arch and meta.arch != facts.arch:
        out.append(f"it was taken on {meta.arch} and this host is {facts.arch}")
    if meta.kernel and facts.kernel and version_tuple(facts.kernel)[:2] < version_tuple(meta.kernel)[:2]:
        out.append(f"it was taken on kernel {meta.kernel} and this host runs the older {facts.kernel}")
    if meta.gpus:
        want = Counter(g.name for g in meta.gpus)
        have = Counter(g.name for g in facts.gpus)
        if not facts.gpus:
            out.append(f"it needs {_gpu_list(want)} and this host has no NVIDIA GPU")
        elif any(have[name] < n for name, n in want.items()):
            out.append(f"it needs {_gpu_list(want)} and this host has {_gpu_list(have)}")
        want_driver = max((g.driver_version for g in meta.gpus if g.driver_version), key=version_tuple, default="")
        if want_driver and facts.driver_version and version_tuple(facts.driver_version) < version_tuple(want_driver):
            out.append(f"it was taken with NVIDIA driver {want_driver} and this host has the older {facts.driver_version}")
    if meta.processes and facts.gpus and facts.gpu_status is None and not out:
        out.append(f"it holds GPU state and this host's GPU driver cannot restore it ({facts.gpu_reason})")
    return out


def _gpu_list(counts: Counter[str]) -> str:
    return ", ".join(f"{n}x {name}" for name, n in sorted(counts.items()))


def require_compatible(meta: CheckpointMetadata | None, facts: HostFacts, *, what: str) -> None:
    """Raise before anything changes when this host cannot restore ``what``."""
    if not facts.criu_path:
        raise MissingDependencyError("CRIU not found on PATH; install CRIU >= 4.0 (tests/host/provision.sh does) or set GPUSNAP_CRIU")
    if not facts.criu_version or version_tuple(facts.criu_version)[:2] < MIN_VERSION:
        raise MissingDependencyError(
            f"CRIU at {facts.criu_path} is {facts.criu_version or 'not working'}; gpusnap needs CRIU >= 4.0 (see `gpusnap doctor`)"
        )
    if meta is None:
        return
    found = problems(meta, facts)
    if found:
        raise IncompatibleHostError(f"this host cannot restore {what}: {'; '.join(found)}; restore it on a matching host")
    if meta.processes and facts.gpu_status is not None:
        # The GPU side's own check (free memory per GPU, MIG, UUID remap), the one the runtime
        # repeats at restore: asked here too so the refusal comes before any pull or unpack.
        from gpusnap.gpu.compat import check_host

        check_host(meta, facts.gpu_status, facts.supports_remap)
