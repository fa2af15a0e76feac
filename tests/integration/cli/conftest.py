"""Fixtures that run `gpusnap` as a user would: the installed entry point, in a subprocess,
with its state, store and runc-direct roots in a temporary directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the stack package
from stack.registry import CLI_PORTS, Registry  # noqa: E402

TAG = "gs-cli"
GPUSNAP = str(Path(sys.executable).parent / "gpusnap")
DOCKER = "/usr/bin/docker"  # Debian's client; another docker sits earlier on PATH here


@dataclass
class Gs:
    env: dict[str, str]
    root: Path
    calls: list[list[str]] = field(default_factory=list)

    def __call__(self, *args: str, check: bool = True, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(args))
        proc = subprocess.run([GPUSNAP, *args], capture_output=True, text=True, env={**self.env, **(env or {})}, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"gpusnap {' '.join(args)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}")
        return proc

    def json(self, *args: str) -> object:
        return json.loads(self(*args, "--json").stdout)

    @property
    def store(self) -> Path:
        return Path(self.env["GPUSNAP_STORE"])


def unique(kind: str) -> str:
    return f"{TAG}-{kind}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def gs(tmp_path: Path) -> Iterator[Gs]:
    root = tmp_path / "gs"
    env = dict(os.environ)
    env.update(
        GPUSNAP_RUN_DIR=str(root / "run"),
        GPUSNAP_STATE_DIR=str(root / "state"),
        GPUSNAP_STORE=str(root / "store"),
        GPUSNAP_CONFIG=str(root / "config.toml"),  # absent: defaults + env only
        COLUMNS="80",
    )
    env.pop("DOCKER_HOST", None)
    g = Gs(env=env, root=root)
    yield g
    # Leave nothing behind, whatever the test did: runc-direct containers of this root.
    runc_root = root / "run" / "engine" / "runc"
    if runc_root.is_dir():
        for d in runc_root.iterdir():
            subprocess.run(["runc", "--root", str(runc_root), "delete", "-f", d.name], capture_output=True)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """A real distribution registry (docker-registry) on one of this area's ports: its host:port."""
    with Registry(tmp_path / "registry", CLI_PORTS) as reg:
        yield reg.host


def counter_numbers(text: str) -> list[int]:
    return [int(x) for x in text.split() if x.isdigit()]


COUNTER = "i=0; while true; do echo $i; i=$((i+1)); sleep 0.5; done"


@pytest.fixture
def podman_counter() -> Iterator[str]:
    name = unique("podman")
    subprocess.run(["podman", "run", "--runtime", "runc", "-d", "--name", name, "localhost/gpusnap-busybox:latest", "sh", "-c", COUNTER],
                   check=True, capture_output=True)
    yield name
    for n in (name, name + "-restored"):
        subprocess.run(["podman", "rm", "-f", "-t", "0", n], capture_output=True)


@pytest.fixture
def docker_counter() -> Iterator[str]:
    name = unique("docker")
    subprocess.run([DOCKER, "run", "-d", "--name", name, "gpusnap-busybox:latest", "sh", "-c", COUNTER], check=True, capture_output=True)
    yield name
    for n in (name, name + "-restored"):
        subprocess.run([DOCKER, "rm", "-f", n], capture_output=True)


def wait_parsed(read, parse, at_least: int, timeout: float = 30, interval: float = 0.2):  # type: ignore[no-untyped-def]
    """``parse(read())`` once it has ``at_least`` entries, or as it is when ``timeout`` runs out
    (the caller's assertion then says what was missing)."""
    deadline = time.monotonic() + timeout
    while True:
        got = parse(read())
        if len(got) >= at_least or time.monotonic() > deadline:
            return got
        time.sleep(interval)


def wait_numbers(read, at_least: int, timeout: float = 30) -> list[int]:  # type: ignore[no-untyped-def]
    return wait_parsed(read, counter_numbers, at_least, timeout)


def podman_logs(name: str) -> str:
    p = subprocess.run(["podman", "logs", name], capture_output=True, text=True)
    return p.stdout + p.stderr


def docker_logs(name: str) -> str:
    p = subprocess.run([DOCKER, "logs", name], capture_output=True, text=True)
    return p.stdout + p.stderr


def which_or_skip(name: str) -> str:
    path = shutil.which(name)
    if not path:
        pytest.skip(f"{name} not installed (run tests/host/provision.sh)")
    return path


def delete_all(gs: Gs) -> None:
    """Delete every runc-direct container ``gs`` left (a test's teardown)."""
    containers = gs.root / "run" / "engine" / "containers"
    if containers.is_dir():
        for d in containers.iterdir():
            gs("delete", d.name, check=False)
