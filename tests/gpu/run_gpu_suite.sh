#!/usr/bin/env bash
# The one command for a GPU machine: sets everything up and runs the whole GPU suite
# (tests/gpu, including the device tests) and then the benchmark, printing a short table last.
#
#   sudo bash tests/gpu/run_gpu_suite.sh          (from a checkout, on the GPU machine)
#
# Needs root, an NVIDIA GPU with driver >= 570 (580 for GPU remapping), and python3 with torch
# and cuda-bindings. It reaches no package registry: next to the checkout it expects
#   .gpu-tools/  CRIU 4.x + runc (built elsewhere by gpu-probe/make-tools.sh, or tests/gpu/stage.sh)
#   .whl/        wheels of gpusnap itself and of the Python packages the machine lacks
# (tests/gpu/stage.sh DEST builds both). Logs and JSON land in $OUT (default /tmp/gs-gpu-out).
# GS_GPU_TESTS narrows the pytest part (default tests/gpu; split into words), GS_GPU_K picks tests
# by a pytest -k expression (passed whole: "a or b" works); GS_GPU_BENCH_SIZES the benchmark
# (default 1,8 GiB; add 32 for the big run, about 3 more minutes). GS_GPU_BUDGET (seconds, default
# 540, 0 = none) bounds the whole run: the benchmark skips sizes that would overrun it, so one
# run fits a 10-minute slot on the GPU machine. On a host with 2 GPUs the suite adds a two-GPU
# container and a restore onto the other GPU (skipped with one GPU).
# GS_GPU_E2E=server,train (or one of them) adds bench/e2e.py --gpu (issue 12: floors, by hand,
# checkpoint --push, restore from the store and from a local docker-registry, cold start) after
# the benchmark, within what is left of GS_GPU_BUDGET; GS_GPU_E2E_ONLY=1 runs that alone (no
# suite, no bench/gpu_checkpoint.py). One workload per run fits 10 minutes: run server, then train.
# Its stores go to GS_GPU_E2E_WORK (default /var/tmp/gpusnap-e2e, the root filesystem, which its
# containers see), CRIU images and its registry to /dev/shm (a 20 GB checkpoint dumped, stored,
# pushed and pulled back does not fit the 64 GB disk otherwise); results in $OUT/e2e/.
# GS_GPU_RESTORE_PATH=GIB adds bench/restore_path.py (materialize and fetch of a synthetic
# checkpoint of GIB GiB, no containers) after e2e; results in $OUT/restore_path.log.
# GS_GPU_LAZY_PROBE=GIB adds bench/lazy_pages_probe.py (a CUDA container restored with CRIU's lazy
# pages, by hand, beside an eager restore); results in $OUT/lazy.log and $OUT/lazy/.
# Exit status: the suite's (pytest), or the benchmark's if the suite passed, or e2e's.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
TOOLS=${GS_GPU_TOOLS:-$REPO/.gpu-tools}
WHEELS=${GS_GPU_WHEELS:-$REPO/.whl}
OUT=${OUT:-/tmp/gs-gpu-out}
SITE=${GS_GPU_SITE:-/tmp/gs-gpu-site}
START=$(date +%s)
BUDGET=${GS_GPU_BUDGET:-540}   # seconds for the whole run; the benchmark skips sizes that would overrun
mkdir -p "$OUT"
if [ -f "$TOOLS/tools.tar.xz" ] && [ ! -x "$TOOLS/bin/runc" ]; then
  tar -C "$TOOLS" -xJf "$TOOLS/tools.tar.xz" || exit 5   # GS_GPU_CRI=1 stage.sh packed CRIU and runc
fi
[ -x "$TOOLS/bin/criu" ] && [ -x "$TOOLS/bin/runc" ] || { echo "run_gpu_suite: $TOOLS/bin/{criu,runc} missing; build them with tests/gpu/stage.sh" >&2; exit 5; }
ls "$WHEELS"/gpusnap-*.whl >/dev/null 2>&1 || { echo "run_gpu_suite: no gpusnap wheel in $WHEELS; build it with tests/gpu/stage.sh" >&2; exit 5; }
nvidia-smi -L >/dev/null 2>&1 || { echo "run_gpu_suite: nvidia-smi finds no GPU here" >&2; exit 5; }

