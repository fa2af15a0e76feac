"""On a GPU machine: containers started through gpusnap-runtime running a deterministic PyTorch
workload with >= 8 GiB on the GPU are checkpointed and restored, and their GPU values then match
a reference run of the same workload at the same steps, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from gpu_harness import MULTI_GPU_GB, Container, assert_matches, host_gpus, small_tmpfs

from gpusnap.gpu.base import ProcessGpuState
from gpusnap.gpu.nvidia import NvidiaBackend
from gpusnap.gpu.suspend import resume, suspend
from gpusnap.gpu.unsupported import nvidia_holdings

GB = 8
GIB = 1 << 30


def gpu_memory_by_gpu(pids: list[int]) -> dict[str, int]:
    """GPU UUID -> device memory NVML (nvidia-smi) reports for these host PIDs on it (bytes)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True
    ).stdout
    by_gpu: dict[str, int] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) in pids and parts[2].isdigit():
            by_gpu[parts[1]] = by_gpu.get(parts[1], 0) + (int(parts[2]) << 20)
    return by_gpu


def gpu_memory_of(pids: list[int]) -> int:
    """Device memory NVML reports for these host PIDs, all GPUs together (bytes)."""
    return sum(gpu_memory_by_gpu(pids).values())


def criu_log_tail(path: Path, lines: int = 15) -> str:
    """The end of CRIU's log (runc writes it into the image directory), for a failure message."""
    try:
        return "\nCRIU log " + str(path) + ":\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


two_gpus = pytest.mark.skipif(len(host_gpus()) < 2, reason="needs a machine with at least 2 GPUs")


@pytest.fixture(scope="module")
def backend() -> NvidiaBackend:
    return NvidiaBackend()


def states(c: Container, backend: NvidiaBackend) -> list[ProcessGpuState]:
    return [backend.state(p) for p in c.worker_pids()]


def checkpoint_delete_restore(
    c: Container, images: Path, backend: NvidiaBackend, refs, report, name: str, *, between: Callable[[], None] | None = None
) -> tuple[dict, dict]:
    """Checkpoint, delete, (``between``), restore, then compare with the reference run; returns
    gpusnap.json and gpusnap-restore.json."""
    nprocs = c.nprocs
    held = gpu_memory_of(c.worker_pids())
    assert held >= nprocs * c.gpus * c.gb * GIB * 0.99, f"the workload holds only {held / GIB:.1f} GiB"
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
    if between is not None:
        between()
    rst = c.restore(images)
    assert rst.rc == 0, rst.stderr + criu_log_tail(images / "restore.log")
    assert states(c, backend) == [ProcessGpuState.RUNNING] * nprocs
    assert gpu_memory_of(c.worker_pids()) >= nprocs * c.gpus * c.gb * GIB * 0.99
    restored = json.loads((images / "gpusnap-restore.json").read_text())
    restore_timings = restored["timings_s"]
    ref = refs.get(c.gb, c.gpus)
    compared = 0
    for i in range(nprocs):
        c.wait_step(before[i] + 100)
        compared += assert_matches(c.lines(i), ref, after=before[i])
    report(
        test=name, gib=c.gb * nprocs * c.gpus, procs=nprocs, checkpoint_s=round(run.seconds, 2), restore_s=round(rst.seconds, 2),
        gpu_lock_s=meta["timings_s"]["gpu_lock"], gpu_to_host_s=meta["timings_s"]["gpu_checkpoint"], criu_dump_s=meta["timings_s"]["criu_dump"],
        runc_restore_s=restore_timings.get("runc_restore"), host_to_gpu_s=restore_timings.get("gpu_restore"), steps_compared=compared,
    )
    return meta, restored


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


@two_gpus
def test_two_gpu_container_bit_exact(stack, refs, images, containers, backend, report):
    """NVIDIA_VISIBLE_DEVICES=all on a 2-GPU host: one worker with a tensor on each GPU."""
    refs.start(MULTI_GPU_GB, 2)
    c = Container(stack, gb=MULTI_GPU_GB, inject=True, gpus=2)
    containers.append(c)
    c.start()
    assert len(c.gpu_nodes()) == len(host_gpus()), c.gpu_nodes()  # every GPU injected
    c.wait_step(100)
    held = gpu_memory_by_gpu(c.worker_pids())
    used = sorted(u for u, n in held.items() if n >= MULTI_GPU_GB * GIB * 0.99)
    assert len(used) == 2, f"the worker should hold {MULTI_GPU_GB} GiB on each of 2 GPUs: {held}"
    meta, restored = checkpoint_delete_restore(c, images, backend, refs, report, f"two GPUs in one container ({MULTI_GPU_GB} GiB on each)")
    assert sorted(g["uuid"] for g in meta["gpus"]) == used
    (proc,) = meta["processes"]
    assert sorted(proc["gpu_uuids"]) == used
    assert set(proc["gpu_memory_by_uuid"]) == set(used) and all(n >= MULTI_GPU_GB * GIB for n in proc["gpu_memory_by_uuid"].values()), proc
    assert restored["gpu_remap"] == {}, "restored onto the same two GPUs"
    after = gpu_memory_by_gpu(c.worker_pids())
    assert all(after.get(u, 0) >= MULTI_GPU_GB * GIB * 0.99 for u in used), after


