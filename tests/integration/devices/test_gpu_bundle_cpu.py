"""The CPU-host half of tests/gpu/test_gpu_devices.py: the same bundle (overlay of the host's
root, host Python, only NVIDIA_VISIBLE_DEVICES=all) through the same gpusnap-runtime, against a
fake NVIDIA tree. Everything but CUDA itself is checked here: the spec the GPU test gets, the
driver files at their stable paths, the environment, and the linker-cache entry the
createContainer hook writes into a glibc rootfs."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest
from devstack import HOOK, SHIM, make_gpu_shim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))
from gpu_bundle import find_tool, make_bundle, overlay_rootfs, python_dirs, result_line, run_through_shim, tool_path_env  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]

PROBE = r"""
import json, os
lib = "/usr/local/gpusnap/driver/lib"
out = {
    "nodes": sorted(p for p in os.listdir("/dev") if p.startswith("nvidia")),
    "libs": {n: open(os.path.join(lib, n)).read().strip() for n in sorted(os.listdir(lib))},
    "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
    "ld_conf": open("/etc/ld.so.conf.d/000-gpusnap-driver.conf").read().strip(),
    "smi": os.access("/usr/local/gpusnap/driver/bin/nvidia-smi", os.X_OK),
}
print("RESULT " + json.dumps(out), flush=True)
"""


def test_gpu_test_bundle_on_a_fake_tree(tmp_path: Path) -> None:
    shim = make_gpu_shim(tmp_path / "shim")
    runc = find_tool("runc")
    assert runc is not None
    env = {"PATH": tool_path_env(), "GPUSNAP_RUNC": runc, **shim.settings_env(), "GPUSNAP_HOOK": str(HOOK)}
    python = sys.executable
    cid = f"gs-dev-gpucpu-{uuid.uuid4().hex[:8]}"
    with overlay_rootfs(tmp_path / "root", "/") as rootfs:
        bundle = make_bundle(tmp_path, rootfs, [python, "-c", PROBE], ["NVIDIA_VISIBLE_DEVICES=all"], runc=runc, need_dirs=python_dirs(python))
        runc_root = tmp_path / "runc-root"
        runc_root.mkdir()
        proc = run_through_shim(str(SHIM), runc_root, bundle, cid, env, 120)
        assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        result = result_line(proc.stdout)
        spec = json.loads((bundle / "config.json").read_text())
        upper_conf = tmp_path / "root/scratch/upper/etc/ld.so.conf.d/000-gpusnap-driver.conf"
        assert upper_conf.is_file()  # written into the container's layer, not the host's /etc
    assert not Path("/etc/ld.so.conf.d/000-gpusnap-driver.conf").exists()
    assert result["nodes"] == ["nvidia-caps", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidia1", "nvidiactl"]
    assert result["libs"]["libcuda.so.1"] == f"fake libcuda.so {shim.tree.driver_version}"
    assert result["ld_library_path"].split(":")[0] == "/usr/local/gpusnap/driver/lib"
    assert result["ld_conf"] == "/usr/local/gpusnap/driver/lib"
    assert result["smi"] is True
    assert [h["args"][1] for h in spec["hooks"]["createContainer"]] == ["createContainer"]
    assert spec["process"]["args"][0] == python and not any(n["type"] == "network" for n in spec["linux"]["namespaces"])
