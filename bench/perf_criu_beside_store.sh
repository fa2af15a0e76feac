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
# own top symbols, and how often CRIU left its core, and why (sched_switch: R = preempted, S/D =
# waited). PP_PUSH=1 adds a third way, the store and `--push` to a local docker-registry in
# /dev/shm beside the dump, as bench/e2e.py's `checkpoint --push`. perf travels as PERF_TAR (perf and the libraries it links, from a Debian 12
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
# perf report prints one section per event ("# Samples: N of event 'NAME'"): the cpu-clock one.
clock() { perf report "$@" --stdio 2>/dev/null | awk '/^# Samples: .* of event/ { on = /cpu-clock/ } on && !/^#/ && !/^$/'; }
sysctl -q kernel.kptr_restrict=0 kernel.perf_event_paranoid=-1
perf --version; nproc; uname -r
export GPUSNAP_STORE=/var/tmp/pp-store GPUSNAP_STATE_DIR=/dev/shm/pp-state
PY=$(command -v python3)
gpusnap delete pp1 >/dev/null 2>&1
WAYS="0 1"
if [ "${PP_PUSH:-0}" = 1 ]; then
  REG=$(command -v docker-registry || echo $W/docker-registry)
  [ -x "$REG" ] || python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    $R/.gpucarry/.gpu-tools/docker-registry.xz $REG && chmod +x $REG
  rm -rf /dev/shm/pp-reg; mkdir -p /dev/shm/pp-reg
  printf 'version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: /dev/shm/pp-reg/data\nhttp:\n  addr: 127.0.0.1:5499\n' > /dev/shm/pp-reg/config.yml
  env -u REGISTRY_AUTH_FILE $REG serve /dev/shm/pp-reg/config.yml > $W/registry.log 2>&1 & REGPID=$!
  trap 'kill $REGPID 2>/dev/null' EXIT
  WAYS="0 1 2"
fi
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
for i in $(seq $ROUNDS); do for way in $WAYS; do
  v=$(( way > 0 )); PUSH=()
  [ $way = 2 ] && PUSH=(--push 127.0.0.1:5499/pp/c:$i --insecure)
  rm -rf /var/tmp/pp-store
  # Not through perf(): $! must be perf itself, for the SIGINT that ends its recording.
  # cpu-clock samples what runs; sched_switch every time a task leaves its core (period 1).
  EV="-e cpu-clock -e sched:sched_switch"
  perf list 2>/dev/null | grep -q 'sched:sched_switch' || EV="-e cpu-clock"
  LD_LIBRARY_PATH=$W/perf/lib $W/perf/perf record -q -a -F 997 $EV -o $W/p-$way-$i.data 2>/dev/null & P=$!
  sleep 0.3
  GPUSNAP_STORE_WHILE_DUMPING=$v gpusnap checkpoint pp1 --leave-running "${PUSH[@]}" --json > $W/c-$way-$i.json 2>$W/c-$way-$i.err
  kill -INT $P; wait $P 2>/dev/null
  [ -s $W/c-$way-$i.json ] || { echo "round $i way=$way: the checkpoint failed: $(tail -2 $W/c-$way-$i.err)"; continue; }
  D=$(python3 -c "import json; t=json.load(open('$W/c-$way-$i.json'))['timings_s']; print(*(t.get(k) for k in ('checkpoint: runtime: gpu: checkpoint GPU state to host memory', 'checkpoint: runtime: runc checkpoint', 'store the checkpoint', 'push the checkpoint')))")
  clock -i $W/p-$way-$i.data --no-children --sort comm -n | head -8 > $W/comm-$way-$i.txt
  C=$(grep -E ' (criu|ld-linux-x86-64) *$' $W/comm-$way-$i.txt | awk '{print $3}' | head -1)
  echo "round $i way=$way (0 store after the dump, 1 beside it, 2 beside it + push): gpu ckpt, dump, store, push s: $D; CRIU comm: $C; samples by comm: $(awk '{printf "%s %s; ", $3, $2}' $W/comm-$way-$i.txt)"
  if [ -n "$C" ]; then
    clock -i $W/p-$way-$i.data --no-children --sort comm,sym -n | grep " $C " | head -10 | sed 's/^/    /'
    # How often CRIU left its core: prev_state R = preempted (wanted to run on), else it waited.
    perf script -i $W/p-$way-$i.data -F comm,event,trace 2>/dev/null | awk -v c="$C" '$1 == c && /sched_switch/ {
        st = ""   # "prev_state=S" without the sched_switch plugin of libtraceevent, "S ==>" with it
        for (f = 1; f <= NF; f++) { if ($f ~ /^prev_state=/) { split($f, a, "="); st = a[2] } else if ($f == "==>" && st == "") st = $(f-1) }
        n[st]++ }
      END { printf "    CRIU switched out:"; for (k in n) printf " %s %d", k, n[k]; print "" }'
  fi
done; done
gpusnap delete pp1 >/dev/null 2>&1
