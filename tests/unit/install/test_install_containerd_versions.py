"""`gpusnap install containerd` for containerd 2.x (config version 3) and 1.x (version 2): the
version a new file gets, the table each version's CRI plugin reads, idempotence, and the diff
--dry-run prints."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gpusnap.admin import install as core

V3_DEFAULT = """version = 3
root = '/var/lib/containerd'

[plugins]
  [plugins.'io.containerd.cri.v1.runtime']
    enable_selinux = false

    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'

      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes]
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
          runtime_type = 'io.containerd.runc.v2'
"""


def fake_containerd(tmp_path: Path, version_line: str) -> str:
    binary = tmp_path / "bin" / "containerd"
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    binary.chmod(0o755)
    return str(binary)


def options(tmp_path: Path, binary: str = "/nonexistent/containerd", version: int = 0) -> core.InstallOptions:
    paths = core.InstallPaths(containerd_config=tmp_path / "config.toml", containerd_bin=binary)
    return core.InstallOptions("/usr/local/bin/gpusnap-runtime", "/usr/local/bin/gpusnap-hook", "gpusnap", paths, containerd_config_version=version)


def runtime(data: dict, version: int) -> dict:
    plugin = "io.containerd.cri.v1.runtime" if version == 3 else "io.containerd.grpc.v1.cri"
    return data["plugins"][plugin]["containerd"]["runtimes"]["gpusnap"]


@pytest.mark.parametrize("line, version", [
    ("containerd github.com/containerd/containerd/v2 2.1.9+unknown ", 3),
    ("containerd github.com/containerd/containerd/v2 v2.0.4 1a43cb6a", 3),
    ("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3", 2),
])
def test_new_file_gets_the_version_the_installed_containerd_reads(tmp_path: Path, line: str, version: int) -> None:
    opts = options(tmp_path, fake_containerd(tmp_path, line))
    assert core.install("containerd", opts)[0].action == "create"
    data = tomllib.loads(opts.paths.containerd_config.read_text())
    assert data["version"] == version
    assert runtime(data, version) == {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": "/usr/local/bin/gpusnap-runtime"}}
    assert core.install("containerd", opts)[0].action == "unchanged"
    core.uninstall("containerd", opts)
    assert not opts.paths.containerd_config.exists()


def test_no_containerd_installed_means_version_2_unless_asked(tmp_path: Path) -> None:
    assert core.containerd_config_version("/nonexistent/containerd") == 2
    opts = options(tmp_path, version=3)
    core.install("containerd", opts)
    assert tomllib.loads(opts.paths.containerd_config.read_text())["version"] == 3


def test_v3_default_config_kept_byte_for_byte(tmp_path: Path) -> None:
    opts = options(tmp_path, version=2)  # the file's own version wins over the option
    opts.paths.containerd_config.write_text(V3_DEFAULT)
    core.install("containerd", opts)
    text = opts.paths.containerd_config.read_text()
    assert text.startswith(V3_DEFAULT)
    data = tomllib.loads(text)
    assert runtime(data, 3)["options"]["BinaryName"] == "/usr/local/bin/gpusnap-runtime"
    assert data["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["runc"]["runtime_type"] == "io.containerd.runc.v2"
    core.uninstall("containerd", opts)
    assert opts.paths.containerd_config.read_text() == V3_DEFAULT


def test_unknown_version_refused(tmp_path: Path) -> None:
    opts = options(tmp_path)
    opts.paths.containerd_config.write_text("version = 7\n")
    with pytest.raises(core.UsageError, match="config version 7 is not one containerd reads"):
        core.install("containerd", opts)


def test_dry_run_prints_the_diff_and_writes_nothing(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(V3_DEFAULT)
    gpusnap = str(Path(sys.executable).parent / "gpusnap")
    args = [gpusnap, "install", "containerd", "--containerd-config", str(cfg), "--runtime-path", "/opt/g/gpusnap-runtime",
            "--hook-path", "/opt/g/gpusnap-hook"]
    proc = subprocess.run([*args, "--dry-run"], capture_output=True, text=True, check=True)
    assert f"would update {cfg}" in proc.stdout
    assert f"--- {cfg}\n+++ {cfg}\n" in proc.stdout
    assert "+[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.gpusnap]\n" in proc.stdout
    assert '+BinaryName = "/opt/g/gpusnap-runtime"\n' in proc.stdout
    assert cfg.read_text() == V3_DEFAULT
    subprocess.run(args, capture_output=True, text=True, check=True)
    again = subprocess.run([*args, "--dry-run"], capture_output=True, text=True, check=True)
    assert again.stdout.startswith(f"unchanged {cfg}") and "+++" not in again.stdout
