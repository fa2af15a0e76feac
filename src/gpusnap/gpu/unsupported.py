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
_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")
MPS_COMMS = ("nvidia-cuda-mps",)  # comm is cut at 15 characters: control and server both match


def uvm_mappings(proc: Path, pid: int) -> int:
    try:
        text = (proc / str(pid) / "maps").read_text()
    except OSError:
        return 0
    return sum(1 for line in text.splitlines() if line.rstrip().endswith(" " + UVM_DEVICE))


def open_gpu_nodes(proc: Path, pid: int) -> set[str]:
    fd_dir = proc / str(pid) / "fd"
    out: set[str] = set()
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if _GPU_NODE.match(target):
            out.add(target)
    return out


def uses_nvidia_devices(proc: Path, pid: int) -> bool:
    """True when the process has an NVIDIA device node open (a CUDA process, whatever its state)."""
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(fd_dir / name).startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


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
