"""Detecting managed memory, MPS, MIG and device files held outside CUDA from /proc (a fake /proc
tree shaped like the real one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpusnap.config import HostPaths, Settings
from gpusnap.errors import ExitCode, UnsupportedError
from gpusnap.gpu.base import ContainerRef
from gpusnap.gpu.group import GpuGroup
from gpusnap.gpu.plan import CudaPlan
from gpusnap.metadata import CheckpointMetadata
from gpusnap.gpu.procs import container_pids, host_pid_by_ns_pid
from gpusnap.gpu.standin import MEM_ENV, TOKEN_ENV, StandinBackend
from gpusnap.gpu.unsupported import bystanders_reason, managed_memory_reason, mig_env_reason, mps_reason, nvidia_holdings

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


# -- processes that hold NVIDIA device files without a CUDA context -------------------------------
# What the lent H200 showed for a PyTorch DataLoader worker forked after CUDA started: the
# parent's device files (nvidiactl, nvidiaN, nvidia-uvm, nvidia-caps) and its shared mappings of
# them, inherited; the driver knows no CUDA context of the worker.
FORKED_MAPS = """\
00400000-00401000 r--p 00000000 fd:01 4242 /usr/bin/python3.12
200600000-200800000 rw-s 00000000 00:21 14 /dev/nvidia0
7f1000000000-7f1000200000 rw-s 00000000 00:05 1029 /dev/nvidiactl
7f4000000000-7f4000010000 rw-p 00000000 00:00 0 
7f5000000000-7f5000001000 r--s 00000000 00:05 77 /dev/shm/torch_1 (deleted)
"""


def bystander(root: Path, pid: int, targets: list[str], maps: str, name: str = "python3") -> None:
    d = root / "proc" / str(pid)
    (d / "fd").mkdir(parents=True)
    for i, target in enumerate(targets):
        os.symlink(target, d / "fd" / str(3 + i))
    (d / "maps").write_text(maps)
    (d / "environ").write_bytes(b"PATH=/usr/bin")
    (d / "comm").write_text(name + "\n")


def test_holdings_count_files_once_and_mappings(tmp_path):
    bystander(tmp_path, 200, ["/dev/nvidia0", "/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-caps/nvidia-cap1", "/dev/null", "pipe:[5]"], FORKED_MAPS)
    assert nvidia_holdings(tmp_path / "proc", 200) == (["/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia0", "/dev/nvidiactl"], 2)
    assert nvidia_holdings(tmp_path / "proc", 999) == ([], 0)  # gone: nothing held


def test_no_bystanders_no_reason(tmp_path):
    bystander(tmp_path, 200, ["/dev/null", "socket:[9]"], "00400000-00401000 r--p 00000000 fd:01 4242 /usr/bin/python3.12\n")
    assert bystanders_reason(tmp_path / "proc", [200]) is None
    assert bystanders_reason(tmp_path / "proc", []) is None


def test_a_forked_worker_is_named_with_what_it_holds_and_what_to_do(tmp_path):
    bystander(tmp_path, 201, ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-caps/nvidia-cap2"], FORKED_MAPS, "pt_data_worker")
    reason = bystanders_reason(tmp_path / "proc", [201])
    assert reason is not None and "\n" not in reason
    assert reason.startswith("host PID 201 (pt_data_worker) of the container holds NVIDIA device files (")
    assert "/dev/nvidia-caps/nvidia-cap2, /dev/nvidia-uvm, /dev/nvidia0, ...; 2 device mappings)" in reason
    assert "forked" in reason and 'multiprocessing_context="spawn"' in reason and "nvidia-smi" in reason


def test_several_holders_are_counted_and_mappings_alone_count(tmp_path):
    bystander(tmp_path, 300, [], FORKED_MAPS)  # its files closed, its mappings still there
    bystander(tmp_path, 301, ["/dev/nvidiactl"], "")  # an NVML-only tool
    bystander(tmp_path, 302, [], "")
    reason = bystanders_reason(tmp_path / "proc", [302, 301, 300])
    assert reason is not None
    assert reason.startswith("host PID 300 (python3) and 1 other process of the container hold NVIDIA device files (/dev/nvidiactl; 2 device mappings)")
    only_maps = bystanders_reason(tmp_path / "proc", [300])
    assert only_maps is not None and "device files (2 device mappings)" in only_maps


def test_checkpoint_group_refuses_bystanders_before_any_call(tmp_path):
    """The GPU step of a checkpoint: a CUDA process and a forked worker; refused before the
    stand-in driver sees a call. A suspend (no CRIU) takes the same container."""
    host = fake_proc(tmp_path, 100, PLAIN_MAPS, env={TOKEN_ENV: "tok-100", MEM_ENV: "64"})
    bystander(tmp_path, 101, ["/dev/nvidia0", "/dev/nvidiactl"], FORKED_MAPS)
    bystander(tmp_path, 102, ["/dev/null"], "")
    backend = StandinBackend(tmp_path / "standin", host=host)
    with pytest.raises(UnsupportedError) as err:
        GpuGroup.of_container(backend, host, 0, [100, 101, 102], refuse_bystanders=True)
    assert err.value.exit_code == ExitCode.UNSUPPORTED
    assert "host PID 101 (python3) of the container holds" in str(err.value) and str(err.value).endswith("; nothing was changed")
    assert not (tmp_path / "standin" / "calls.log").exists() or not (tmp_path / "standin" / "calls.log").read_text().strip()
    group = GpuGroup.of_container(backend, host, 0, [100, 101, 102])
    assert [p.host_pid for p in group.procs] == [100]


def test_torch_compile_workers_get_their_own_way_out(tmp_path):
    """A compiled server that left inductor's pool running (seen on the H200: 16 of its 17
    processes held the driver's files): the message says how to stop that pool; a DataLoader
    worker beside it still gets the spawn advice."""
    worker = b"/opt/venv/bin/python3\0/opt/venv/lib/python3.12/site-packages/torch/_inductor/compile_worker/__main__.py\0--workers=16\0"
    for pid in (400, 401):
        bystander(tmp_path, pid, ["/dev/nvidiactl", "/dev/nvidia0"], FORKED_MAPS)
        (tmp_path / "proc" / str(pid) / "cmdline").write_bytes(worker)
    only = bystanders_reason(tmp_path / "proc", [400, 401])
    assert only is not None and "\n" not in only
    assert "2 of them are torch.compile's compile workers" in only and "shutdown_compile_workers()" in only and "TORCHINDUCTOR_COMPILE_THREADS=1" in only
    assert "DataLoader" not in only and only.endswith("; then checkpoint again")
    bystander(tmp_path, 402, ["/dev/nvidia0"], "")
    (tmp_path / "proc" / "402" / "cmdline").write_bytes(b"python3\0train.py\0")
    both = bystanders_reason(tmp_path / "proc", [400, 401, 402])
    assert both is not None and "2 of them are torch.compile's compile workers" in both and 'multiprocessing_context="spawn"' in both


def test_a_dump_that_failed_on_device_files_names_who_took_them(tmp_path):
    """CRIU failed on a device mapping: the processes other than the checkpointed CUDA ones
    that hold NVIDIA files now are named (a pool that forked after the check before the GPU
    steps); any other CRIU error, or nobody holding such files, leaves runc's own error."""
    host = fake_proc(tmp_path, 100, PLAIN_MAPS, env={TOKEN_ENV: "tok-100", MEM_ENV: "64"})
    bystander(tmp_path, 102, ["/dev/null"], "")
    plan = CudaPlan(StandinBackend(tmp_path / "standin", host=host), Settings(host=host))
    ref = ContainerRef(container_id="c1", init_pid=0, bundle=tmp_path, cgroup_procs=[100, 101, 102])
    find = plan.before_dump(ref, tmp_path, CheckpointMetadata(container_id="c1", created=""))[0]
    assert find.name == "gpu: find GPU processes" and find.do() == 1  # nobody else holds any yet
    vma = "handle_device_vma plugin failed: No such file or directory"
    assert plan.dump_failure(ref, vma) is None  # the CUDA process's own files do not count
    bystander(tmp_path, 101, ["/dev/nvidiactl"], FORKED_MAPS)
    err = plan.dump_failure(ref, vma)
    assert isinstance(err, UnsupportedError) and err.exit_code == ExitCode.UNSUPPORTED
    assert str(err).startswith("host PID 101 (python3) of the container holds NVIDIA device files (/dev/nvidiactl; 2 device mappings)")
    assert str(err).endswith(f"they took them while the checkpoint ran, and CRIU failed on them (CRIU: {vma})")
    assert plan.dump_failure(ref, "Can't dump file 36 of that type [20666] (chr 195:255)") is not None
    assert plan.dump_failure(ref, "Connection refused") is None and plan.dump_failure(ref, None) is None
