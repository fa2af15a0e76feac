"""Detecting managed memory, MPS and MIG from /proc (a fake /proc tree shaped like the real one)."""

from __future__ import annotations

import os
from pathlib import Path

from gpusnap.config import HostPaths
from gpusnap.gpu.procs import container_pids, host_pid_by_ns_pid
from gpusnap.gpu.unsupported import managed_memory_reason, mig_env_reason, mps_reason

PLAIN_MAPS = """\
7f0000000000-7f0000200000 rw-s 00000000 00:05 1034 /dev/nvidia-uvm
7f1000000000-7f1000200000 rw-s 00000000 00:05 1029 /dev/nvidiactl
7f2000000000-7f2000001000 r--p 00000000 fd:01 4242 /usr/lib/libcuda.so.1
"""
MANAGED_MAPS = PLAIN_MAPS + "7f3000000000-7f3004000000 rw-s 00000000 00:05 1034 /dev/nvidia-uvm\n"


def fake_proc(root: Path, pid: int, maps: str, gpus: int = 1, env: dict[str, str] | None = None) -> HostPaths:
    d = root / "proc" / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "maps").write_text(maps)
    for i in range(gpus):
        os.symlink(f"/dev/nvidia{i}", d / "fd" / str(10 + i))
    os.symlink("/dev/nvidiactl", d / "fd" / "3")
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in (env or {}).items()))
    (d / "comm").write_text("python3\n")
    return HostPaths(root)


def test_plain_cuda_process_is_fine(tmp_path):
    host = fake_proc(tmp_path, 100, PLAIN_MAPS)
    assert managed_memory_reason(host.proc, 100) is None


def test_managed_memory_seen_in_maps(tmp_path):
    host = fake_proc(tmp_path, 100, MANAGED_MAPS)
    assert "managed" in managed_memory_reason(host.proc, 100)


def test_two_gpus_two_uvm_mappings_is_not_managed(tmp_path):
    host = fake_proc(tmp_path, 100, MANAGED_MAPS, gpus=2)
    assert managed_memory_reason(host.proc, 100) is None


def test_mig_from_environment(tmp_path):
    host = fake_proc(tmp_path, 100, PLAIN_MAPS, env={"NVIDIA_VISIBLE_DEVICES": "MIG-GPU-1/1/0"})
    assert "MIG" in mig_env_reason(host.proc, 100)


def test_mps_needs_a_daemon_and_a_visible_pipe(tmp_path):
    host = fake_proc(tmp_path, 100, PLAIN_MAPS)
    os.symlink(tmp_path / "ctr-root", tmp_path / "proc" / "100" / "root")
    (tmp_path / "ctr-root" / "tmp" / "nvidia-mps").mkdir(parents=True)
    (tmp_path / "ctr-root" / "tmp" / "nvidia-mps" / "control").touch()
    assert mps_reason(host, 100) is None  # no daemon on the host
    (tmp_path / "proc" / "7").mkdir()
    (tmp_path / "proc" / "7" / "comm").write_text("nvidia-cuda-mps\n")
    assert "MPS" in mps_reason(host, 100)


def test_container_pids_follow_the_pid_namespace(fake):
    init = fake.start_container(n_cuda=2)
    pids = container_pids(HostPaths(), init)
    assert len(pids) == 4 and init in pids
    by_ns = host_pid_by_ns_pid(HostPaths(), pids)
    assert sorted(by_ns) == [1, 2, 3, 4] and by_ns[1] == init
