"""Detecting GPU workloads the CUDA checkpoint API cannot take, from /proc, before anything changes.

What is detected and how (each seen on the lent H200, driver 580.159.04):

- CUDA managed (unified) memory: ``cuCheckpointProcessCheckpoint`` answers
  ``CUDA_ERROR_NOT_SUPPORTED`` for such a process. Before that, ``/proc/PID/maps`` shows it: a
  plain CUDA process maps ``/dev/nvidia-uvm`` once (2 MiB); every managed allocation adds a
  mapping of ``/dev/nvidia-uvm`` of its size. More than one such mapping per GPU opened
  (``/dev/nvidiaN`` among its fds) means managed memory.
- MPS: a client reaches the MPS daemon through the pipe directory (``CUDA_MPS_PIPE_DIRECTORY``,
  default ``/tmp/nvidia-mps``). If an MPS daemon runs on the host and the process can see its
  ``control`` socket through its own root, its GPU work goes through MPS.
- Device files held outside CUDA: a process the driver knows no CUDA context of, but which has
  NVIDIA device files open or mapped (a child forked after CUDA started, an NVML-only tool).
- MIG: the process is pointed at a MIG instance (``MIG-`` in ``CUDA_VISIBLE_DEVICES`` or
  ``NVIDIA_VISIBLE_DEVICES``); the backend also refuses GPUs whose MIG mode is on (NVML).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpusnap.config import HostPaths
from gpusnap.gpu.procs import _pid_dirs, comm, environ

UVM_DEVICE = "/dev/nvidia-uvm"
NVIDIA_DEVICES = "/dev/nvidia"  # every node the driver makes: nvidiactl, nvidiaN, nvidia-uvm, nvidia-caps/...
_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")
MPS_COMMS = ("nvidia-cuda-mps",)  # comm is cut at 15 characters: control and server both match


def uvm_mappings(proc: Path, pid: int) -> int:
    try:
        text = (proc / str(pid) / "maps").read_text()
    except OSError:
        return 0
    return sum(1 for line in text.splitlines() if line.rstrip().endswith(" " + UVM_DEVICE))


def open_files(proc: Path, pid: int) -> list[str]:
    """What the process's file descriptors point at (``/proc/PID/fd`` links); empty when gone."""
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return []
    out = []
    for name in names:
        try:
            out.append(os.readlink(fd_dir / name))
        except OSError:
            continue  # closed meanwhile
    return out


def open_gpu_nodes(proc: Path, pid: int) -> set[str]:
    return {t for t in open_files(proc, pid) if _GPU_NODE.match(t)}


def nvidia_holdings(proc: Path, pid: int) -> tuple[list[str], int]:
    """The NVIDIA device files ``pid`` has open (each name once, sorted) and how many of its
    memory mappings are of one."""
    files = {t for t in open_files(proc, pid) if t.startswith(NVIDIA_DEVICES)}
    try:
        maps = (proc / str(pid) / "maps").read_text()
    except OSError:
        maps = ""
    # A maps line is "range perms offset dev inode path"; the path is the sixth field.
    mapped = sum(1 for line in maps.splitlines() if (f := line.split(None, 5)) and len(f) == 6 and f[5].startswith(NVIDIA_DEVICES))
    return sorted(files), mapped


def uses_nvidia_devices(proc: Path, pid: int) -> bool:
    """True when the process has an NVIDIA device node open (a CUDA process, whatever its state)."""
    return any(t.startswith(NVIDIA_DEVICES) for t in open_files(proc, pid))


