#!/usr/bin/env bash
# Builds what run_gpu_suite.sh needs on a GPU machine that reaches no registry, into DEST:
# a copy of the checkout's tests/, bench/ and pyproject.toml, .gpu-tools/ (CRIU 4.1.1 + runc, docker-registry
# from Debian 13 packages, GPU_TOOLS_SCRIPT builds it) and .whl/ (gpusnap's wheel plus the
# wheels of the dependencies the GPU image lacks: jsonschema, zstandard, pyfastcdc, cryptography,
# pyroute2, docker and theirs). Run it on a Debian
# host with pip; then copy DEST to the GPU machine and run DEST/tests/gpu/run_gpu_suite.sh.
# Where CRIU 4.2 is installed (GS_GPU_CRIU42, default /opt/gpusnap-criu42, which
# tests/host/provision.sh fills) it replaces 4.1.1 in .gpu-tools: the GPU machine has no
# iptables, and only CRIU 4.2 takes the "network-lock skip" gpusnap gives containers without
# network (4.1.1 crashes on it), so only with 4.2 do runc-direct containers checkpoint there.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
DEST=$(realpath -m "${1:?usage: stage.sh DEST [TOOLS_DIR]}")
TOOLS=${2:-}
mkdir -p "$DEST/.whl"
rm -rf "$DEST/tests" "$DEST/bench"
cp -r "$SRC/tests" "$SRC/bench" "$SRC/pyproject.toml" "$DEST/"
# The commit the results belong to (bench/e2e.py reads it: the staged copy is no git checkout).
git -C "$SRC" describe --always --dirty > "$DEST/COMMIT" 2>/dev/null || true
find "$DEST" -name __pycache__ -prune -exec rm -rf {} +
if [ -n "$TOOLS" ]; then
  rm -rf "$DEST/.gpu-tools"; cp -r "$TOOLS" "$DEST/.gpu-tools"
elif [ ! -x "$DEST/.gpu-tools/bin/criu" ]; then
  bash "${GPU_TOOLS_SCRIPT:?set GPU_TOOLS_SCRIPT to make-tools.sh or pass TOOLS_DIR}" "$DEST/.gpu-tools"
fi
CRIU42=${GS_GPU_CRIU42:-/opt/gpusnap-criu42}
if [ -x "$CRIU42/bin/criu" ] && [ -d "$CRIU42/root" ]; then
  # A script rather than a link: copies to the GPU machine may not keep links.
  rm -rf "$DEST/.gpu-tools/prefix" "$DEST/.gpu-tools/criu42" "$DEST/.gpu-tools/bin/criu"
  cp -rL "$CRIU42" "$DEST/.gpu-tools/criu42"
  printf '#!/bin/sh\nexec "$(dirname "$(readlink -f "$0")")/../criu42/bin/criu" "$@"\n' > "$DEST/.gpu-tools/bin/criu"
  chmod +x "$DEST/.gpu-tools/bin/criu"
fi
# With GS_GPU_CRI=1, containerd 2.x for tests/gpu/test_gpu_cri.py, where tests/host/provision.sh
# installed it: containerd, its runc shim, the CRI api.proto, the registry and a static busybox
# its pods' images are made of (the GPU machine has neither), as one xz archive (about 18 MB;
# 80 MB unpacked would not fit the device tool's 64 MiB carry), which run_gpu_suite.sh unpacks;
# and below the wheels of the CRI client (grpcio, grpcio-tools, protobuf: about 9 MB).
CTRD2=${GS_GPU_CONTAINERD2:-/opt/gpusnap-containerd2}
rm -f "$DEST/.gpu-tools/containerd2.tar.xz"
if [ "${GS_GPU_CRI:-0}" = 1 ]; then
  [ -x "$CTRD2/bin/containerd" ] && [ -f "$CTRD2/cri-api/api.proto" ] || { echo "stage.sh: no containerd 2.x in $CTRD2 (run tests/host/provision.sh)" >&2; exit 1; }
  c2=$(mktemp -d); mkdir -p "$c2/containerd2/bin" "$c2/containerd2/extra"
  cp -L "$CTRD2"/bin/containerd "$CTRD2"/bin/containerd-shim-runc-v2 "$c2/containerd2/bin/"
  cp -r "$CTRD2/cri-api" "$c2/containerd2/"
  cp /usr/bin/docker-registry /bin/busybox "$c2/containerd2/extra/"
  # xz -9e: 17.6 MB instead of 21; with the wheels and the checkout it then fits the carry.
  tar -C "$c2" -cf - containerd2 | xz -9e > "$DEST/.gpu-tools/containerd2.tar.xz"
  rm -rf "$c2"
