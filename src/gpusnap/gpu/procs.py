"""Reading a container's processes from /proc: which host PIDs belong to it, and their PIDs inside it.

Only the standard library: the runtime shim and the driver stand-in both use this.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpusnap.config import HostPaths
from gpusnap.errors import NotFoundError
from gpusnap.metadata import GpuProcess


def _pid_dirs(proc: Path) -> list[int]:
    return sorted(int(p.name) for p in proc.iterdir() if p.name.isdigit())


def pid_namespace(proc: Path, pid: int) -> str | None:
    try:
        return os.readlink(proc / str(pid) / "ns" / "pid")
    except OSError:
        return None


def ns_pid(proc: Path, pid: int) -> int | None:
    """The PID of host ``pid`` in its innermost PID namespace (last field of ``NSpid:``)."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def environ(proc: Path, pid: int) -> dict[str, str]:
    """The process's environment as it was at exec (CRIU restores it with the process)."""
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def exited(proc: Path, pid: int) -> bool:
    """Whether ``pid`` is gone, or has exited and waits to be reaped (a zombie: no memory, no
    environment, no GPU context left). A call that fails on such a process failed because it
    ended, not because of the call."""
    d = proc / str(pid)
    try:
        stat = (d / "stat").read_text()
    except OSError:
        return not d.is_dir()
    # The state follows the comm, which may itself hold spaces and parentheses.
    return stat.rpartition(")")[2].split()[:1] in (["Z"], ["X"])


def comm(proc: Path, pid: int) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def gpu_process(proc: Path, pid: int, used: dict[str, int]) -> GpuProcess:
    """The metadata record of a GPU process, given its device memory per GPU UUID."""
    return GpuProcess(
        host_pid=pid,
        ns_pid=ns_pid(proc, pid) or pid,
        gpu_memory_bytes=sum(used.values()),
        gpu_uuids=sorted(used),
        comm=comm(proc, pid),
        gpu_memory_by_uuid=dict(sorted(used.items())),
    )


def _cgroup_procs(host: HostPaths, pid: int) -> list[int]:
    """Every PID in ``pid``'s cgroup (v2 unified path, else the v1 ``pids``/``memory`` controller)."""
    try:
        lines = (host.proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return []
    candidates: list[Path] = []
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if hier == "0" and controllers == "":
            candidates.append(host.sys / "fs" / "cgroup" / rel)
            candidates.append(host.sys / "fs" / "cgroup" / "unified" / rel)
        for ctl in ("pids", "memory"):
            if ctl in controllers.split(","):
                candidates.append(host.sys / "fs" / "cgroup" / ctl / rel)
    for cg in candidates:
        procs = cg / "cgroup.procs"
        if procs.is_file():
            try:
                return sorted(int(x) for x in procs.read_text().split())
            except (OSError, ValueError):
                continue
    return []


def container_pids(host: HostPaths, init_pid: int) -> list[int]:
    """Every host PID of the container whose init is ``init_pid``.

    A container normally has its own PID namespace: then its processes are exactly those in that
    namespace (including children that moved to another cgroup). When it shares the host's
    namespace, fall back to the init's cgroup.
    """
    proc = host.proc
    if not (proc / str(init_pid)).is_dir():
        raise NotFoundError(f"container init PID {init_pid} does not exist; is the container running?")
    ns = pid_namespace(proc, init_pid)
    own = pid_namespace(proc, os.getpid()) if host.root == Path("/") else pid_namespace(proc, 1)
    if ns is not None and ns != own:
        return [p for p in _pid_dirs(proc) if pid_namespace(proc, p) == ns]
    pids = _cgroup_procs(host, init_pid)
    return pids or [init_pid]


def host_pid_by_ns_pid(host: HostPaths, pids: list[int]) -> dict[int, int]:
    """ns PID -> host PID for the given host PIDs of one container."""
    out: dict[int, int] = {}
    for pid in pids:
        n = ns_pid(host.proc, pid)
        if n is not None:
            out[n] = pid
    return out
