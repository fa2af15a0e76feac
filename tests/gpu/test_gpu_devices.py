"""On a GPU machine: a PyTorch container started through gpusnap-runtime with nothing but
NVIDIA_VISIBLE_DEVICES=all gets the GPU — device nodes, driver libraries and environment all
come from gpusnap's injection — and computes a matmul that agrees with the CPU.

Skipped without /dev/nvidiactl. Parameters (tools folder, Python with torch, ...) are described
in gpu_bundle.py; tests/gpu/run_gpu_suite.sh runs this with the rest of tests/gpu/.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bundle import (  # noqa: E402
    TORCH_PROBE,
    find_hook,
    find_runtime,
    find_tool,
    make_bundle,
    overlay_rootfs,
    python_dirs,
    result_line,
    run_through_shim,
    tool_path_env,
)

PYTHON = os.environ.get("GPUSNAP_GPU_PYTHON", "/opt/torch/.venv/bin/python3")
LOWER = os.environ.get("GPUSNAP_GPU_LOWER", "/")
TIMEOUT = float(os.environ.get("GPUSNAP_GPU_TIMEOUT", "300"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="no NVIDIA GPU here (/dev/nvidiactl missing)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, overlay and tmpfs mounts)"),
]


def test_torch_container_sees_gpu_with_only_nvidia_visible_devices(tmp_path: Path) -> None:
    runc = find_tool("runc")
    runtime = find_runtime()
    if runc is None or runtime is None:
        pytest.fail(f"runc ({runc}) or gpusnap-runtime ({runtime}) not found: set GPUSNAP_GPU_TOOLS / GPUSNAP_RUNTIME")
    if not os.access(PYTHON, os.X_OK):
        pytest.fail(f"{PYTHON} not found: set GPUSNAP_GPU_PYTHON to an interpreter with torch")
    env = {
        "PATH": tool_path_env(),
        "GPUSNAP_RUNC": runc,
        "GPUSNAP_HOOK": find_hook(runtime),
        "GPUSNAP_RUN_DIR": str(tmp_path / "run"),
        "GPUSNAP_STATE_DIR": str(tmp_path / "state"),
        "GPUSNAP_CONFIG": "/nonexistent/gpusnap.toml",
    }
    if os.environ.get("PYTHONPATH"):  # gpusnap installed with pip --target (run_gpu_suite.sh's fallback)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    cid = f"gs-dev-gpu-{uuid.uuid4().hex[:8]}"
    with overlay_rootfs(tmp_path / "root", LOWER) as rootfs:
        bundle = make_bundle(tmp_path, rootfs, [PYTHON, "-c", TORCH_PROBE], ["NVIDIA_VISIBLE_DEVICES=all"],
                             runc=runc, need_dirs=python_dirs(PYTHON))
        given = json.loads((bundle / "config.json").read_text())
        # The bundle itself asks for GPUs and nothing else: no nodes, no driver mounts.
        assert not any(d["path"].startswith("/dev/nvidia") for d in given["linux"].get("devices", []))
        assert not any("nvidia" in m.get("source", "") for m in given["mounts"])
        runc_root = tmp_path / "runc-root"
        runc_root.mkdir()
        proc = run_through_shim(runtime, runc_root, bundle, cid, env, TIMEOUT)
        assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        result = result_line(proc.stdout)
        injected = json.loads((bundle / "config.json").read_text())
    assert result["available"] is True, f"torch.cuda.is_available() is False: {proc.stdout}{proc.stderr}"
    assert result["count"] >= 1
    assert result["ld_library_path"].split(":")[0] == "/usr/local/gpusnap/driver/lib"
    assert result["max_abs_diff"] <= 1e-9 * max(1.0, result["max_abs"]), result
    paths = {d["path"] for d in injected["linux"]["devices"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= paths and any(p[len("/dev/nvidia"):].isdigit() for p in paths)
    assert any(m["destination"] == "/usr/local/gpusnap/driver/lib/libcuda.so.1" for m in injected["mounts"])
