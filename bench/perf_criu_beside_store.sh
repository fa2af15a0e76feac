#!/bin/bash
# CRIU's dump alone and beside gpusnap's store, each under system-wide perf: does CRIU's own
# CPU time grow beside the store (interference), or does it wait (scheduling)?
#
#   sudo bash bench/perf_criu_beside_store.sh            on the GPU machine, from a device copy
#   sudo LOCAL=1 bash bench/perf_criu_beside_store.sh    here (gpusnap, runc and CRIU on PATH)
#
# A CPU container of PP_MIB MiB of random memory (bench/workloads/cpu_holder.py), or with
# PP_GPU_GIB a CUDA one holding that many GiB on the GPU (tests/gpu_worker.py, its lines on
# stdout), under `gpusnap run`; PP_ROUNDS rounds of `gpusnap checkpoint --leave-running`, stored after the dump
# (GPUSNAP_STORE_WHILE_DUMPING=0) and beside it (=1) in turn, each under `perf record -a`. Prints,
# per checkpoint, CRIU's dump and the store's seconds, the samples of each command, and CRIU's
# own top symbols. perf travels as PERF_TAR (perf and the libraries it links, from a Debian 12
# linux-perf; default .gpucarry/extra/perf.tar.xz); on the GPU machine CRIU, runc and the wheels
# come from .gpucarry/.gpu-tools and .gpucarry/.whl, as tests/gpu/run_gpu_suite.sh takes them.
#
#   bash bench/perf_criu_beside_store.sh --pack [TAR]   (here) packs this machine's perf and the
#       libraries it links (not libc's) into TAR (default .gpucarry/extra/perf.tar.xz)
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = --pack ]; then
  TAR=${2:-$R/.gpucarry/extra/perf.tar.xz}
  P=$(command -v perf) || { echo "no perf here (apt-get install linux-perf)" >&2; exit 5; }
  D=$(mktemp -d); mkdir -p "$D/perf/lib" "$(dirname "$TAR")"
  cp "$P" "$D/perf/perf"
  for l in $(ldd "$P" | awk '$3 ~ /^\// {print $3}'); do
    case $(basename "$l") in libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*) ;; *) cp -L "$l" "$D/perf/lib/" ;; esac
  done
  tar -C "$D" -cJf "$TAR" perf && rm -rf "$D" && ls -la "$TAR"
  exit
fi
W=/tmp/pp; mkdir -p $W
MIB=${PP_MIB:-6144}; ROUNDS=${PP_ROUNDS:-3}
if [ "${LOCAL:-0}" != 1 ]; then
  T=$R/.gpucarry/.gpu-tools
  [ -x $T/bin/criu ] || tar -C $T -xJf $T/tools.tar.xz || exit 5
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade $R/.gpucarry/.whl/*.whl || exit 5
  export PATH=$T/bin:$(dirname "$(command -v python3)"):$PATH
fi
tar -C $W -xJf ${PERF_TAR:-$R/.gpucarry/extra/perf.tar.xz} || exit 5
perf() { LD_LIBRARY_PATH=$W/perf/lib $W/perf/perf "$@"; }
sysctl -q kernel.kptr_restrict=0 kernel.perf_event_paranoid=-1
perf --version; nproc; uname -r
export GPUSNAP_STORE=/var/tmp/pp-store GPUSNAP_STATE_DIR=/dev/shm/pp-state
PY=$(command -v python3)
gpusnap delete pp1 >/dev/null 2>&1
if [ -n "${PP_GPU_GIB:-}" ]; then
  gpusnap run pp1 --rootfs-overlay / --env NVIDIA_VISIBLE_DEVICES=all --env WORKER_MODE=cuda --env GB=$PP_GPU_GIB \
    --env SLEEP=0.05 --env PYTHONUNBUFFERED=1 -- $PY $R/tests/gpu_worker.py /dev/stdout || exit 6
  READY='^[0-9]'
else
  gpusnap run pp1 --rootfs-overlay / -- $PY $R/bench/workloads/cpu_holder.py --random-mib $MIB --zero-mib 0 --const-mib 0 || exit 6
  READY='^step 3'
fi
for i in $(seq 240); do gpusnap logs pp1 2>/dev/null | grep -q "$READY" && break; sleep 0.5; done
gpusnap logs pp1 | head -1
for i in $(seq $ROUNDS); do for v in 0 1; do
  rm -rf /var/tmp/pp-store
  # Not through perf(): $! must be perf itself, for the SIGINT that ends its recording.
  LD_LIBRARY_PATH=$W/perf/lib $W/perf/perf record -q -a -F 997 -o $W/p-$v-$i.data 2>/dev/null & P=$!
  sleep 0.3
  GPUSNAP_STORE_WHILE_DUMPING=$v gpusnap checkpoint pp1 --leave-running --json > $W/c-$v-$i.json 2>$W/c-$v-$i.err
  kill -INT $P; wait $P 2>/dev/null
  D=$(python3 -c "import json; t=json.load(open('$W/c-$v-$i.json'))['timings_s']; print(t.get('checkpoint: runtime: runc checkpoint'), t.get('store the checkpoint'))")
  perf report -i $W/p-$v-$i.data --no-children --sort comm -n --stdio 2>/dev/null | grep -v '^#' | grep -v '^$' | head -8 > $W/comm-$v-$i.txt
  C=$(grep -E ' (criu|ld-linux-x86-64) *$' $W/comm-$v-$i.txt | awk '{print $3}' | head -1)
  echo "round $i beside=$v: dump, store s: $D; CRIU comm: $C; samples by comm: $(awk '{printf "%s %s; ", $3, $2}' $W/comm-$v-$i.txt)"
  if [ -n "$C" ]; then
    perf report -i $W/p-$v-$i.data --no-children --sort comm,sym -n --stdio 2>/dev/null | grep -v '^#' | grep " $C " | head -10 | sed 's/^/    /'
  fi
done; done
gpusnap delete pp1 >/dev/null 2>&1
