"""On a GPU machine: `gpusnap demo --gpu --json`, the README's one command, with a real CUDA
workload — checkpoint into the local store with the GPU timing breakdown, delete, restore, and
every checksum equal to a fresh reference run's.

Skipped without /dev/nvidiactl. GPUSNAP_GPU_PYTHON names the interpreter with torch
[/opt/torch/.venv/bin/python3]; tests/gpu/run_gpu_suite.sh runs this with the rest of tests/gpu/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PYTHON = os.environ.get("GPUSNAP_GPU_PYTHON", "/opt/torch/.venv/bin/python3")
SHM = Path("/dev/shm")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="no NVIDIA GPU here (/dev/nvidiactl missing)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, CRIU, overlay and tmpfs mounts)"),
]


def gpusnap() -> str:
    beside = Path(sys.executable).parent / "gpusnap"
    found = str(beside) if beside.is_file() else shutil.which("gpusnap")
    if not found:
        pytest.fail("gpusnap not found beside this Python or on PATH; install the wheel (run_gpu_suite.sh does)")
    return found


def mounts_under(root: Path) -> list[str]:
    return [ln.split()[1] for ln in Path("/proc/self/mounts").read_text().splitlines() if ln.split()[1].startswith(str(root))]


@pytest.fixture
def roots(tmp_path: Path) -> Iterator[dict[str, str]]:
    # Checkpoint images are as big as the GPU state: keep them in memory, as the other GPU tests do.
    base = (SHM if SHM.is_dir() else tmp_path) / f"gs-demo-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "GPUSNAP_RUN_DIR": str(tmp_path / "run"),
        "GPUSNAP_STATE_DIR": str(base / "state"),
        "GPUSNAP_STORE": str(base / "store"),
        "GPUSNAP_CONFIG": "/nonexistent/gpusnap.toml",
    }
    yield env
    containers = tmp_path / "run" / "engine" / "containers"
    if containers.is_dir():  # only when the demo failed half-way
        for d in containers.iterdir():
            subprocess.run([gpusnap(), "delete", d.name], env=env, capture_output=True, check=False)
    for m in sorted(mounts_under(tmp_path), reverse=True):
        subprocess.run(["umount", "-l", m], check=False)
    shutil.rmtree(base, ignore_errors=True)


def test_gpu_demo_resumes_bit_exact(roots: dict[str, str], tmp_path: Path, report) -> None:  # type: ignore[no-untyped-def]
    if not os.access(PYTHON, os.X_OK):
        pytest.fail(f"{PYTHON} not found: set GPUSNAP_GPU_PYTHON to an interpreter with torch")
    name = f"gs-demo-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    proc = subprocess.run([gpusnap(), "demo", "--gpu", "--json", "--name", name, "--python", PYTHON],
                          env=roots, capture_output=True, text=True, timeout=300, check=False)
    wall = time.monotonic() - started
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result = json.loads(proc.stdout)
    t = result["gpu_timings_s"]
    report(test="gpu_demo", gib=result["gib"], checkpoint_s=t.get("total"), restore_s=result["restore_s"],
           gpu_lock_s=t.get("lock"), gpu_to_host_s=t.get("gpu_to_host"), criu_dump_s=t.get("criu_dump"),
           steps_compared=result["steps_compared"], demo_wall_s=round(wall, 1))
    assert result["mode"] == "gpu"
    # The GPU step timings, from the checkpoint's gpusnap.json.
    assert {"lock", "gpu_to_host", "criu_dump"} <= set(t), t
    assert t["gpu_to_host"] > 0 and t["criu_dump"] > 0 and t["lock"] >= 0
    assert result["gpu_memory_bytes"] >= 1 << 30  # the 1 GiB tensor was part of the checkpoint
    # Continued at the next step, every checksum equal to the reference run's.
    assert result["resumed"] is True and result["resumed_at"] == result["stopped_at"] + 10
    assert result["values_matched"] is True and result["mismatched_steps"] == []
    assert result["steps_after_restore"] >= 3 and result["steps_compared"] >= 6
    # Nothing left behind: no container, no mount, nothing in the store.
    ps = subprocess.run([gpusnap(), "ps", "--json"], env=roots, capture_output=True, text=True, check=True)
    assert json.loads(ps.stdout) == []
    assert mounts_under(tmp_path) == []
    index = Path(roots["GPUSNAP_STORE"]) / "index.json"
    assert not index.exists() or json.loads(index.read_text())["manifests"] == []
