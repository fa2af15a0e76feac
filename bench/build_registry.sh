#!/usr/bin/env bash
# Builds the CNCF distribution registry v3 (Go >= 1.23) for bench/e2e.py --ab-registry: the same
# registry program as Debian's docker-registry 2.8, a newer release and toolchain. Why: on these
# hosts the 2.8 build (Go 1.19) spends 4.7-8.8 CPU s per GB it receives, mostly in SHA-256 without
# the CPU's SHA extensions, and that CPU runs beside CRIU's dump during `checkpoint --push` to a
# registry on the same host; a v3 build shows how much of the push's cost is that program.
#
#   bash bench/build_registry.sh SRC OUT [VERSION]
#     SRC: a checkout or export of github.com/distribution/distribution at tag v3.0.0 (its
#          modules are vendored: the build needs no network)
#     OUT: the binary to write (e.g. /opt/gpusnap-registry3/registry)
#     VERSION: what its --version says (default: git describe of SRC, else "v3")
# Go comes from Debian's golang-1.24-go (installed here if missing).
set -euo pipefail
SRC=$(realpath "${1:?usage: build_registry.sh SRC OUT}")
OUT=$(realpath -m "${2:?usage: build_registry.sh SRC OUT}")
VERSION=${3:-$(git -C "$SRC" describe --tags 2>/dev/null || echo v3)}
[ -f "$SRC/go.mod" ] && grep -q '^module github.com/distribution/distribution/v3' "$SRC/go.mod" \
  || { echo "build_registry.sh: $SRC is not a distribution v3 source tree (no go.mod of github.com/distribution/distribution/v3)" >&2; exit 2; }
[ -d "$SRC/vendor" ] || { echo "build_registry.sh: $SRC has no vendor/ directory; use a release tag (v3.0.0), whose modules are vendored" >&2; exit 2; }
GO=/usr/lib/go-1.24/bin/go
if [ ! -x "$GO" ]; then
  apt-get install -y -q golang-1.24-go >/dev/null || { echo "build_registry.sh: could not install golang-1.24-go" >&2; exit 5; }
fi
mkdir -p "$(dirname "$OUT")"
cd "$SRC"
# Offline, from vendor/, with the local toolchain; static (no cgo), so it runs on the GPU
# machine's other glibc as well.
GOFLAGS=-mod=vendor GOTOOLCHAIN=local GOPROXY=off CGO_ENABLED=0 GOCACHE=${GOCACHE:-/tmp/gpusnap-gocache} \
  "$GO" build -trimpath -ldflags "-s -w -X github.com/distribution/distribution/v3/version.version=$VERSION" \
  -o "$OUT.tmp" ./cmd/registry
mv "$OUT.tmp" "$OUT"
"$OUT" --version