def bystanders_reason(proc: Path, pids: list[int]) -> str | None:
    """Why processes that are not CUDA processes (``pids``, as the driver told) stop a
    checkpoint: any of them holding NVIDIA device files, open or mapped, or None.

    The checkpoint API releases a CUDA process's device files; a process without a CUDA
    context keeps its own, and CRIU can save neither a device file nor a mapping of one (seen on
    the lent H200: a PyTorch DataLoader worker forked after CUDA started holds 38 of them and 33
    mappings, and CRIU fails with "Can't handle non-regular mapping"; so do the 16 processes of
    torch.compile's compile-worker pool left running in a compiled server). Refused up front
    instead of after the GPU state has been moved out and back."""
    held = {pid: h for pid in pids if (h := nvidia_holdings(proc, pid))[0] or h[1]}
    if not held:
        return None
    first = min(held)
    files = sorted({f for fs, _ in held.values() for f in fs})
    mapped = sum(m for _, m in held.values())
    others = len(held) - 1
    who = f"host PID {first} ({comm(proc, first)})"
    if others:
        who += f" and {others} other process{'es' if others > 1 else ''} of the container hold"
    else:
        who += " of the container holds"
    what = [", ".join(files[:3]) + (", ..." if len(files) > 3 else "")] if files else []
    if mapped:
        what.append(f"{mapped} device mapping{'s' if mapped > 1 else ''}")
    inductor = [pid for pid in held if _is_inductor_worker(proc, pid)]
    ways = []
    if inductor:
        ways.append(
            f"{len(inductor)} of them are torch.compile's compile workers (inductor's pool, which reads the GPU's properties "
            "and then forks): stop them once warm (torch._inductor.async_compile.shutdown_compile_workers()) or compile "
            "in-process (TORCHINDUCTOR_COMPILE_THREADS=1)"
        )
    if len(inductor) < len(held):
        ways.append(
            "a process forked from a CUDA process after CUDA started (a PyTorch DataLoader worker) inherits them: start such "
            "workers with spawn or forkserver (DataLoader(multiprocessing_context=\"spawn\")); end processes that only use "
            "NVML (nvidia-smi)"
        )
    return (
        f"{who} NVIDIA device files ({'; '.join(what)}) but no CUDA context the driver can checkpoint, and CRIU cannot save "
        f"them: {'; '.join(ways)}; then checkpoint again"
    )


def _is_inductor_worker(proc: Path, pid: int) -> bool:
    # PyTorch's compile worker runs torch/_inductor/compile_worker (by path or with -m) and forks
    # its pool from there, so its workers show the same command line.
    try:
        cmd = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    return b"_inductor/compile_worker" in cmd or b"_inductor.compile_worker" in cmd


def managed_memory_reason(proc: Path, pid: int) -> str | None:
    maps = uvm_mappings(proc, pid)
    gpus = max(1, len(open_gpu_nodes(proc, pid)))
    if maps > gpus:
        return (
            f"host PID {pid} uses CUDA managed (unified) memory ({maps} mappings of {UVM_DEVICE}), "
            "which the CUDA checkpoint API cannot save; allocate with cudaMalloc instead"
        )
    return None


def mps_daemon_running(proc: Path) -> bool:
    return any(comm(proc, p).startswith(MPS_COMMS) for p in _pid_dirs(proc))


def mps_reason(host: HostPaths, pid: int) -> str | None:
    if not mps_daemon_running(host.proc):
        return None
    pipe_dir = environ(host.proc, pid).get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    # The value is the container's: normalised so ".." cannot walk above its root (through
    # /proc/PID/root a ".." would reach the host's directories).
    control = host.proc / str(pid) / "root" / os.path.normpath("/" + pipe_dir).lstrip("/") / "control"
    if os.path.exists(control):
        return (
            f"host PID {pid} runs its GPU work through MPS (daemon on this host, pipe {pipe_dir}), "
            "which the CUDA checkpoint API cannot save; run the container without MPS"
        )
    return None


def mig_env_reason(proc: Path, pid: int) -> str | None:
    env = environ(proc, pid)
    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        if "MIG-" in env.get(var, ""):
            return (
                f"host PID {pid} runs on a MIG instance ({var}={env[var]}), "
                "which the CUDA checkpoint API cannot save; use a whole GPU"
            )
    return None


def process_reason(host: HostPaths, pid: int) -> str | None:
    """The first reason found that ``pid``'s GPU state cannot be checkpointed, or None."""
    return managed_memory_reason(host.proc, pid) or mps_reason(host, pid) or mig_env_reason(host.proc, pid)