@two_gpus
def test_restore_onto_another_gpu(stack, refs, images, containers, backend, report):
    """Checkpointed with only GPU 0 (NVIDIA_VISIBLE_DEVICES=0), restored with only GPU 1: the
    GPU state lands on GPU 1 (UUID pairs to the driver), the container has GPU 1's node and not
    GPU 0's, and the values go on bit for bit."""
    (i0, u0), (i1, u1) = sorted(host_gpus())[:2]
    c = Container(stack, gb=GB, inject=True, visible=str(i0))
    containers.append(c)
    c.start()
    (old_node,) = c.gpu_nodes()
    c.wait_step(100)
    assert set(gpu_memory_by_gpu(c.worker_pids())) == {u0}
    meta, restored = checkpoint_delete_restore(
        c, images, backend, refs, report, f"restore onto another GPU (GPU {i0} -> GPU {i1}, {GB} GiB)", between=lambda: c.select_gpus(str(i1))
    )
    assert [g["uuid"] for g in meta["gpus"]] == [u0]
    assert restored["gpu_remap"] == {u0: u1}
    pids = c.worker_pids()
    on = gpu_memory_by_gpu(pids)
    assert set(on) == {u1} and on[u1] >= GB * GIB * 0.99, f"the restored process should hold its memory on {u1} only: {on}"
    (new_node,) = c.gpu_nodes()
    assert new_node != old_node
    root = f"/proc/{pids[0]}/root"
    assert os.path.exists(root + new_node) and not os.path.exists(root + old_node), os.listdir(root + "/dev")
    assert os.stat(root + new_node).st_rdev == os.stat(new_node).st_rdev


def nvidia_files(pid: int) -> tuple[list[str], int]:
    """The NVIDIA device files a process has open, and how many of its mappings are of one."""
    return nvidia_holdings(Path("/proc"), pid)


def test_dataloader_workers_forked_after_cuda_refused_before_anything_changes(stack, refs, images, containers, backend, report):
    """A training loop as PyTorch users write it (tests/gpu_worker.py, mode loader): DataLoader
    workers forked after CUDA started hold the driver's device files, open and mapped, but no
    CUDA context, which CRIU cannot save. Refused (exit 10) before the GPU state moves; the loop
    goes on bit for bit."""
    gb = 2
    refs.start(gb, mode="loader")
    c = Container(stack, gb=gb, mode="loader")
    containers.append(c)
    c.start()
    c.wait_step(100)
    pids = c.worker_pids()
    cuda = [p.host_pid for p in backend.find_processes(pids)]
    forked = {p: nvidia_files(p) for p in pids if p not in cuda}
    assert len(cuda) == 1 and len(forked) >= 2, f"one CUDA process and its loader workers expected: {pids}, CUDA {cuda}"
    assert all(files or maps for files, maps in forked.values()), f"the forked workers hold no NVIDIA files: {forked}"
    run = c.checkpoint(images)
    assert run.rc == 10, run.stderr  # ExitCode.UNSUPPORTED
    assert "NVIDIA device files" in run.stderr and "spawn" in run.stderr and "nothing was changed" in run.stderr, run.stderr
    assert c.state()["status"] == "running" and [backend.state(p) for p in cuda] == [ProcessGpuState.RUNNING]
    assert c.worker_pids() == pids
    at = c.last_step()
    c.wait_step(at + 100)
    assert not [line for line in c.out() if line.startswith("FAIL")], c.out()[-5:]
    n = assert_matches(c.lines(), refs.get(gb, mode="loader"), after=at)
    report(test="DataLoader workers forked after CUDA: refused (exit 10), still running", gib=gb, procs=len(pids), checkpoint_s=round(run.seconds, 2),
           steps_compared=n, loader_worker_nvidia_files=sum(len(f) for f, _ in forked.values()), loader_worker_nvidia_maps=sum(m for _, m in forked.values()))


