#!/usr/bin/env python3
"""`gpusnap checkpoint --push` of a checkpoint that stops the container, next to the same
checkpoint without store or push (``--output``: the engine's dump, gpusnap.json, a rename), in
one run, alternating, on this machine: a CPU container (runc-direct, the host's python through
``--rootfs-overlay /``) holding random memory, a real local docker-registry.

    sudo .venv/bin/python bench/stop_push.py [--mib 512] [--rounds 3] [--src DIR]

``--src``: the gpusnap sources to time (default: this checkout), e.g. another worktree, to
compare two versions in the same run (``--src A --src B``). Prints each round and the median
ratio of ``checkpoint --push`` to ``checkpoint --output`` (the issue's target: <= 1.3x)."""

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
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from stack.registry import Registry  # noqa: E402

WORKLOAD = ("import os, sys, time\n"
            "blob = os.urandom({n} << 20)\n"
            "i = 0\n"
            "while True:\n"
            "    print(i, flush=True); i += 1; time.sleep(0.3)\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--src", action="append", type=Path)
    args = ap.parse_args()
    sources = args.src or [REPO / "src"]
    gs = str(Path(sys.executable).parent / "gpusnap")
    work = Path(tempfile.mkdtemp(prefix="gs-stop-push-", dir="/var/tmp"))
    reg = Registry(work / "registry", range(5390, 5399)).start()
    results: dict[str, dict[str, list[float]]] = {str(s): {"output": [], "push": []} for s in sources}
    name = f"gs-sp-{uuid.uuid4().hex[:6]}"
    base_env = {**os.environ, "GPUSNAP_RUN_DIR": str(work / "run"), "GPUSNAP_STATE_DIR": str(work / "state"),
                "GPUSNAP_CONFIG": str(work / "none.toml")}

    def run(env: dict[str, str], *argv: str) -> tuple[float, dict]:
        t = time.perf_counter()
        p = subprocess.run([gs, *argv], capture_output=True, text=True, env=env)
        took = time.perf_counter() - t
        if p.returncode != 0:
            raise SystemExit(f"gpusnap {' '.join(argv)}: {p.stderr.strip()}")
        return took, (json.loads(p.stdout) if "--json" in argv else {})

    def wait_counting(env: dict[str, str], n: str) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            out = subprocess.run([gs, "logs", n], capture_output=True, text=True, env=env).stdout.split()
            if len(out) >= 2:
                return
            time.sleep(0.2)
        raise SystemExit(f"{n} never counted")

    try:
        env0 = {**base_env, "GPUSNAP_STORE": str(work / "store0")}
        run(env0, "run", name, "--rootfs-overlay", "/", "--", sys.executable, "-c", WORKLOAD.format(n=args.mib))
        wait_counting(env0, name)
        for rnd in range(args.rounds):
            for src in sources:
                env = {**base_env, "PYTHONPATH": str(src), "GPUSNAP_STORE": str(work / f"store-{rnd}-{abs(hash(str(src)))}")}
                out = work / f"out-{rnd}-{abs(hash(str(src)))}"
                t_out, _ = run(env, "checkpoint", name, "--output", str(out), "--json")
                run(env, "delete", name)
                run(env, "restore", str(out), "--name", name)
                shutil.rmtree(out)
                wait_counting(env, name)
                # A repository of its own each time: nothing on the registry yet (no HEAD hit, no mount).
                remote = f"{reg.host}/bench/stop-push-{rnd}-{abs(hash(str(src)))}:1"
                t_push, j = run(env, "checkpoint", name, "--push", remote, "--insecure", "--json")
                run(env, "delete", name)
                run(env, "restore", j["ref"], "--name", name)
                wait_counting(env, name)
                results[str(src)]["output"].append(t_out)
                results[str(src)]["push"].append(t_push)
                print(f"round {rnd} {src}: checkpoint --output {t_out:.2f} s, checkpoint --push {t_push:.2f} s "
                      f"({t_push / t_out:.2f}x) steps {j.get('timings_s')}", flush=True)
        for src, r in results.items():
            o, p = statistics.median(r["output"]), statistics.median(r["push"])
            print(f"{src}: {args.mib} MiB, median checkpoint --output {o:.2f} s, checkpoint --push {p:.2f} s: {p / o:.2f}x")
    finally:
        subprocess.run([gs, "delete", name], capture_output=True, env=base_env)
        reg.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
