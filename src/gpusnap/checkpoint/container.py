"""What the shim learns about a container from ``runc state`` and its cgroup."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.config import HostPaths
from gpusnap.gpu.base import ContainerRef
from gpusnap.runc.invoke import run_runc

# Global flags that select which containers runc sees; --log/--debug are left out so that the
# shim's own queries add nothing to the engine's runc log.
_STATE_GLOBALS = ("root", "systemd-cgroup", "rootless")
# v1 controllers every runc container joins, in order of preference for listing its processes.
_V1_CONTROLLERS = ("pids", "freezer", "memory", "devices", "cpu", "cpuacct", "blkio", "name=systemd")


@dataclass
class RuncState:
    id: str
    status: str  # created | running | paused | stopped
    pid: int
    bundle: Path
    annotations: dict[str, str] = field(default_factory=dict)


def parse_state(text: str) -> RuncState:
    data = json.loads(text)
    return RuncState(
        id=str(data["id"]),
        status=str(data.get("status", "")),
        pid=int(data.get("pid") or 0),
        bundle=Path(str(data.get("bundle", ""))),
        annotations={str(k): str(v) for k, v in (data.get("annotations") or {}).items()},
    )


def state_globals(global_opts: Mapping[str, str | bool]) -> list[str]:
    args: list[str] = []
    for name in _STATE_GLOBALS:
        if name in global_opts:
            value = global_opts[name]
            args.append(f"--{name}" if value is True else f"--{name}={value}")
    return args


def runc_freezer(runc: str, global_opts: Mapping[str, str | bool], container_id: str, env: Mapping[str, str] | None = None) -> tuple[Callable[[], None], Callable[[], None]]:
    """``runc pause`` and ``runc resume`` of the container, each raising when runc fails.

    Each is a no-op when the container is already as asked (CRIU may thaw a container it dumped
    with --leave-running, or leave it frozen, depending on its version)."""
    from gpusnap.errors import GpusnapError

    def run(verb: str) -> None:
        state = runc_state(runc, global_opts, container_id, env)
        if state is not None and state.status == ("paused" if verb == "pause" else "running"):
            return
        proc = run_runc(runc, [*state_globals(global_opts), verb, container_id], capture=True, env=env)
        if proc.returncode != 0:
            raise GpusnapError(f"runc {verb} {container_id} failed: {(proc.stderr or proc.stdout).strip()[:300]}")

    return (lambda: run("pause")), (lambda: run("resume"))


def runc_state(runc: str, global_opts: Mapping[str, str | bool], container_id: str, env: Mapping[str, str] | None = None) -> RuncState | None:
    """The container's state, or None when runc does not know it (runc then reports that itself)."""
    proc = run_runc(runc, [*state_globals(global_opts), "state", container_id], capture=True, env=env)
    if proc.returncode != 0:
        return None
    try:
        return parse_state(proc.stdout)
    except (ValueError, KeyError, TypeError):
        return None


def _cgroup_dir(pid: int, host: HostPaths) -> Path | None:
    """The directory of ``pid``'s cgroup on this host's hierarchy (v2, else a v1 controller)."""
    try:
        lines = (host.proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    entries: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            entries[parts[1]] = parts[2]
    base = host.sys / "fs" / "cgroup"
    if (base / "cgroup.controllers").exists() and "" in entries:  # pure cgroup v2
        return base / entries[""].lstrip("/")
    for controller in _V1_CONTROLLERS:
        for ctrls, path in entries.items():
            if controller in ctrls.split(","):
                mount = base / (controller.split("=", 1)[-1] if controller.startswith("name=") else ctrls)
                if not mount.is_dir():
                    mount = base / controller
                if mount.is_dir():
                    return mount / path.lstrip("/")
    if "" in entries and (base / "unified").is_dir():  # hybrid: the v2 tree sits under unified/
        return base / "unified" / entries[""].lstrip("/")
    return None


def cgroup_procs(pid: int, host: HostPaths) -> list[int]:
    """Every host PID in ``pid``'s cgroup and the cgroups below it; ``[pid]`` when unknown."""
    if pid <= 0:
        return []
    root = _cgroup_dir(pid, host)
    pids: set[int] = set()
    if root is not None and root.is_dir():
        for procs in [root / "cgroup.procs", *root.rglob("*/cgroup.procs")]:
            try:
                pids.update(int(x) for x in procs.read_text().split())
            except (OSError, ValueError):
                continue
    pids.add(pid)
    return sorted(pids)


def container_ref(state: RuncState, host: HostPaths) -> ContainerRef:
    return ContainerRef(
        container_id=state.id,
        init_pid=state.pid if state.status in ("running", "paused", "created") else 0,
        bundle=state.bundle,
        annotations=dict(state.annotations),
        cgroup_procs=cgroup_procs(state.pid, host) if state.status in ("running", "paused", "created") else [],
    )


def fill_ref(ref: ContainerRef, state: RuncState, host: HostPaths) -> None:
    """Complete a ContainerRef made before restore once runc has restored the container."""
    fresh = container_ref(state, host)
    ref.init_pid = fresh.init_pid
    ref.cgroup_procs = fresh.cgroup_procs
    ref.annotations = fresh.annotations or ref.annotations


def env_with_path(env: Mapping[str, str], first: Sequence[str]) -> dict[str, str]:
    """``env`` with the directories ``first`` at the front of PATH (runc runs `criu` from PATH)."""
    out = dict(env)
    rest = [p for p in out.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin").split(":") if p and p not in first]
    out["PATH"] = ":".join([*first, *rest])
    return out
