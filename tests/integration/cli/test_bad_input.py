"""Bad input: one line on stderr, the documented exit code, and nothing changed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from gpusnap.errors import ExitCode
from gpusnap.metadata import METADATA_FILE

from .conftest import COUNTER, DOCKER, Gs, unique, wait_numbers

pytestmark = pytest.mark.integration


def one_line_error(proc: subprocess.CompletedProcess[str], code: ExitCode) -> str:
    assert proc.returncode == int(code), (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpusnap: error: ")
    assert "Traceback" not in proc.stderr
    return lines[0]


def snapshot(gs: Gs) -> dict[str, object]:
    """What a failed command must leave as it was: containers of every engine, the store."""
    index = gs.store / "index.json"

    def mine(out: str) -> list[str]:
        # Other areas run containers on this host at the same time: only this area's count.
        return sorted(ln for ln in out.splitlines() if ln.startswith("gs-cli-"))

    return {
        "runc-direct": sorted((r["name"], r["status"]) for r in gs.json("ps")),  # type: ignore[union-attr,index]
        "podman": mine(subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}} {{.Status}}"], capture_output=True, text=True).stdout),
        "docker": mine(subprocess.run([DOCKER, "ps", "-a", "--format", "{{.Names}} {{.State}}"], capture_output=True, text=True).stdout),
        # An empty store made on first use is no change; its tagged checkpoints are what count.
        "store": json.loads(index.read_text()).get("manifests", []) if index.exists() else [],
    }


def test_container_that_does_not_exist(gs: Gs) -> None:
    before = snapshot(gs)
    line = one_line_error(gs("checkpoint", unique("nosuch"), check=False), ExitCode.NOT_FOUND)
    assert "no container" in line and "--engine" in line
    for engine in ("runc-direct", "podman", "docker"):
        one_line_error(gs("checkpoint", unique("nosuch"), "--engine", engine, check=False), ExitCode.NOT_FOUND)
    assert snapshot(gs) == before


def test_engine_not_running(gs: Gs, tmp_path: Path) -> None:
    dead = {"DOCKER_HOST": f"unix://{tmp_path}/dead.sock"}
    before = snapshot(gs)
    line = one_line_error(gs("checkpoint", unique("any"), "--engine", "docker", check=False, env=dead), ExitCode.MISSING_DEPENDENCY)
    assert "not answering" in line and "dead.sock" in line and "start dockerd" in line
    # auto: the other engines are still asked, and the message says docker could not be.
    line = one_line_error(gs("checkpoint", unique("any"), check=False, env=dead), ExitCode.NOT_FOUND)
    assert "not reachable: docker" in line
    line = one_line_error(gs("restore", str(tmp_path / "nope"), check=False), ExitCode.NOT_FOUND)
    assert snapshot(gs) == before


def test_reference_that_does_not_exist(gs: Gs, registry: str) -> None:
    before = snapshot(gs)
    line = one_line_error(gs("restore", f"{registry}/{unique('nosuch')}:v1", "--insecure", check=False), ExitCode.NOT_FOUND)
    assert "nosuch" in line
    assert snapshot(gs) == before


@pytest.fixture
def edited_checkpoint(gs: Gs, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real runc-direct checkpoint on disk whose metadata the test then edits."""
    name = unique("rd")
    gs("run", name, "--", "sh", "-c", COUNTER)
    wait_numbers(lambda: gs("logs", name).stdout, 2)
    out = tmp_path / "ckpt"
    gs("checkpoint", name, "--output", str(out))
    gs("delete", name)
    yield out
    gs("delete", name + "-restored", check=False)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda m: m.update(arch="aarch64"), "taken on aarch64"),
        (lambda m: m.update(gpus=[{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H200", "memory_total_bytes": 150754820096,
                                   "driver_version": "580.159.04"}], gpu_backend="nvidia"), "1x NVIDIA H200"),
    ],
    ids=["arch", "gpu-model"],
)
def test_checkpoint_from_another_host_is_refused(gs: Gs, edited_checkpoint: Path, edit, words: str) -> None:  # type: ignore[no-untyped-def]
    meta_path = edited_checkpoint / METADATA_FILE
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    before = snapshot(gs)
    line = one_line_error(gs("restore", str(edited_checkpoint), "--name", edited_checkpoint.name + "x", check=False), ExitCode.INCOMPATIBLE)
    assert words in line and "matching host" in line
    assert snapshot(gs) == before

    # The same checkpoint stored under a reference: refused before it is unpacked or started.
    from gpusnap.metadata import CheckpointMetadata
    from gpusnap.packaging import api

    ref = f"localhost/{unique('edited')}:v1"
    api.store_checkpoint(gs.store, edited_checkpoint, form="criu-dir", ref=ref, metadata=CheckpointMetadata.from_dict(meta))
    before = snapshot(gs)
    line = one_line_error(gs("restore", ref, check=False), ExitCode.INCOMPATIBLE)
    assert words in line
    assert snapshot(gs) == before
    shutil.rmtree(gs.store, ignore_errors=True)


def test_docker_refuses_tcp_established_and_keeps_running(gs: Gs, docker_counter: str) -> None:
    before = snapshot(gs)
    line = one_line_error(gs("checkpoint", docker_counter, "--tcp-established", check=False), ExitCode.USAGE)
    assert "--tcp-established" in line
    state = subprocess.run([DOCKER, "inspect", "--format", "{{.State.Status}}", docker_counter], capture_output=True, text=True)
    assert state.stdout.strip() == "running"
    assert snapshot(gs) == before


def test_restore_name_taken_changes_nothing(gs: Gs, tmp_path: Path) -> None:
    name = unique("rd")
    gs("run", name, "--", "sh", "-c", COUNTER)
    try:
        out = tmp_path / "ck"
        gs("checkpoint", name, "--output", str(out), "--leave-running")
        before = snapshot(gs)
        line = one_line_error(gs("restore", str(out), "--name", name, check=False), ExitCode.USAGE)
        assert "already has a container named" in line and "--name" in line
        line = one_line_error(gs("restore", str(out), "--name", name + "-x", "--engine", "podman", check=False), ExitCode.USAGE)
        assert "criu-dir checkpoint, which the podman engine cannot restore" in line
        assert snapshot(gs) == before
    finally:
        gs("delete", name, check=False)
