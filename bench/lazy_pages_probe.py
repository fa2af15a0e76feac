#!/usr/bin/env python3
"""Can a GPU container be restored with CRIU's lazy pages, and what would it gain? (issue 12)

A restore through CRIU copies every memory page into the restored process before it lets it go,
so a restore from a registry must have the pages whole first; with lazy pages (userfaultfd) CRIU
lets the process go with its anonymous memory missing and a ``criu lazy-pages`` daemon fills each
page on first touch (and the rest in the background). Whether that works for a CUDA process is
the question: the CUDA driver's restore (``cuCheckpointProcessRestore``) reads the checkpointed
device memory from the process's host memory, so those pages would fault in through the daemon
while the driver copies them.

By hand, no gpusnap: a runc container (an overlay of /, as bench/e2e.py's by-hand peer) holding
``--gib`` GiB on the GPU that it changes every step and prints a checksum of; checkpointed with
the driver API + ``runc checkpoint --leave-running``, then restored twice, each time from a
fresh checkpoint: eagerly (``runc restore``) and lazily (``criu lazy-pages`` started on the same
work directory, then ``runc restore --lazy-pages``), each followed by the driver restore and
unlock. It reports each phase's seconds, the time to the first step after, whether the steps
after match the run's own (bit for bit), and the daemon's end. Run on the GPU machine by
tests/gpu/run_gpu_suite.sh with GS_GPU_LAZY_PROBE=GIB.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (the by-hand container, the CUDA driver calls, step parsing)

HOLDER = """
import sys, time, torch
n = int(float(sys.argv[1]) * (1 << 30)) // 4
g = torch.Generator(device="cuda").manual_seed(1)
x = torch.rand(n, device="cuda", generator=g)
step = 0
while True:
    x.mul_(1.0001).add_(0.25).remainder_(1.0)
    print(f"step {step} {float(x.sum(dtype=torch.float64))!r} t={time.time():.3f}", flush=True)
    step += 1
    time.sleep(0.2)
"""

# --cpu: the same without a GPU (this project's VM), to try the lazy-pages mechanics under runc.
CPU_HOLDER = """
import hashlib, random, sys, time
x = bytearray(random.Random(1).randbytes(int(float(sys.argv[1]) * (1 << 30))))
step = 0
while True:
    i = (step * 7919 * 4096) % len(x)
    x[i:i + 4096] = hashlib.sha256(x[i:i + 4096]).digest() * 128
    print(f"step {step} {hashlib.sha256(x).hexdigest()[:16]} t={time.time():.3f}", flush=True)
    step += 1
    time.sleep(0.2)
