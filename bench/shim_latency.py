#!/usr/bin/env python3
"""Latency gpusnap-runtime adds to runc, per call, measured against runc itself in the same run.

    sudo .venv/bin/python bench/shim_latency.py [--runs 200]

Calls: `state` of a running container (passthrough), `--version`
(handed to Python: it prints gpusnap's version first), and a full `create` + `start` + `delete`
cycle (create goes through the spec modifier chain in Python; start and delete are passthrough).
Runtimes: runc; gpusnap-runtime, the sh front engines call; and gpusnap-runtime-py, the Python
shim called directly (what every call cost before the front). Runs of each alternate so that
machine load affects all alike; the table shows the median of each and what it adds to runc, in
wall-clock time and in CPU time (user + system of the processes waited for: on a loaded machine
wall time also counts the wait for a core, CPU time does not). Targets: passthrough (`state`)
adds at most 3 ms; create+start+delete at most 15 ms a call (45 ms the cycle).

gpusnap's modules are byte-compiled first, as `pip install` does (`--no-compile` skips it): in
an editable install run with PYTHONDONTWRITEBYTECODE=1 every call would otherwise compile its
sources again, a few milliseconds per module that no installed shim pays.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def _bundle(base: Path, args: list[str]) -> Path:
    bundle = base / "bundle"
    (bundle / "rootfs" / "bin").mkdir(parents=True)
    for d in ("proc", "sys", "dev", "tmp"):
        (bundle / "rootfs" / d).mkdir()
    shutil.copy2("/bin/busybox", bundle / "rootfs" / "bin" / "busybox")
    for applet in ("sh", "sleep", "true"):
        (bundle / "rootfs" / "bin" / applet).symlink_to("busybox")
    subprocess.run(["runc", "spec"], cwd=bundle, check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"].update(terminal=False, args=args)
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def _time(fn: Callable[[], float]) -> tuple[float, float]:
    """(wall ms, CPU ms): the CPU time (user + system) of the processes ``fn`` waited for does
    not count time spent waiting for a core, so it stays meaningful on a loaded machine."""
    start = time.perf_counter()
    cpu = fn()
    return (time.perf_counter() - start) * 1000, cpu


def _run(argv: list[str], env: dict[str, str]) -> float:
    """Run ``argv`` to completion; returns the CPU ms it used (exec keeps one process: the shim
    and the runc it execs are counted together, as runc alone is for runc)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, argv)
    return (usage.ru_utime + usage.ru_stime) * 1000


def _call(argv: list[str], env: dict[str, str]) -> Callable[[], float]:
    def go() -> float:
        return _run(argv, env)

    return go


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200, help="runs per call and runtime (default 200)")
    ap.add_argument("--shim", default=str(Path(sys.executable).parent / "gpusnap-runtime"), help="the sh front")
    ap.add_argument("--shim-py", default=str(Path(sys.executable).parent / "gpusnap-runtime-py"), help="the Python shim")
    ap.add_argument("--runc", default=shutil.which("runc") or "/usr/sbin/runc")
    ap.add_argument("--no-compile", action="store_true", help="do not byte-compile gpusnap first")
    ap.add_argument(
        "--tmpdir",
        help="where bundles, the runc root and the run dir go (default: the system's temporary directory). "
        "Engines keep them on a tmpfs (/run); on a disk-backed directory replacing config.json also "
        "frees the old file's blocks, which create waits for",
    )
    opts = ap.parse_args()
    if os.geteuid() != 0:
        print("shim_latency.py: run as root (containers are created)", file=sys.stderr)
        return 2
    if not opts.no_compile:
        import compileall

        import gpusnap

        compileall.compile_dir(str(Path(gpusnap.__file__).parent), quiet=1)
    with tempfile.TemporaryDirectory(prefix="gs-shim-bench-", dir=opts.tmpdir) as tmp:
        base = Path(tmp)
        env = {**os.environ, "GPUSNAP_RUN_DIR": str(base / "run"), "GPUSNAP_CONFIG": str(base / "none.toml"), "GPUSNAP_RUNC": opts.runc}
        root = base / "root"
        sleeper = _bundle(base / "sleeper", ["sleep", "100000"])
        cycle_bundle = _bundle(base / "cycle", ["true"])
        subprocess.run([opts.runc, "--root", str(root), "run", "-d", "--bundle", str(sleeper), "gs-shim-bench-state"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        counter = iter(range(10**9))

        def cycle(binary: str) -> Callable[[], float]:
            def go() -> float:
                cid = f"gs-shim-bench-{next(counter)}"
                rt = [binary, "--root", str(root)]
                calls = (["create", "--bundle", str(cycle_bundle), cid], ["start", cid], ["delete", "--force", cid])
                return sum(_run([*rt, *args], env) for args in calls)

            return go

        calls = {
            "state": lambda b: _call([b, "--root", str(root), "state", "gs-shim-bench-state"], env),
            "--version": lambda b: _call([b, "--version"], env),
            "create+start+delete": cycle,
        }
        rows = []
        runtimes = {"runc": opts.runc, "gpusnap-runtime": opts.shim, "gpusnap-runtime-py": opts.shim_py}
        try:
            for name, make in calls.items():
                fns = {label: make(binary) for label, binary in runtimes.items()}
                for fn in fns.values():  # warm the page cache and .pyc files
                    fn()
                samples: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
                for _ in range(opts.runs):
                    for label, fn in fns.items():
                        samples[label].append(_time(fn))
                wall = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
                cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
                per_call = 3 if name == "create+start+delete" else 1
                for label in runtimes:
                    rows.append((name, label, wall[label], wall[label] - wall["runc"], (wall[label] - wall["runc"]) / per_call,
                                 wall[label] / wall["runc"], cpu[label], cpu[label] - cpu["runc"]))
        finally:
            subprocess.run([opts.runc, "--root", str(root), "delete", "--force", "gs-shim-bench-state"], check=False)
    print(f"gpusnap-runtime added latency, median of {opts.runs} runs each (runc: {opts.runc})")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    print(f"bundles, runc root and run dir under {opts.tmpdir or tempfile.gettempdir()}")
    print("| call | runtime | wall (ms) | added (ms) | added per call (ms) | ratio | CPU (ms) | added CPU (ms) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, label, w, added, added_per_call, ratio, c, added_cpu in rows:
        if label == "runc":
            print(f"| {name} | {label} | {w:.1f} | | | | {c:.1f} | |")
        else:
            print(f"| {name} | {label} | {w:.1f} | {added:+.1f} | {added_per_call:+.1f} | {ratio:.2f}x | {c:.1f} | {added_cpu:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