def test_dataloader_workers_spawned_bit_exact(stack, refs, images, containers, backend, report):
    """The same training loop with its DataLoader workers started by spawn (what the refusal
    above advises): workers, pinned batches in flight, the CUDA graph, the side stream and the
    helper thread are checkpointed, deleted and restored, and the loop goes on bit for bit."""
    gb = 2
    refs.start(gb, mode="loader")
    c = Container(stack, gb=gb, mode="loader", env={"LOADER_START": "spawn"})
    containers.append(c)
    c.start()
    c.wait_step(100)
    everyone = c.host_pids()
    cuda = [p.host_pid for p in backend.find_processes(everyone)]
    others = [p for p in everyone if p not in cuda]
    assert len(cuda) == 1 and len(others) >= 3, f"the shell, the loader's workers and its resource tracker expected: {everyone}, CUDA {cuda}"
    assert not any(any(nvidia_files(p)) for p in others), {p: nvidia_files(p) for p in others}
    run = c.checkpoint(images)
    assert run.rc == 0, run.stderr + criu_log_tail(images / "dump.log")
    meta = json.loads((images / "gpusnap.json").read_text())
    assert len(meta["processes"]) == 1 and meta["processes"][0]["gpu_memory_bytes"] >= gb * GIB, meta["processes"]
    before = c.last_step()
    c.delete()
    rst = c.restore(images)
    assert rst.rc == 0, rst.stderr + criu_log_tail(images / "restore.log")
    after = c.host_pids()
    assert len(after) == len(everyone), f"restored {after}, checkpointed {everyone}"
    assert [backend.state(p.host_pid) for p in backend.find_processes(after)] == [ProcessGpuState.RUNNING]
    c.wait_step(before + 100)
    assert not [line for line in c.out() if line.startswith("FAIL")], c.out()[-5:]
    n = assert_matches(c.lines(), refs.get(gb, mode="loader"), after=before)
    report(test="DataLoader workers spawned, pinned batches, CUDA graph, helper thread (2 GiB)", gib=gb, procs=len(everyone),
           checkpoint_s=round(run.seconds, 2), restore_s=round(rst.seconds, 2), steps_compared=n,
           gpu_lock_s=meta["timings_s"]["gpu_lock"], gpu_to_host_s=meta["timings_s"]["gpu_checkpoint"], criu_dump_s=meta["timings_s"]["criu_dump"])


def test_torch_compile_workers_refused_then_stopped_and_checkpointed(stack, refs, images, containers, backend, report):
    """A torch.compile'd workload that leaves inductor's compile pool running (its default):
    the pool read the GPU's properties and forked, so its processes hold the driver's files;
    refused (exit 10) with the way out for that pool. Once the workload stops its pool, the
    same container is checkpointed, deleted and restored, and goes on bit for bit."""
    gb = 1
    refs.start(gb, mode="compiled")
    c = Container(stack, gb=gb, mode="compiled")
    containers.append(c)
    c.start(ready_timeout=400)
    c.wait_step(50)

    def holders() -> dict[int, tuple[list[str], int]]:
        everyone = c.host_pids()
        cuda = [g.host_pid for g in backend.find_processes(everyone)]
        return {p: h for p in everyone if p not in cuda and ((h := nvidia_files(p))[0] or h[1])}

    # The pool starts beside the first compile and forks its workers seconds later (a checkpoint
    # in between fails in CRIU, and is named the same way after the rollback): wait for them.
    deadline = time.monotonic() + 120
    while not (held := holders()):
        assert time.monotonic() < deadline, "inductor's compile pool never took the driver's files"
        time.sleep(0.5)
    run = c.checkpoint(images)
    assert run.rc == 10, run.stderr
    assert "torch.compile's compile workers" in run.stderr and "shutdown_compile_workers()" in run.stderr, run.stderr
    assert c.state()["status"] == "running"
    (c.data / "stop-compile-workers").touch()
    deadline = time.monotonic() + 60
    while "compile workers stopped" not in c.out():
        assert time.monotonic() < deadline, c.out()[-5:]
        time.sleep(0.1)
    time.sleep(1)  # the pool's processes exit
    ck = c.checkpoint(images)
    assert ck.rc == 0, ck.stderr + criu_log_tail(images / "dump.log")
    before = c.last_step()
    c.delete()
    rst = c.restore(images)
    assert rst.rc == 0, rst.stderr + criu_log_tail(images / "restore.log")
    c.wait_step(before + 100)
    n = assert_matches(c.lines(), refs.get(gb, mode="compiled"), after=before)
    report(test="torch.compile workers running: refused (exit 10); stopped: checkpoint, delete, restore (1 GiB)", gib=gb, procs=len(c.host_pids()),
           checkpoint_s=round(ck.seconds, 2), restore_s=round(rst.seconds, 2), steps_compared=n, holders=len(held),
           holder_nvidia_maps=sum(m for _, m in held.values()))
