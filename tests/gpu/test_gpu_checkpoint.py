"""On a GPU machine: containers started through gpusnap-runtime running a deterministic PyTorch
workload with >= 8 GiB on the GPU are checkpointed and restored, and their GPU values then match
a reference run of the same workload at the same steps, bit for bit."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from gpu_harness import Container, assert_matches, small_tmpfs

from gpusnap.gpu.base import ProcessGpuState
from gpusnap.gpu.nvidia import NvidiaBackend
from gpusnap.gpu.suspend import resume, suspend

GB = 8
GIB = 1 << 30


def gpu_memory_of(pids: list[int]) -> int:
    """Device memory NVML reports for these host PIDs (MiB -> bytes)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True
    ).stdout
    total = 0
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            total += int(parts[1]) << 20
    return total


@pytest.fixture(scope="module")
def backend() -> NvidiaBackend:
    return NvidiaBackend()


def states(c: Container, backend: NvidiaBackend) -> list[ProcessGpuState]:
    return [backend.state(p) for p in c.worker_pids()]


def checkpoint_delete_restore(c: Container, images: Path, backend: NvidiaBackend, refs, report, name: str) -> None:
    nprocs = c.nprocs
    held = gpu_memory_of(c.worker_pids())
    assert held >= nprocs * c.gb * GIB * 0.99, f"the workload holds only {held / GIB:.1f} GiB"
    run = c.checkpoint(images)
    assert run.rc == 0, run.stderr
    meta = json.loads((images / "gpusnap.json").read_text())
    assert meta["gpu_backend"] == "nvidia" and len(meta["processes"]) == nprocs
    assert all(p["gpu_memory_bytes"] >= c.gb * GIB for p in meta["processes"])
    gpu = meta["gpus"][0]
    assert gpu["uuid"].startswith("GPU-") and gpu["name"] and gpu["driver_version"] and gpu["cuda_version"] and gpu["memory_total_bytes"] > 0
    assert {"gpu_lock", "gpu_checkpoint", "criu_dump", "total"} <= set(meta["timings_s"])
    before = [c.last_step(i) for i in range(nprocs)]
    c.delete()
    assert c.state() is None
    rst = c.restore(images)
    assert rst.rc == 0, rst.stderr
    assert states(c, backend) == [ProcessGpuState.RUNNING] * nprocs
    assert gpu_memory_of(c.worker_pids()) >= nprocs * c.gb * GIB * 0.99
    restore_timings = json.loads((images / "gpusnap-restore.json").read_text())["timings_s"]
    ref = refs.get(c.gb)
    compared = 0
    for i in range(nprocs):
        c.wait_step(before[i] + 100)
        compared += assert_matches(c.lines(i), ref, after=before[i])
    report(
        test=name, gib=c.gb * nprocs, procs=nprocs, checkpoint_s=round(run.seconds, 2), restore_s=round(rst.seconds, 2),
        gpu_lock_s=meta["timings_s"]["gpu_lock"], gpu_to_host_s=meta["timings_s"]["gpu_checkpoint"], criu_dump_s=meta["timings_s"]["criu_dump"],
        runc_restore_s=restore_timings.get("runc_restore"), host_to_gpu_s=restore_timings.get("gpu_restore"), steps_compared=compared,
    )


def test_checkpoint_delete_restore_bit_exact(stack, refs, images, containers, backend, report):
    c = Container(stack, gb=GB)
    containers.append(c)
    c.start()
    c.wait_step(100)
    checkpoint_delete_restore(c, images, backend, refs, report, "checkpoint, delete, restore (8 GiB)")


def test_leave_running_bit_exact(stack, refs, images, containers, backend, report):
    c = Container(stack, gb=GB)
    containers.append(c)
    c.start()
    c.wait_step(100)
    run = c.checkpoint(images, leave_running=True)
    assert run.rc == 0, run.stderr
    assert c.state()["status"] == "running" and states(c, backend) == [ProcessGpuState.RUNNING]
    meta = json.loads((images / "gpusnap.json").read_text())
    assert meta["leave_running"] is True and {"gpu_restore", "gpu_unlock"} <= set(meta["timings_s"])
    at = c.last_step()
    c.wait_step(at + 100)
    n = assert_matches(c.lines(), refs.get(GB), after=at)
    report(test="checkpoint --leave-running (8 GiB)", gib=GB, procs=1, checkpoint_s=round(run.seconds, 2), steps_compared=n)


