"""What `gpusnap install containerd` writes is what the real containerd 2.1 reads: a new v3 file,
and a v2 file (which containerd 2.x migrates), each give the CRI plugin the runtime handler."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from stack.cri import PREFIX, available

pytestmark = pytest.mark.integration
GPUSNAP = str(Path(sys.executable).parent / "gpusnap")


@pytest.mark.parametrize("start", ["", "version = 2\n"])
def test_containerd_2_reads_the_runtime_handler(tmp_path: Path, start: str) -> None:
    if available():
        pytest.skip(available())
    cfg = tmp_path / "config.toml"
    cfg.write_text(start)
    subprocess.run([GPUSNAP, "install", "containerd", "--containerd-config", str(cfg), "--containerd-config-version", "3",
                    "--runtime-path", "/opt/g/gpusnap-runtime", "--hook-path", "/opt/g/gpusnap-hook"], check=True, capture_output=True)
    assert tomllib.loads(cfg.read_text())["version"] == (3 if not start else 2)
    dump = subprocess.run([str(PREFIX / "bin" / "containerd"), "--config", str(cfg), "config", "dump"], check=True, capture_output=True, text=True)
    data = tomllib.loads(dump.stdout)
    handler = data["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["gpusnap"]
    assert handler["runtime_type"] == "io.containerd.runc.v2" and handler["options"]["BinaryName"] == "/opt/g/gpusnap-runtime"
