"""Fixtures for driving gpusnap-runtime under the real engines (podman, dockerd, runc direct)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TAG = "gs-shim"
SHIM = Path(sys.executable).parent / "gpusnap-runtime"
RUNC = shutil.which("runc", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin") or "/usr/sbin/runc"
DOCKER = "/usr/bin/docker"  # Debian's client; another one sits earlier on PATH on these hosts
PODMAN_IMAGE = "localhost/gpusnap-busybox:latest"
DOCKER_IMAGE = "gpusnap-busybox:latest"
ETC_LOCK = "/run/gpusnap-etc.lock"
DAEMON_JSON = Path("/etc/docker/daemon.json")
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The counter appends each value to a file in a bind-mounted host directory: an fd that stays
# open on a host file would be one CRIU cannot dump, so the file is opened per write.
COUNTER = "i=0; while true; do i=$((i+1)); echo $i >> /data/count; echo $i; sleep 0.2; done"


def unique(kind: str) -> str:
    return f"{TAG}-{kind}-{uuid.uuid4().hex[:8]}"


def run(cmd: list[str], *, check: bool = True, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


@dataclass
class Shim:
    """A wrapper script that sets this test's GPUSNAP_* environment and execs gpusnap-runtime.

    Engines (dockerd above all) do not pass the test's environment on, so the settings travel
    in the script the engine is told to run.
    """

    wrapper: Path
    run_dir: Path
    state_dir: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": HOST_PATH, "GPUSNAP_RUN_DIR": str(self.run_dir), "GPUSNAP_STATE_DIR": str(self.state_dir), "GPUSNAP_CONFIG": "/nonexistent/gpusnap.toml"}


def make_shim(base: Path, name: str | None = None) -> Shim:
    base.mkdir(parents=True, exist_ok=True)
    run_dir, state_dir = base / "run", base / "state"
    wrapper = base / (name or unique("runtime"))
    wrapper.write_text(
        "#!/bin/sh\n"
        f"export PATH={HOST_PATH}\n"
        f"export GPUSNAP_RUN_DIR={run_dir} GPUSNAP_STATE_DIR={state_dir} GPUSNAP_CONFIG=/nonexistent/gpusnap.toml\n"
        f'exec {SHIM} "$@"\n'
    )
    wrapper.chmod(0o755)
    return Shim(wrapper, run_dir, state_dir)


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


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_counting(data_dir: Path, above: int = 0, timeout: float = 30) -> int:
    wait_for(lambda: (counter_values(data_dir) or [0])[-1] > above + 1, f"the counter to pass {above + 1}", timeout)
    return counter_values(data_dir)[-1]


def assert_resumed(data_dir: Path, at_checkpoint: int) -> None:
    """The counter went on from its value at checkpoint: it passed it, and never started over."""
    wait_counting(data_dir, above=at_checkpoint)
    values = counter_values(data_dir)
    assert values[-1] > at_checkpoint
    assert values == list(range(1, len(values) + 1)), f"counter restarted or skipped: {values}"


# ---- podman ------------------------------------------------------------------------------

@pytest.fixture
def podman_names() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        run(["podman", "rm", "-f", "-t", "0", name], check=False)


# ---- dockerd -------------------------------------------------------------------------------

@contextlib.contextmanager
def etc_lock() -> Iterator[None]:
    with open(ETC_LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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


@pytest.fixture
def docker_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Shim]]:
    """A dockerd runtime entry named gs-shim-..., pointing at a wrapper; removed afterwards."""
    name = unique("rt")
    shim = make_shim(tmp_path_factory.mktemp(name), name)
    _edit_runtimes(lambda rts: rts.__setitem__(name, {"path": str(shim.wrapper)}))
    try:
        wait_for(lambda: name in _docker_runtimes(), f"dockerd to load runtime {name}")
        yield name, shim
    finally:
        _edit_runtimes(lambda rts: rts.pop(name, None))


@pytest.fixture
def docker_names() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        run([DOCKER, "rm", "-f", name], check=False)


# ---- runc direct ---------------------------------------------------------------------------

@dataclass
class Bundle:
    path: Path
    root: Path  # runc --root: this test's own state directory
    data: Path


def make_bundle(base: Path, args: list[str], data: Path) -> Bundle:
    """A bundle with a static busybox rootfs and ``data`` bind-mounted at /data."""
    bundle = base / "bundle"
    bin_dir = bundle / "rootfs" / "bin"
    bin_dir.mkdir(parents=True)
    for d in ("data", "proc", "sys", "dev", "tmp"):
        (bundle / "rootfs" / d).mkdir()
    shutil.copy2("/bin/busybox", bin_dir / "busybox")
    for applet in ("sh", "sleep", "echo", "cat", "true", "false"):
        (bin_dir / applet).symlink_to("busybox")
    run([RUNC, "spec"], cwd=bundle)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = args
    spec["root"]["readonly"] = False
    spec["mounts"].append({"destination": "/data", "source": str(data), "type": "bind", "options": ["rbind", "rw"]})
    (bundle / "config.json").write_text(json.dumps(spec, indent=2))
    root = base / "runc-root"
    root.mkdir()
    return Bundle(bundle, root, data)


class Pipes:
    """Pipes for a container's stdio: CRIU restores pipes (not host files) through runc's inherit-fd."""

    def __init__(self) -> None:
        self.stdin_r, self.stdin_w = os.pipe()
        self.out_r, self.out_w = os.pipe()
        os.set_blocking(self.out_r, False)

    def kwargs(self) -> dict[str, int]:
        return {"stdin": self.stdin_r, "stdout": self.out_w, "stderr": self.out_w}

    def close(self) -> None:
        for fd in (self.stdin_r, self.stdin_w, self.out_r, self.out_w):
            with contextlib.suppress(OSError):
                os.close(fd)
