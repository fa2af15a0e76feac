"""GPU container checkpoint/restore: gpusnap-runtime next to the same steps done by hand.

Run on a GPU machine (tests/gpu/run_gpu_suite.sh runs it). For each size, in the same run:

- gpusnap: ``gpusnap-runtime checkpoint`` (finds the GPU processes, locks, moves GPU state to
  host memory, runs runc checkpoint), ``runc delete``, ``gpusnap-runtime restore -d``
  (host check, runc restore, host->GPU, unlock); wall time of each command, and the breakdown
  from gpusnap.json / gpusnap-restore.json;
- by hand: the CUDA driver API from this process through cuda-bindings
  (cuCheckpointProcessLock + cuCheckpointProcessCheckpoint), ``runc checkpoint``,
  ``runc delete``, ``runc restore -d``, then cuCheckpointProcessRestore + Unlock on the new PID.

Target: gpusnap within 10% of by hand. Prints a Markdown table; ``--json`` saves the rows.

Fairness: the first cycle on a fresh VM was slower whichever side ran it (earlier runs had
gpusnap first and 8-30 % behind; the host's memory is first touched then). So the images'
tmpfs is pre-faulted with twice the largest size before anything is timed, and each size runs
``--rounds`` rounds in alternating order (by hand first, then gpusnap first, ...); a row shows
each side's mean and the ratio of the means, the per-round ratios beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gpu_harness import Container, Stack  # noqa: E402


def driver():
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return cu


def ok(res, what):
    assert res[0] == 0, f"{what}: {res[0]}"


def gpusnap_cycle(stack: Stack, gb: float, images: Path) -> dict:
    c = Container(stack, gb=gb)
    try:
        c.start(ready_timeout=600)
        c.wait_step(50, timeout=300)
        ck = c.checkpoint(images)
        assert ck.rc == 0, ck.stderr
        meta = json.loads((images / "gpusnap.json").read_text())
        at = c.last_step()
        c.delete()
        rs = c.restore(images)
        assert rs.rc == 0, rs.stderr
        rt = json.loads((images / "gpusnap-restore.json").read_text())["timings_s"]
        c.wait_step(at + 20, timeout=300)  # it goes on
        t = meta["timings_s"]
        return {
            "gpu_gib": sum(p["gpu_memory_bytes"] for p in meta["processes"]) / (1 << 30),
            "checkpoint_s": ck.seconds, "restore_s": rs.seconds,
            "lock_s": t["gpu_lock"], "gpu_to_host_s": t["gpu_checkpoint"], "criu_dump_s": t["criu_dump"],
            "criu_restore_s": rt["runc_restore"], "host_to_gpu_s": rt["gpu_restore"], "unlock_s": rt["gpu_unlock"],
            "image_gib": sum(f.stat().st_size for f in images.iterdir()) / (1 << 30),
        }
    finally:
        c.cleanup()
        shutil.rmtree(images, ignore_errors=True)


def by_hand_cycle(stack: Stack, gb: float, images: Path, timeout_ms: int = 10_000) -> dict:
    cu = driver()
    c = Container(stack, gb=gb, via_shim=False)
    try:
        c.start(ready_timeout=600)
        c.wait_step(50, timeout=300)
        (pid,) = c.worker_pids()
        held_gib = gpu_memory(pid) / (1 << 30)
        t0 = time.perf_counter()
        la = cu.CUcheckpointLockArgs()
        la.timeoutMs = timeout_ms
        ok(cu.cuCheckpointProcessLock(pid, la), "lock")
        t1 = time.perf_counter()
        ok(cu.cuCheckpointProcessCheckpoint(pid, None), "checkpoint")
        t2 = time.perf_counter()
        ck = c.checkpoint(images)
        assert ck.rc == 0, ck.stderr
        t3 = time.perf_counter()
        at = c.last_step()
        c.delete()
        t4 = time.perf_counter()
        rs = c.restore(images)
        assert rs.rc == 0, rs.stderr
        t5 = time.perf_counter()
        (pid,) = c.worker_pids()
        ok(cu.cuCheckpointProcessRestore(pid, None), "restore")
        t6 = time.perf_counter()
        ok(cu.cuCheckpointProcessUnlock(pid, None), "unlock")
        t7 = time.perf_counter()
        c.wait_step(at + 20, timeout=300)
        return {
            "gpu_gib": held_gib,
            "checkpoint_s": t3 - t0, "restore_s": t7 - t4,
            "lock_s": t1 - t0, "gpu_to_host_s": t2 - t1, "criu_dump_s": t3 - t2,
            "criu_restore_s": t5 - t4, "host_to_gpu_s": t6 - t5, "unlock_s": t7 - t6,
            "image_gib": sum(f.stat().st_size for f in images.iterdir()) / (1 << 30),
        }
    finally:
        c.cleanup()
        shutil.rmtree(images, ignore_errors=True)


def prefault(directory: Path, gib: float) -> float:
    """Touch ``gib`` GiB of tmpfs pages once and free them; returns the seconds it took."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "prefault"
    block = b"\xa5" * (64 << 20)
    t0 = time.perf_counter()
    try:
        with open(path, "wb") as f:
            for _ in range(int(gib * 16) or 1):
                f.write(block)
    finally:
        path.unlink(missing_ok=True)
    return time.perf_counter() - t0


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def combine(cycles: list[dict]) -> dict:
    """The mean of each timing over the rounds of one side."""
    return {k: mean([c[k] for c in cycles]) for k in cycles[0]}


