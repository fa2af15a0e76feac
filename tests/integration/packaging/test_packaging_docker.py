"""docker checkpoint → docker-dir artifact → registry → back into docker → `docker start --checkpoint`."""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: docker_checkpoint
from docker_checkpoint import start_from_checkpoint  # noqa: E402
from gs_pkg_containers import COUNTER, files_of, run
from stack.registry import Registry

from gpusnap.packaging import api

pytestmark = pytest.mark.integration
DOCKER = "/usr/bin/docker"  # Debian's client; another one sits earlier on PATH on these hosts
IMAGE = "gpusnap-busybox:latest"


def docker(*args: str, check: bool = True):  # noqa: ANN201
    return run(DOCKER, *args, check=check, timeout=300)


def _count(name: str) -> int:
    p = docker("exec", name, "cat", "/count", check=False)
    return int(p.stdout.strip()) if p.returncode == 0 and p.stdout.strip().isdigit() else 0


def _wait(name: str, at_least: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (c := _count(name)) >= at_least:
            return c
        time.sleep(0.2)
    raise AssertionError(f"docker counter stuck at {_count(name)}")


@pytest.fixture
def docker_counter() -> Iterator[tuple[str, str]]:
    if not Path(DOCKER).exists() or docker("info", check=False).returncode != 0:
        pytest.skip("dockerd not running (tests/host/provision.sh starts it)")
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.skip(f"{IMAGE} missing (tests/host/provision.sh)")
    name = f"gs-pkg-{uuid.uuid4().hex[:8]}"
    try:
        cid = docker("run", "-d", "--name", name, IMAGE, "sh", "-c", COUNTER).stdout.strip()
        yield name, cid
    finally:
        docker("rm", "-f", name, check=False)


def test_docker_checkpoint_round_trip(tmp_path: Path, registry: Registry, docker_counter: tuple[str, str]) -> None:
    name, cid = docker_counter
    before = _wait(name, 3)  # the counter when the checkpoint starts is this or more
    docker("checkpoint", "create", name, "gs-pkg-cp1")
    root = Path(docker("info", "-f", "{{.DockerRootDir}}").stdout.strip())
    checkpoints = root / "containers" / cid / "checkpoints"
    original = files_of(checkpoints / "gs-pkg-cp1")

    store = tmp_path / "store"
    stored = api.store_checkpoint(store, checkpoints / "gs-pkg-cp1", form="docker-dir", ref="gs-pkg/docker")
    assert api.inspect(store, stored.ref).engine["name"] == "docker"
    remote = f"{registry.host}/gs-pkg/docker:v1"
    api.push(store, stored.ref, remote, insecure=True)
    shutil.rmtree(store)
    docker("checkpoint", "rm", name, "gs-pkg-cp1")

    store2 = tmp_path / "store2"
    local = api.pull(store2, remote, insecure=True)
    # docker only restores from its own checkpoint directory (no custom dir on start).
    out = api.materialize_checkpoint(store2, local, checkpoints / "gs-pkg-cp2", form="docker-dir")
    assert files_of(out) == original
    start_from_checkpoint(name, "gs-pkg-cp2")
    first = _wait(name, 1)
    # Continued from the checkpoint, not from 1: at least the value it had when the dump began
    # (read right after the restore, it may still be that value: the counter ticks once a second).
    assert first >= before >= 3
    assert _wait(name, first + 3) >= first + 3
