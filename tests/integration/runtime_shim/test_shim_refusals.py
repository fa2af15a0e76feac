"""`gpusnap checkpoint` of a podman or docker container that gpusnap-runtime refuses: the
engine's error carries the runtime's reason, and the CLI exits with the runtime's code (10 for
a workload the CUDA checkpoint API cannot take), as it does for runc-direct, not 6 as for a
failed dump. The GPU is the driver stand-in; the engines, the runtime and CRIU are real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpusnap.config import HostPaths
from gpusnap.gpu.procs import container_pids
from gpusnap.gpu.unsupported import nvidia_holdings
from shimstack import DOCKER, DOCKER_IMAGE, PODMAN_IMAGE, Shim, registered_docker_runtime, run, unique, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]

GPUSNAP = str(Path(sys.executable).parent / "gpusnap")
# The shell is the stand-in's CUDA process; a child started without its marker holds a file
# under /dev/nvidia open, as a DataLoader worker forked after CUDA started holds the driver's.
BYSTANDER = ("touch /dev/nvidia-standin0; "
             "env -u GPUSNAP_STANDIN_CUDA sh -c 'exec 7</dev/nvidia-standin0; while true; do sleep 1; done' & "
             "while true; do sleep 1; done")
GPU = {"uuid": "GPU-5e1f0000-0000-0000-0000-000000000001", "name": "NVIDIA H200", "memory_total_bytes": 150 << 30,
       "memory_free_bytes": 150 << 30, "mig_enabled": False, "driver_version": "580.159.04", "cuda_version": "13.0"}


def standin(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    d = tmp_path / "standin"
    d.mkdir()
    (d / "gpus.json").write_text(json.dumps([GPU]))
    return d, {"GPUSNAP_GPU_BACKEND": f"standin:{d}"}


def wait_held(engine: str, name: str) -> None:
    """Until a process of the container holds the stand-in's device file (the shell starts it)."""
    init = int(run([engine, "inspect", "--format", "{{.State.Pid}}", name]).stdout.strip())
    wait_for(lambda: any(nvidia_holdings(Path("/proc"), p)[0] for p in container_pids(HostPaths(), init)), "the file to be held")


def refused(shim: Shim, name: str, engine: str) -> str:
    proc = subprocess.run([GPUSNAP, "checkpoint", name, "--leave-running"], env=shim.env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 10, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    assert f"{engine} could not checkpoint {name}: " in line
    assert "hold NVIDIA device files (/dev/nvidia-standin0)" in line and "nothing was changed" in line
    assert line.endswith("the container was left as it was"), line
    return line


def test_podman_checkpoint_refused_by_the_runtime_exits_10(tmp_path: Path, podman_names: list[str]) -> None:
    calls, extra = standin(tmp_path)
    shim = Shim.at(tmp_path / "shim", unique("runtime"), extra)
    name = unique("podman-refused")
    podman_names.append(name)
    run(["podman", "--runtime", str(shim.wrapper), "run", "-d", "--name", name, "-e", f"GPUSNAP_STANDIN_CUDA={name}",
         PODMAN_IMAGE, "sh", "-c", BYSTANDER], env=shim.env())
    wait_held("podman", name)
    refused(shim, name, "podman")
    assert run(["podman", "inspect", "--format", "{{.State.Status}}", name]).stdout.strip() == "running"
    assert not (calls / "calls.log").exists(), "the driver was not called"


def test_docker_checkpoint_refused_by_the_runtime_exits_10(tmp_path: Path, docker_names: list[str]) -> None:
    calls, extra = standin(tmp_path)
    with registered_docker_runtime(tmp_path / "rt", extra) as (runtime, shim):
        name = unique("docker-refused")
        docker_names.append(name)
        run([DOCKER, "run", "-d", "--runtime", runtime, "--name", name, "-e", f"GPUSNAP_STANDIN_CUDA={name}", DOCKER_IMAGE, "sh", "-c", BYSTANDER])
        wait_held(DOCKER, name)
        refused(shim, name, "docker")
        # containerd pauses a container for its checkpoint: the runtime's rollback thawed it.
        assert run([DOCKER, "inspect", "--format", "{{.State.Status}}", name]).stdout.strip() == "running"
        assert not (calls / "calls.log").exists(), "the driver was not called"
