"""ContainerRef from runc state and cgroup procs, on fake /proc and /sys trees."""

from __future__ import annotations

from pathlib import Path

from gpusnap.checkpoint.container import RuncState, cgroup_procs, container_ref, parse_state
from gpusnap.config import HostPaths


def _proc(root: Path, pid: int, cgroup: str) -> None:
    d = root / "proc" / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)


def _procs(path: Path, pids: list[int]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))


def test_cgroup_v2(tmp_path: Path) -> None:
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cgroup.controllers").write_text("cpu memory pids\n")
    _proc(tmp_path, 100, "0::/system.slice/libpod-abc.scope/container\n")
    _procs(tmp_path / "sys/fs/cgroup/system.slice/libpod-abc.scope/container", [100, 101])
    _procs(tmp_path / "sys/fs/cgroup/system.slice/libpod-abc.scope/container/sub", [102])
    assert cgroup_procs(100, HostPaths(tmp_path)) == [100, 101, 102]


def test_cgroup_v1_hybrid_prefers_pids(tmp_path: Path) -> None:
    _proc(tmp_path, 200, "9:name=systemd:/ctr\n8:pids:/ctr\n4:memory:/other\n2:cpu,cpuacct:/ctr\n0::/\n")
    _procs(tmp_path / "sys/fs/cgroup/pids/ctr", [200, 201])
    _procs(tmp_path / "sys/fs/cgroup/memory/other", [999])
    (tmp_path / "sys/fs/cgroup/unified").mkdir(parents=True)
    assert cgroup_procs(200, HostPaths(tmp_path)) == [200, 201]


def test_cgroup_v1_combined_controller_mount(tmp_path: Path) -> None:
    _proc(tmp_path, 300, "2:cpu,cpuacct:/ctr\n")
    _procs(tmp_path / "sys/fs/cgroup/cpu,cpuacct/ctr", [300, 301])
    assert cgroup_procs(300, HostPaths(tmp_path)) == [300, 301]


def test_unknown_process_is_just_itself(tmp_path: Path) -> None:
    assert cgroup_procs(400, HostPaths(tmp_path)) == [400]
    assert cgroup_procs(0, HostPaths(tmp_path)) == []


def test_parse_state_and_ref(tmp_path: Path) -> None:
    state = parse_state('{"ociVersion":"1.0.2","id":"c1","pid":0,"status":"stopped","bundle":"/b","rootfs":"/b/rootfs","created":"x","annotations":{"k":"v"},"owner":""}')
    assert state == RuncState(id="c1", status="stopped", pid=0, bundle=Path("/b"), annotations={"k": "v"})
    ref = container_ref(state, HostPaths(tmp_path))
    assert ref.init_pid == 0 and ref.cgroup_procs == [] and ref.annotations == {"k": "v"}
