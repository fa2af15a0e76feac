"""gpusnap.host.numeric: numpy loaded without OpenBLAS's thread per core."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, os, sys
import gpusnap.packaging.pack  # the store's first numpy import goes through gpusnap.host.numeric
print(json.dumps({"threads": len(os.listdir("/proc/self/task")), "setting": os.environ.get("OPENBLAS_NUM_THREADS")}))
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_store_loads_numpy_without_a_blas_thread_per_core() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    got = _probe(env)
    assert got == {"threads": 1, "setting": "1"}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenBLAS starts no thread of its own anyway")
def test_a_users_own_setting_wins() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"} | {"OPENBLAS_NUM_THREADS": "2"}
    got = _probe(env)
    assert got == {"threads": 2, "setting": "2"}