# gpusnap and the few packages the machine lacks, with no dependency resolution and no index,
# into python3's own environment: runc runs gpusnap-hook with the spec's environment only, so
# gpusnap must import without PYTHONPATH. Where that environment is read-only: a --target dir.
# Byte-compiled at install, as pip does by default: without it every gpusnap, gpusnap-runtime and
# gpusnap-hook process would compile its modules from source where bytecode is not written
# (PYTHONDONTWRITEBYTECODE), which the benchmark would then count.
if ! python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade "$WHEELS"/*.whl; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 5
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
# docker-registry (bench/e2e.py) travels xz-compressed; Python's lzma unpacks it (no xz needed).
if [ -f "$TOOLS/docker-registry.xz" ] && ! command -v docker-registry >/dev/null; then
  mkdir -p /tmp/gs-gpu-bin
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$TOOLS/docker-registry.xz" /tmp/gs-gpu-bin/docker-registry \
    && chmod +x /tmp/gs-gpu-bin/docker-registry
fi
# stage.sh's GS_GPU_AB_REGISTRY: a second registry program; bench/e2e.py compares the pushes to
# both with GS_GPU_E2E_ARGS="--ab-registry /tmp/gs-gpu-bin/ab-registry".
if [ -f "$TOOLS/ab-registry.xz" ]; then
  mkdir -p /tmp/gs-gpu-bin
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$TOOLS/ab-registry.xz" /tmp/gs-gpu-bin/ab-registry \
    && chmod +x /tmp/gs-gpu-bin/ab-registry
fi
export PATH=$TOOLS/bin:$(dirname "$(command -v python3)"):$SITE/bin:/tmp/gs-gpu-bin:$PATH PYTHONUNBUFFERED=1
export GPUSNAP_GPU_TOOLS=$TOOLS   # the device tests (test_gpu_devices.py) find runc there
if [ -f "$TOOLS/containerd2.tar.xz" ] && [ ! -x "$TOOLS/containerd2/bin/containerd" ]; then
  tar -C "$TOOLS" -xJf "$TOOLS/containerd2.tar.xz" || exit 5   # GS_GPU_CRI=1 stage.sh packed it
fi
if [ -x "$TOOLS/containerd2/bin/containerd" ]; then   # for test_gpu_cri.py
  export GPUSNAP_CONTAINERD2_PREFIX=$TOOLS/containerd2 GPUSNAP_REGISTRY_BIN=$TOOLS/containerd2/extra/docker-registry \
    GPUSNAP_BUSYBOX=$TOOLS/containerd2/extra/busybox GPUSNAP_CRI_LOG_DIR=$OUT/cri-logs
fi
export GS_GPU_REPORT=$OUT/suite-rows.jsonl
rm -f "$GS_GPU_REPORT"
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,uuid --format=csv,noheader
  runc --version | head -1
  criu --version | head -1
  python3 -c 'import torch, cuda.bindings, gpusnap; print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda-bindings", cuda.bindings.__version__, "gpusnap", gpusnap.__version__)'
  criu check 2>&1 | tail -1
} 2>&1 | tee "$OUT/env.txt"

cd "$REPO"
SUITE=0 BENCH=0 E2E=0
DEADLINE=0
[ "$BUDGET" -gt 0 ] && DEADLINE=$((START + BUDGET))
if [ "${GS_GPU_E2E_ONLY:-0}" != 1 ]; then
  KEXPR=()
  [ -n "${GS_GPU_K:-}" ] && KEXPR=(-k "$GS_GPU_K")
  python3 -m pytest -p no:cacheprovider -v -rfEs --timeout=400 --junitxml="$OUT/junit.xml" "${KEXPR[@]}" ${GS_GPU_TESTS:-tests/gpu} 2>&1 | tee "$OUT/suite.log"
  SUITE=${PIPESTATUS[0]}
  python3 bench/gpu_checkpoint.py --sizes "${GS_GPU_BENCH_SIZES:-1,8}" --json "$OUT/bench.json" --deadline "$DEADLINE" 2>&1 | tee "$OUT/bench.log"
  BENCH=${PIPESTATUS[0]}
fi
if [ -n "${GS_GPU_E2E:-}" ]; then
  LEFT=0
  [ "$BUDGET" -gt 0 ] && LEFT=$((DEADLINE - $(date +%s) - 15))
  if [ "$BUDGET" -gt 0 ] && [ "$LEFT" -lt 120 ]; then
    echo "run_gpu_suite: ${LEFT} s left of GS_GPU_BUDGET: bench/e2e.py skipped (run it alone: GS_GPU_E2E_ONLY=1)" | tee "$OUT/e2e.log"
  else
    python3 bench/e2e.py --gpu --workloads "$GS_GPU_E2E" --budget "$LEFT" --out "$OUT/e2e" \
      --work "${GS_GPU_E2E_WORK:-/var/tmp/gpusnap-e2e}" --registry-dir /dev/shm/gpusnap-e2e-registry ${GS_GPU_E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log"
    E2E=${PIPESTATUS[0]}
  fi
fi
if [ -n "${GS_GPU_RESTORE_PATH:-}" ]; then
  # The read side alone on this host's cores (issue 12): store, then materialize into /dev/shm
  # and fetch from a local docker-registry into /dev/shm, a synthetic checkpoint of
  # GS_GPU_RESTORE_PATH GiB, with each stage's GB/s, CPU seconds and peak RSS.
  # GS_GPU_RESTORE_PATH_ARGS: more of its options (e.g. "--upper-mib 1024 --staged": as a restore
  # writes it, all but the pages first; "--workers 16": materialize's thread count).
  python3 bench/restore_path.py --gib "$GS_GPU_RESTORE_PATH" --registry --work /var/tmp/gs-restore-path \
    --dest /dev/shm/gs-restore-path ${GS_GPU_RESTORE_PATH_ARGS:-} 2>&1 | tee "$OUT/restore_path.log"
fi
if [ -n "${GS_GPU_LAZY_PROBE:-}" ]; then
  # Whether a CUDA container restores with CRIU's lazy pages (userfaultfd), by hand, and how the
  # timings compare with an eager restore: bench/lazy_pages_probe.py with GS_GPU_LAZY_PROBE GiB.
  python3 bench/lazy_pages_probe.py --gib "$GS_GPU_LAZY_PROBE" --out "$OUT/lazy" ${GS_GPU_LAZY_PROBE_ARGS:-} 2>&1 | tee "$OUT/lazy.log"
fi

echo
echo "== GPU suite ($(head -1 "$OUT/env.txt"))"
python3 - "$OUT/junit.xml" "$GS_GPU_REPORT" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
cases = ET.parse(sys.argv[1]).getroot().iter("testcase") if Path(sys.argv[1]).exists() else []
counts = {}
for c in cases:
    status = "failed" if c.find("failure") is not None or c.find("error") is not None else "skipped" if c.find("skipped") is not None else "passed"
    counts[status] = counts.get(status, 0) + 1
    print(f"  {status:7} {c.get('classname', '').split('.')[-1]}::{c.get('name')} ({float(c.get('time', 0)):.1f} s)")
print("  " + ", ".join(f"{n} {s}" for s, n in counts.items()))
rows = [json.loads(l) for l in Path(sys.argv[2]).read_text().splitlines()] if Path(sys.argv[2]).exists() else []
if rows:
    print("\n| test | GiB | checkpoint s | restore s | lock / GPU→host / CRIU dump s | CRIU restore / host→GPU s | steps compared bit for bit |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        br = " / ".join(str(r.get(k, "")) for k in ("gpu_lock_s", "gpu_to_host_s", "criu_dump_s")) if "gpu_lock_s" in r else ""
        rr = " / ".join(str(r.get(k, "")) for k in ("runc_restore_s", "host_to_gpu_s")) if "runc_restore_s" in r else ""
        print(f"| {r['test']} | {r['gib']} | {r.get('checkpoint_s', '')} | {r.get('restore_s', '')} | {br} | {rr} | {r.get('steps_compared', '')} |")
PY
if [ -f "$OUT/bench.log" ]; then
  echo
  echo "== Benchmark"
  sed -n '/^GPU:/,$p' "$OUT/bench.log"
fi
if [ -f "$OUT/e2e.log" ]; then
  echo
  echo "== End to end (bench/e2e.py)"
  sed -n '/^== floors/,$p' "$OUT/e2e.log"
fi
[ "$SUITE" -ne 0 ] && exit "$SUITE"
[ "$BENCH" -ne 0 ] && exit "$BENCH"
exit "$E2E"
