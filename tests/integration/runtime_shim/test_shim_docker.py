"""dockerd (containerd's runc v2 shim calling gpusnap-runtime): checkpoint create, start --checkpoint."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: docker_checkpoint
from docker_checkpoint import start_from_checkpoint  # noqa: E402
from shimstack import COUNTER, DOCKER, DOCKER_IMAGE, Shim, assert_resumed, counter_values, run, unique, wait_counting

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]


def test_checkpoint_create_start_checkpoint_twice(docker_runtime: tuple[str, Shim], data_dir: Path, docker_names: list[str]) -> None:
    runtime, shim = docker_runtime
    name = unique("docker")
    docker_names.append(name)
    run([DOCKER, "run", "-d", "--runtime", runtime, "--name", name, "-v", f"{data_dir}:/data", DOCKER_IMAGE, "sh", "-c", COUNTER])
    wait_counting(data_dir, above=2)
    cid = run([DOCKER, "inspect", "--format", "{{.Id}}", name]).stdout.strip()
    assert "link-remap" in (shim.run_dir / "criu" / f"{cid}.conf").read_text().split()

    for cycle in (1, 2):
        run([DOCKER, "checkpoint", "create", name, f"cp{cycle}"])
        at_checkpoint = counter_values(data_dir)[-1]
        assert run([DOCKER, "inspect", "--format", "{{.State.Running}}", name]).stdout.strip() == "false"
        start_from_checkpoint(name, f"cp{cycle}")
        assert_resumed(data_dir, at_checkpoint)
        assert run([DOCKER, "inspect", "--format", "{{.State.Running}}", name]).stdout.strip() == "true"

