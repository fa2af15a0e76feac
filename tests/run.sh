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
set +e
.venv/bin/python -m pytest -p no:cacheprovider -ra ${@:-tests/unit tests/integration}
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure for CI, not a pass.
exit $rc
