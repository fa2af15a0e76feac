"""Running host commands from tests: one subprocess helper, unique names, polling, and the lock
taken around host-wide engine configuration (``/etc/containers``, ``/etc/docker/daemon.json``)."""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator

HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Suites that edit the engines' host configuration (and reload the engine) take this lock, so
# parallel runs never reload an engine in the middle of another's edit.
ETC_LOCK = "/run/gpusnap-etc.lock"


def unique(tag: str, kind: str) -> str:
    """A name no other test uses: ``<tag>-<kind>-<8 hex digits>`` (the tag names the suite)."""
    return f"{tag}-{kind}-{uuid.uuid4().hex[:8]}"


def run(cmd: list[str], *, check: bool = True, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with its output captured as text; with ``check``, a failure is an
    AssertionError that shows the command and both outputs."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.contextmanager
def etc_lock() -> Iterator[None]:
    with open(ETC_LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