fi
# bench/e2e.py starts a real docker-registry; the GPU machine has none. Debian's binary is Go,
# linked only against glibc (2.36 here; the GPU machine has 2.39). xz-compressed (21 -> 5 MB):
# what travels to the GPU machine is limited; run_gpu_suite.sh unpacks it. With GS_GPU_CRI=1
# the containerd archive above has one already.
rm -f "$DEST/.gpu-tools/bin/docker-registry" "$DEST/.gpu-tools/docker-registry.xz"
if [ "${GS_GPU_CRI:-0}" != 1 ]; then
  xz -9 -c /usr/bin/docker-registry > "$DEST/.gpu-tools/docker-registry.xz"
fi
# With GS_GPU_AB_REGISTRY=BIN a second registry program for bench/e2e.py --ab-registry (a
# distribution v3 build: bench/build_registry.sh), xz-compressed like the first (52 -> 10 MB).
rm -f "$DEST/.gpu-tools/ab-registry.xz"
if [ -n "${GS_GPU_AB_REGISTRY:-}" ]; then
  [ -x "$GS_GPU_AB_REGISTRY" ] || { echo "stage.sh: GS_GPU_AB_REGISTRY=$GS_GPU_AB_REGISTRY is not an executable file (bench/build_registry.sh builds one)" >&2; exit 1; }
  xz -9 -c "$GS_GPU_AB_REGISTRY" > "$DEST/.gpu-tools/ab-registry.xz"
fi
# With GS_GPU_CRI=1 the tools above and containerd together pass the 64 MiB that travels to
# the GPU machine: CRIU 4.2 and runc travel xz-compressed too (about 41 -> 12 MB);
# run_gpu_suite.sh unpacks tools.tar.xz before anything else.
rm -f "$DEST/.gpu-tools/tools.tar.xz"
if [ "${GS_GPU_CRI:-0}" = 1 ]; then
  tar -C "$DEST/.gpu-tools" -cJf "$DEST/.gpu-tools/tools.tar.xz" bin $( [ -d "$DEST/.gpu-tools/criu42" ] && echo criu42 )
  rm -rf "$DEST/.gpu-tools/bin" "$DEST/.gpu-tools/criu42"
fi
rm -f "$DEST"/.whl/gpusnap-*.whl
# setuptools reuses build/lib: a module removed from src/ would otherwise ride along in the wheel.
rm -rf "$SRC/build/lib"
PY=python3; [ -x "$SRC/.venv/bin/python" ] && PY=$SRC/.venv/bin/python
# A checkout's own venv has setuptools and wheel; a clean checkout builds in pip's isolated
# build environment instead (setuptools and wheel from the configured index).
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST/.whl" "$SRC" 2>/dev/null \
  || "$PY" -m pip wheel -q --no-deps -w "$DEST/.whl" "$SRC"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST/.whl" \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  zstandard==0.25.0 pyfastcdc==0.3.1 blake3==1.0.11 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 fastjsonschema==2.22.3 \
  pyroute2==0.9.7 docker==7.2.0 typer==0.28.0
if [ "${GS_GPU_CRI:-0}" = 1 ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST/.whl" \
    grpcio==1.85.3 grpcio-tools==1.85.1 protobuf==7.36.2
fi
du -sh "$DEST"
