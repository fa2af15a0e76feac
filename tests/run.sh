#!/usr/bin/env bash
# The one command that provisions this machine and runs the test suite:
#   sudo bash tests/run.sh            (all: unit + integration on the real stack)
#   sudo bash tests/run.sh tests/unit (any pytest arguments narrow it)
# It installs the container stack (tests/host/provision.sh), makes .venv with gpusnap and its
# test dependencies, then runs pytest. GPU tests live in tests/gpu/ and run on a GPU machine
# through tests/gpu/run_gpu_suite.sh instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/host/provision.sh
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
export PATH="$PWD/.venv/bin:$PATH"
# The integration suite writes real CRIU images, stores and registries under /tmp: about 7 GB at
# its peak (measured on CI; passed tests' folders are removed as they pass). Say what is free up
# front: a full disk otherwise shows up as hundreds of unrelated errors.
free_gb=$(( $(df --output=avail -k "${TMPDIR:-/tmp}" | tail -1) / 1048576 ))
echo "tests/run.sh: ${free_gb} GB free in ${TMPDIR:-/tmp}"
if [ "$free_gb" -lt 15 ]; then
  echo "tests/run.sh: warning: under 15 GB free in ${TMPDIR:-/tmp}; free space (old pytest folders: ${TMPDIR:-/tmp}/pytest-of-$(id -un)) or set TMPDIR to a larger disk" >&2
fi
set +e
.venv/bin/python -m pytest -p no:cacheprovider -ra ${@:-tests/unit tests/integration}
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure for CI, not a pass.
exit $rc
