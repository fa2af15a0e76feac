"""A checkpoint that fails after the engine stopped the container leaves it running again,
under its own name, with nothing stored: here the push goes to a registry that is not there."""

from __future__ import annotations

import json
import subprocess

import pytest

from gpusnap.errors import ExitCode

from stack.registry import CLI_PORTS, free_port

from .conftest import COUNTER, Gs, podman_logs, unique, wait_numbers

pytestmark = pytest.mark.integration


def _stored(gs: Gs) -> list[object]:
    index = gs.store / "index.json"
    return json.loads(index.read_text())["manifests"] if index.exists() else []


def test_runc_direct_push_failure_keeps_container_running(gs: Gs) -> None:
    name = unique("rd")
    gs("run", name, "--", "sh", "-c", COUNTER)
    try:
        before = wait_numbers(lambda: gs("logs", name).stdout, 3)
        dead = f"127.0.0.1:{free_port(CLI_PORTS)}/{name}:v1"
        proc = gs("checkpoint", name, "--push", dead, "--insecure", check=False)
        assert proc.returncode == int(ExitCode.REGISTRY), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert "rolled back" in proc.stderr
        [row] = gs.json("ps")  # type: ignore[misc]
        assert row["name"] == name and row["status"] == "running"  # type: ignore[index]
        after = wait_numbers(lambda: gs("logs", name).stdout, len(before) + 3)
        # It went on from where it was dumped: the numbers stay consecutive.
        assert after == list(range(after[0], after[0] + len(after)))
        assert _stored(gs) == []
    finally:
        gs("delete", name, check=False)


def test_podman_push_failure_keeps_container_running(gs: Gs, podman_counter: str) -> None:
    before = wait_numbers(lambda: podman_logs(podman_counter), 3)
    dead = f"127.0.0.1:{free_port(CLI_PORTS)}/{podman_counter}:v1"
    proc = gs("checkpoint", podman_counter, "--push", dead, "--insecure", check=False)
    assert proc.returncode == int(ExitCode.REGISTRY), proc.stderr
    state = subprocess.run(["podman", "inspect", "--format", "{{.State.Status}}", podman_counter], capture_output=True, text=True)
    assert state.stdout.strip() == "running"
    after = wait_numbers(lambda: podman_logs(podman_counter), len(before) + 3)
    assert max(after) > max(before)
    assert _stored(gs) == []