def gpu_memory(pid: int) -> int:
    from pynvml import nvmlDeviceGetComputeRunningProcesses, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex, nvmlInit

    nvmlInit()
    total = 0
    for i in range(nvmlDeviceGetCount()):
        for p in nvmlDeviceGetComputeRunningProcesses(nvmlDeviceGetHandleByIndex(i)):
            if p.pid == pid:
                total += p.usedGpuMemory or 0
    return total


def free_shm_gib(path: Path) -> float:
    st = os.statvfs(path if path.exists() else "/")
    return st.f_bavail * st.f_frsize / (1 << 30)


def gpu_line() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown GPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,8,32", help="GiB of GPU state, comma separated")
    ap.add_argument("--images", default="/dev/shm/gs-gpu-bench", help="where checkpoint images go (tmpfs keeps disk speed out of it)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--deadline", type=float, default=0, help="epoch seconds: skip sizes that would not end before it")
    ap.add_argument("--work", default="/tmp/gs-gpu-bench-work")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per size, in alternating order (by hand first in odd rounds)")
    args = ap.parse_args()
    criu, runc = shutil.which("criu"), shutil.which("runc")
    shim = shutil.which("gpusnap-runtime") or str(Path(sys.executable).parent / "gpusnap-runtime")
    assert criu and runc, "criu and runc must be on PATH"
    stack = Stack(base=Path(args.work), mode="cuda", gpu_backend="nvidia", shim=shim, runc=runc, tools_bin=os.path.dirname(criu), pythonpath=os.environ.get("PYTHONPATH", ""))
    rows = []
    gpu = gpu_line()
    sizes = [float(x) for x in args.sizes.split(",")]
    warm_gib = min(2 * max(sizes), free_shm_gib(Path(args.images).parent) * 0.8)
    print(f"pre-faulting {warm_gib:.1f} GiB of {Path(args.images).parent}: {prefault(Path(args.images), warm_gib):.1f}s", flush=True)
    for gb in sizes:
        # About 6 s per GiB for one round of both cycles on an H200 with images on tmpfs, plus start-up.
        if args.deadline and time.time() + 30 + 6 * gb * args.rounds > args.deadline:
            rows.append({"gib": gb, "skipped": "not enough time left in this run"})
            print(f"{gb:g} GiB: skipped (time)", flush=True)
            continue
        runs: dict[str, list[dict]] = {"gpusnap": [], "by_hand": []}
        for rnd in range(args.rounds):
            order = ("by_hand", "gpusnap") if rnd % 2 == 0 else ("gpusnap", "by_hand")
            for who in order:
                cycle = gpusnap_cycle if who == "gpusnap" else by_hand_cycle
                runs[who].append(cycle(stack, gb, Path(args.images) / f"{who}-{gb:g}"))
        g, h = combine(runs["gpusnap"]), combine(runs["by_hand"])
        row = {
            "gib": gb, "rounds": args.rounds, "gpusnap": g, "by_hand": h,
            "checkpoint_ratio": g["checkpoint_s"] / h["checkpoint_s"], "restore_ratio": g["restore_s"] / h["restore_s"],
            "round_checkpoint_ratios": [a["checkpoint_s"] / b["checkpoint_s"] for a, b in zip(runs["gpusnap"], runs["by_hand"])],
            "round_restore_ratios": [a["restore_s"] / b["restore_s"] for a, b in zip(runs["gpusnap"], runs["by_hand"])],
            "runs": runs,
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=2))
    print(f"\nGPU: {gpu}\n")
    print("| tensor GiB | who | GPU GiB held | checkpoint s | (lock / GPU→host / CRIU dump) | restore s | (CRIU restore / host→GPU / unlock) | image GiB | gpusnap ÷ by hand |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['gib']:g} | — | | skipped: {r['skipped']} | | | | | |")
            continue
        for who in ("gpusnap", "by_hand"):
            x = r[who]
            per_round = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(r["round_checkpoint_ratios"], r["round_restore_ratios"]))
            ratio = f"ckpt {r['checkpoint_ratio']:.3f}, restore {r['restore_ratio']:.3f} (rounds: {per_round})" if who == "gpusnap" else ""
            print(
                f"| {r['gib']:g} | {who.replace('_', ' ')} | {x['gpu_gib']:.1f} | {x['checkpoint_s']:.2f} | {x['lock_s']:.3f} / {x['gpu_to_host_s']:.2f} / {x['criu_dump_s']:.2f} "
                f"| {x['restore_s']:.2f} | {x['criu_restore_s']:.2f} / {x['host_to_gpu_s']:.2f} / {x['unlock_s']:.3f} | {x['image_gib']:.1f} | {ratio} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
