"""Restore from the local store with CRIU started before the memory pages are whole (held at
setup-namespaces: gpusnap.checkpoint.pages_hold) against runc started once they are
(``GPUSNAP_CRIU_BEFORE_PAGES=0``), on one checkpoint, the two in turn, the order swapped each
round. Each restore is timed from the command's start to the first step the restored workload
prints, and the command alone; ``--json`` timings give the split.

    sudo .venv/bin/python bench/criu_hold.py --rounds 4 --mib 1536 --out bench/results/criu-hold-vm-<date>

It needs what bench/e2e.py needs (root, runc, CRIU; the tests' provisioning installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HOLDER = HERE / "workloads" / "cpu_holder.py"
NAME = "criu-hold-bench"
MODES = {"CRIU before the pages": "1", "runc after the pages": "0"}


def gpusnap() -> list[str]:
    exe = shutil.which("gpusnap", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "gpusnap.cli"]


def cli(args: list[str], env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*gpusnap(), *args], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    if check and proc.returncode != 0:
        raise SystemExit(f"gpusnap {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def steps_after(env: dict[str, str], since: float) -> list[tuple[int, float]]:
    out = cli(["logs", NAME, "--tail", "40"], env, check=False).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "step" and parts[-1].startswith("t="):
            t = float(parts[-1][2:])
            if t > since:
                found.append((int(parts[1]), t))
    return found


def first_step_after(env: dict[str, str], since: float, timeout: float = 120) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = steps_after(env, since)
        if found:
            return found[0][1]
        time.sleep(0.05)
    raise SystemExit(f"no step printed within {timeout} s of the restore")


def byte_compile() -> None:
    # As bench/e2e.py: these machines set PYTHONDONTWRITEBYTECODE, and an editable install would
    # otherwise compile gpusnap from source in every gpusnap, runtime and hook process.
    import compileall

    import gpusnap

    compileall.compile_dir(os.path.dirname(gpusnap.__file__), quiet=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--mib", type=int, default=1536, help="memory the CPU workload holds (random, zeros, constant: 2/1/1)")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/gpusnap-criu-hold"), help="the store and run dir (on disk)")
    ap.add_argument("--state-dir", type=Path, default=Path("/dev/shm/gpusnap-criu-hold-state"), help="where CRIU images are unpacked")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: it starts containers and CRIU")
    byte_compile()
    env = {**os.environ, "GPUSNAP_STORE": str(args.work / "store"), "GPUSNAP_RUN_DIR": str(args.work / "run"),
           "GPUSNAP_STATE_DIR": str(args.state_dir), "GPUSNAP_CONFIG": "/nonexistent/gpusnap.toml"}
    if args.work.exists():
        cli(["delete", NAME], env, check=False)  # an interrupted run's container (its overlay is mounted there)
    shutil.rmtree(args.work, ignore_errors=True)
    shutil.rmtree(args.state_dir, ignore_errors=True)
    args.work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    holder = args.work / "cpu_holder.py"
    shutil.copy(HOLDER, holder)
    q = args.mib // 4
    cli(["run", NAME, "--rootfs-overlay", "/", "--env", "PYTHONUNBUFFERED=1", "--", sys.executable, str(holder),
         "--random-mib", str(2 * q), "--zero-mib", str(q), "--const-mib", str(q)], env)
    deadline = time.time() + 300
    while not steps_after(env, 0):
        if time.time() > deadline:
            raise SystemExit("the workload printed no step")
        time.sleep(0.5)
    ck = json.loads(cli(["checkpoint", NAME, "--json"], env).stdout)
    ref = ck["ref"]
    cli(["delete", NAME], env)  # the checkpointed container's record; each restore makes it again
    rows: list[dict[str, Any]] = []
    order = list(MODES)
    for rnd in range(args.rounds):
        for mode in (order if rnd % 2 == 0 else order[::-1]):
            start = time.time()
            proc = cli(["restore", ref, "--json"], {**env, "GPUSNAP_CRIU_BEFORE_PAGES": MODES[mode]})
            command_s = time.time() - start
            first = first_step_after(env, start) - start
            timings = json.loads(proc.stdout).get("timings_s", {})
            rows.append({"round": rnd, "mode": mode, "to_first_step_s": round(first, 3), "command_s": round(command_s, 3),
                         "timings_s": timings})
            print(f"round {rnd} {mode}: first step {first:.2f} s, command {command_s:.2f} s, runc restore "
                  f"{timings.get('restore: runtime: runc restore')}, CRIU waited {timings.get('restore: runtime: CRIU waited for the pages')}",
                  flush=True)
            cli(["delete", NAME], env)
    (args.out / "criu-hold.json").write_text(json.dumps({"mib": args.mib, "image_bytes": ck.get("size"), "rows": rows}, indent=1))
    lines = ["| mode | to first step, median s | each round | command, median s | runtime: runc restore, median s | CRIU waited for the pages, median s |",
             "|---|---:|---|---:|---:|---:|"]
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]

        def med(key: str) -> float:
            vals = [float(r["timings_s"].get(key, 0.0)) for r in mine]
            return statistics.median(vals) if vals else 0.0

        each = ", ".join(f"{r['to_first_step_s']:.2f}" for r in mine)
        lines.append(f"| {mode} | {statistics.median(r['to_first_step_s'] for r in mine):.2f} | "
                     f"{each} | {statistics.median(r['command_s'] for r in mine):.2f} | "
                     f"{med('restore: runtime: runc restore'):.2f} | {med('restore: runtime: CRIU waited for the pages'):.2f} |")
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    shutil.rmtree(args.state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
