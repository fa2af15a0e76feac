#!/usr/bin/env python3
"""Latency gpusnap-runtime adds to runc, per call, measured against runc itself in the same run.

    sudo .venv/bin/python bench/shim_latency.py [--runs 200]

Calls: `state` of a running container and `--version` (both passthrough by exec), and a full
`create` + `start` + `delete` cycle (create goes through the spec modifier chain). Runs of runc
and of the shim alternate so that machine load affects both alike; the table shows the median of
each, the difference and the ratio. Target: at most 15 ms added median per passthrough call.
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


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def _call(argv: list[str], env: dict[str, str]) -> Callable[[], None]:
    def go() -> None:
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)

    return go


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200, help="runs per call and runtime (default 200)")
    ap.add_argument("--shim", default=str(Path(sys.executable).parent / "gpusnap-runtime"))
    ap.add_argument("--runc", default=shutil.which("runc") or "/usr/sbin/runc")
    opts = ap.parse_args()
    if os.geteuid() != 0:
        print("shim_latency.py: run as root (containers are created)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gs-shim-bench-") as tmp:
        base = Path(tmp)
        env = {**os.environ, "GPUSNAP_RUN_DIR": str(base / "run"), "GPUSNAP_CONFIG": str(base / "none.toml"), "GPUSNAP_RUNC": opts.runc}
        root = base / "root"
        sleeper = _bundle(base / "sleeper", ["sleep", "100000"])
        cycle_bundle = _bundle(base / "cycle", ["true"])
        subprocess.run([opts.runc, "--root", str(root), "run", "-d", "--bundle", str(sleeper), "gs-shim-bench-state"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        counter = iter(range(10**9))

        def cycle(binary: str) -> Callable[[], None]:
            def go() -> None:
                cid = f"gs-shim-bench-{next(counter)}"
                rt = [binary, "--root", str(root)]
                for args in (["create", "--bundle", str(cycle_bundle), cid], ["start", cid], ["delete", "--force", cid]):
                    subprocess.run([*rt, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)

            return go

        calls = {
            "state": lambda b: _call([b, "--root", str(root), "state", "gs-shim-bench-state"], env),
            "--version": lambda b: _call([b, "--version"], env),
            "create+start+delete": cycle,
        }
        rows = []
        try:
            for name, make in calls.items():
                fns = {"runc": make(opts.runc), "shim": make(opts.shim)}
                for fn in fns.values():  # warm the page cache and .pyc files
                    fn()
                samples: dict[str, list[float]] = {"runc": [], "shim": []}
                for _ in range(opts.runs):
                    for label, fn in fns.items():
                        samples[label].append(_time(fn))
                runc_ms, shim_ms = statistics.median(samples["runc"]), statistics.median(samples["shim"])
                rows.append((name, runc_ms, shim_ms, shim_ms - runc_ms, shim_ms / runc_ms))
        finally:
            subprocess.run([opts.runc, "--root", str(root), "delete", "--force", "gs-shim-bench-state"], check=False)
    print(f"gpusnap-runtime added latency, median of {opts.runs} runs each (runc: {opts.runc})")
    print(f"| call | runc (ms) | gpusnap-runtime (ms) | added (ms) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, r, s, added, ratio in rows:
        print(f"| {name} | {r:.1f} | {s:.1f} | {added:+.1f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
