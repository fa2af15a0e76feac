"""Fixtures for driving gpusnap-runtime under the real engines (podman, dockerd, runc direct)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from stack import proc
from stack.proc import etc_lock, run, wait_for
from stack.shim import DOCKER, DOCKER_IMAGE, PODMAN_IMAGE, RUNC, SHIM, Bundle, Pipes, Shim, busybox_bundle  # noqa: F401 (the tests import them from here)

TAG = "gs-shim"
DAEMON_JSON = Path("/etc/docker/daemon.json")
# The counter appends each value to a file in a bind-mounted host directory: an fd that stays
# open on a host file would be one CRIU cannot dump, so the file is opened per write.
COUNTER = "i=0; while true; do i=$((i+1)); echo $i >> /data/count; echo $i; sleep 0.2; done"

unique = functools.partial(proc.unique, TAG)


def make_shim(base: Path, name: str | None = None) -> Shim:
    return Shim.at(base, name or unique("runtime"))


@pytest.fixture
def shim(tmp_path: Path) -> Shim:
    return make_shim(tmp_path / "shim")


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


def counter_values(data_dir: Path) -> list[int]:
    path = data_dir / "count"
    if not path.exists():
        return []
    return [int(x) for x in path.read_text().split()]


def wait_counting(data_dir: Path, above: int = 0, timeout: float = 30) -> int:
    wait_for(lambda: (counter_values(data_dir) or [0])[-1] > above + 1, f"the counter to pass {above + 1}", timeout)
    return counter_values(data_dir)[-1]


def assert_resumed(data_dir: Path, at_checkpoint: int) -> None:
    """The counter went on from its value at checkpoint: it passed it, and never started over."""
    wait_counting(data_dir, above=at_checkpoint)
    values = counter_values(data_dir)
    assert values[-1] > at_checkpoint
    assert values == list(range(1, len(values) + 1)), f"counter restarted or skipped: {values}"


# ---- dockerd -------------------------------------------------------------------------------

def _dockerd_pid() -> int:
    pid_file = Path("/var/run/docker.pid")
    if pid_file.exists():
        return int(pid_file.read_text().strip())
    return int(run(["pgrep", "-x", "-o", "dockerd"]).stdout.split()[0])


def _edit_runtimes(change: Callable[[dict[str, object]], None]) -> None:
    with etc_lock():
        cfg = json.loads(DAEMON_JSON.read_text()) if DAEMON_JSON.exists() and DAEMON_JSON.stat().st_size else {}
        runtimes = cfg.setdefault("runtimes", {})
        change(runtimes)
        if not runtimes:
            del cfg["runtimes"]
        tmp = DAEMON_JSON.with_name(f".daemon.json.{os.getpid()}")
        tmp.write_text(json.dumps(cfg, indent=2))
        tmp.replace(DAEMON_JSON)
        os.kill(_dockerd_pid(), signal.SIGHUP)


def _docker_runtimes() -> dict[str, object]:
    return json.loads(run([DOCKER, "info", "--format", "{{json .Runtimes}}"]).stdout)


@contextlib.contextmanager
def registered_docker_runtime(base: Path, extra: Mapping[str, str] | None = None) -> Iterator[tuple[str, Shim]]:
    """A dockerd runtime entry named gs-shim-..., pointing at a wrapper under ``base`` with
    ``extra`` GPUSNAP_* settings; removed afterwards."""
    name = unique("rt")
    shim = Shim.at(base, name, extra)
    _edit_runtimes(lambda rts: rts.__setitem__(name, {"path": str(shim.wrapper)}))
    try:
        wait_for(lambda: name in _docker_runtimes(), f"dockerd to load runtime {name}")
        yield name, shim
    finally:
        _edit_runtimes(lambda rts: rts.pop(name, None))


@pytest.fixture
def docker_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Shim]]:
    with registered_docker_runtime(tmp_path_factory.mktemp("rt")) as registered:
        yield registered


@pytest.fixture
def docker_names() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        run([DOCKER, "rm", "-f", name], check=False)


# ---- runc direct ---------------------------------------------------------------------------

def make_bundle(base: Path, args: list[str], data: Path) -> Bundle:
    """A bundle with a static busybox rootfs and ``data`` bind-mounted at /data."""
    return busybox_bundle(base, args, data=data)