def test_suspend_resume_frees_gpu_memory(stack, refs, containers, backend, report):
    c = Container(stack, gb=GB)
    containers.append(c)
    c.start()
    c.wait_step(100)
    pids = c.worker_pids()
    assert gpu_memory_of(pids) >= GB * GIB * 0.99
    settings = stack.settings()
    t = time.perf_counter()
    rec = suspend(c.id, settings, root=str(c.root))
    suspend_s = time.perf_counter() - t
    assert len(rec.processes) == 1 and rec.gpu_memory_bytes >= GB * GIB
    assert gpu_memory_of(pids) == 0, "a suspended container holds no GPU memory"
    assert states(c, backend) == [ProcessGpuState.CHECKPOINTED]
    assert c.state()["status"] == "running"
    at = c.last_step()
    time.sleep(2)
    assert c.last_step() <= at + 10, "CUDA work waits while suspended"
    t = time.perf_counter()
    resume(c.id, settings, root=str(c.root))
    resume_s = time.perf_counter() - t
    assert states(c, backend) == [ProcessGpuState.RUNNING]
    assert gpu_memory_of(pids) >= GB * GIB * 0.99
    c.wait_step(at + 100)
    n = assert_matches(c.lines(), refs.get(GB), after=at)
    report(test="suspend / resume (8 GiB; 0 MiB while suspended)", gib=GB, procs=1, checkpoint_s=round(suspend_s, 2), restore_s=round(resume_s, 2), steps_compared=n)


def test_two_cuda_processes(stack, refs, images, containers, backend, report):
    c = Container(stack, nprocs=2, gb=GB)
    containers.append(c)
    c.start()
    c.wait_step(100)
    checkpoint_delete_restore(c, images, backend, refs, report, "two CUDA processes (2 x 8 GiB)")


def test_criu_failure_mid_checkpoint_keeps_running(stack, refs, containers, backend, report):
    c = Container(stack, gb=GB)
    containers.append(c)
    c.start()
    c.wait_step(100)
    # The image directory fills up while CRIU writes the process's memory (8 GiB of GPU state
    # now in host memory): CRIU fails mid-dump, after the GPU state was moved out.
    with small_tmpfs(Path("/dev/shm/gs-gpu-full"), "1g") as img:
        run = c.checkpoint(img)
    assert run.rc != 0
    assert "rolled back" in run.stderr, run.stderr
    assert c.state()["status"] == "running"
    assert states(c, backend) == [ProcessGpuState.RUNNING]
    assert gpu_memory_of(c.worker_pids()) >= GB * GIB * 0.99
    at = c.last_step()
    c.wait_step(at + 100)
    n = assert_matches(c.lines(), refs.get(GB), after=at)
    report(test="CRIU failure mid-dump (disk full): rolled back", gib=GB, procs=1, checkpoint_s=round(run.seconds, 2), steps_compared=n)


def test_managed_memory_refused_before_anything_changes(stack, images, containers, backend, report):
    c = Container(stack, gb=0, mode="managed")
    containers.append(c)
    c.start()
    run = c.checkpoint(images)
    assert run.rc == 10, run.stderr  # ExitCode.UNSUPPORTED
    assert "managed" in run.stderr
    assert c.state()["status"] == "running" and states(c, backend) == [ProcessGpuState.RUNNING]
    at = c.last_step()
    c.wait_step(at + 20)
    report(test="managed memory refused (exit 10), still running", gib=0, procs=1, checkpoint_s=round(run.seconds, 2))


def test_injected_gpus_checkpoint_restore(stack, refs, images, containers, backend, report):
    """GPUs given by gpusnap-runtime itself (NVIDIA_VISIBLE_DEVICES=all), not by the bundle."""
    refs.start(1)
    c = Container(stack, gb=1, inject=True)
    containers.append(c)
    c.start()
    spec = json.loads((c.bundle / "config.json").read_text())
    assert any(d["path"].startswith("/dev/nvidia") for d in spec["linux"].get("devices", []))
    c.wait_step(100)
    checkpoint_delete_restore(c, images, backend, refs, report, "GPUs injected by the runtime (1 GiB)")