"""


def steps_after(c: e2e.BareContainer, since: float) -> list[tuple[int, str, float]]:
    return [s for s in e2e.parse_steps(c.output()) if s[2] > since]


def lazy_restore(c: e2e.BareContainer, images: Path, cuda: e2e.CudaDriver | None, criu: str, out: Path, verbosity: int) -> dict[str, Any]:
    """``criu lazy-pages`` on a work directory, then ``runc restore --lazy-pages`` on the same one.
    ``verbosity``: the daemon's -v (4 logs every copy, which slows it)."""
    c._runc("delete", "--force", c.name)
    work = c.dir / "criu-work-lazy"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    r: dict[str, Any] = {}
    start = time.time()
    t0 = time.perf_counter()
    daemon = subprocess.Popen([criu, "lazy-pages", "--images-dir", str(images), "--work-dir", str(work), f"-v{verbosity}", "--log-file", "lazy-pages.log"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sock = work / "lazy-pages.socket"
    while not sock.exists() and daemon.poll() is None and time.perf_counter() - t0 < 10:
        time.sleep(0.005)
    r["daemon_ready_s"] = time.perf_counter() - t0
    if not sock.exists():
        alive = daemon.poll() is None
        if alive:
            daemon.kill()
        err = daemon.communicate()[1] or ""
        r["error"] = f"the lazy-pages daemon did not start ({'killed after 10 s' if alive else f'exit {daemon.returncode}'}): {err[-800:]}"
        return r
    t1 = time.perf_counter()
    p = subprocess.run([c.runc, "--root", str(c.root), "restore", "-d", "--lazy-pages", "--bundle", str(c.bundle), "--image-path", str(images),
                        "--work-path", str(work), c.name], timeout=300, **c._pipes())  # the pipes become the process's stdio
    r["runc_restore_s"] = time.perf_counter() - t1
    if p.returncode:
        r["error"] = f"runc restore --lazy-pages exited {p.returncode}: {c.output().strip()[-800:]}"
    else:
        t2 = time.perf_counter()
        try:
            if cuda is not None:
                cuda.restore_unlock(c.pid())
        except Exception as exc:  # noqa: BLE001 - the finding itself
            r["error"] = f"CUDA driver restore after a lazy restore: {exc}"
        r["cuda_restore_unlock_s"] = time.perf_counter() - t2
    r["restore_s"] = time.perf_counter() - t0
    r["started"] = start
    if p.returncode:
        daemon.kill()  # no restore will connect to it: do not wait for it
    try:
        daemon.wait(timeout=120)
        r["daemon_done_s"] = time.perf_counter() - t0
        r["daemon_rc"] = daemon.returncode
    except subprocess.TimeoutExpired:
        daemon.kill()
        r["daemon_done_s"] = None
    for log in work.glob("*.log"):
        shutil.copy(log, out / f"lazy-{log.name}")
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/gs-lazy-probe"), help="on the root filesystem (the container's overlay of /)")
    ap.add_argument("--images", type=Path, default=Path("/dev/shm/gs-lazy-probe"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/gs-lazy-probe-out"))
    ap.add_argument("--daemon-verbosity", type=int, default=1, help="criu lazy-pages -vN (4 logs every page copy)")
    ap.add_argument("--rounds", default="eager,lazy,eager", help="restores in turn, each from a fresh checkpoint")
    ap.add_argument("--cpu", action="store_true", help="no GPU: a CPU process holding --gib GiB (the mechanics alone)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runc, criu = shutil.which("runc"), shutil.which("criu")
    if not runc or not criu:
        print("lazy_pages_probe: runc and criu must be on PATH", file=sys.stderr)
        return 2
    res: dict[str, Any] = {"gib": args.gib, "criu": subprocess.run([criu, "--version"], capture_output=True, text=True).stdout.split("\n")[0],
                           "uffd": subprocess.run([criu, "check", "--feature", "uffd-noncoop"], capture_output=True, text=True).stdout.strip()
                           or "(no answer)"}
    print(f"lazy_pages_probe: {res['criu']}; criu check --feature uffd-noncoop: {res['uffd']}", flush=True)
    shutil.rmtree(args.work, ignore_errors=True)
    shutil.rmtree(args.images, ignore_errors=True)
    args.work.mkdir(parents=True)
    holder = args.work / "holder.py"
    holder.write_text(CPU_HOLDER if args.cpu else HOLDER)
    cuda = None if args.cpu else e2e.CudaDriver()
    c = e2e.BareContainer(args.work, [sys.executable, str(holder), str(args.gib)], not args.cpu, runc)
    values = e2e.Values()
    try:
        c.start()
        e2e.wait_until(lambda: len(e2e.parse_steps(c.output())) >= 3, 120, "the holder's first steps", 0.1)
        for mode in args.rounds.split(","):
            images = args.images / f"{mode}-{len(res.get('rounds', []))}"
            images.mkdir(parents=True)
            ck = c.checkpoint(images, cuda)
            at = e2e.parse_steps(c.output())[-1][0]
            e2e.wait_until(lambda: e2e.parse_steps(c.output())[-1][0] >= at + 2, 60, "steps after the checkpoint", 0.05)
            values.compare(e2e.parse_steps(c.output()))
            row: dict[str, Any] = {"mode": mode, "checkpoint_s": ck, "image_bytes": sum(p.stat().st_size for p in images.rglob("*") if p.is_file())}
            if mode == "eager":
                secs, started = c.restore(images, cuda)
                row |= {"restore_s": secs}
            else:
                row |= lazy_restore(c, images, cuda, criu, args.out, args.daemon_verbosity)
                started = row.pop("started", time.time())
            if "error" not in row:
                try:
                    e2e.wait_until(lambda: steps_after(c, started), 60, "the first step after the restore", 0.01)
                    first = steps_after(c, started)[0]
                    row["first_step_s"] = first[2] - started
                    time.sleep(2)
                    row["same"], row["differ"] = values.compare(steps_after(c, started))
                except Exception as exc:  # noqa: BLE001 - recorded
                    row["error"] = f"no step after the restore: {exc}; output: {c.output()[-600:]}"
            print(json.dumps(row), flush=True)
            res.setdefault("rounds", []).append(row)
            shutil.rmtree(images, ignore_errors=True)
            if "error" in row:
                break
    finally:
        c.cleanup()
        shutil.rmtree(args.images, ignore_errors=True)
        (args.out / "lazy_probe.json").write_text(json.dumps(res, indent=1))
    print("\n| mode | image GB | checkpoint s | restore s (runc / CUDA restore+unlock) | first step after s | daemon done s | steps equal / differ | error |")
    print("|---|---:|---:|---|---:|---:|---|---|")
    for r in res.get("rounds", []):
        parts = f"{r.get('runc_restore_s', 0):.2f} / {r.get('cuda_restore_unlock_s', 0):.2f}" if r["mode"] == "lazy" else ""
        print(f"| {r['mode']} | {r['image_bytes'] / 1e9:.2f} | {r['checkpoint_s']:.2f} | {r.get('restore_s', 0):.2f} {parts} | "
              f"{r.get('first_step_s', 0):.2f} | {r.get('daemon_done_s') or ''} | {r.get('same', '')} / {r.get('differ', '')} | {r.get('error', '')[:300]} |")
    return 0 if all("error" not in r for r in res.get("rounds", [])) else 1


if __name__ == "__main__":
    raise SystemExit(main())
