#!/usr/bin/env bash
# The main job on the embedded default, from a fresh Debian 12 machine, as root:
#   sudo bash scripts/demo.sh [gpusnap demo options]
# Installs what runc-direct needs (runc, busybox-static, CRIU >= 4 in a private prefix), makes
# .venv with gpusnap, and runs `gpusnap demo`: a counter started, checkpointed into the local
# store, deleted, restored from the store and shown counting on. No daemon, no registry.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "demo.sh: CRIU needs root; run: sudo bash scripts/demo.sh" >&2; exit 2; }
GPUSNAP_PROVISION=minimal bash tests/host/provision.sh
[ -x .venv/bin/python ] || python3 -m venv .venv
extra=""
# On a GPU host the CUDA driver's checkpoint API comes through NVIDIA's bindings.
[ -e /dev/nvidiactl ] && extra="[nvidia]"
.venv/bin/python -m pip install -q ".${extra}"
exec .venv/bin/gpusnap demo "$@"
