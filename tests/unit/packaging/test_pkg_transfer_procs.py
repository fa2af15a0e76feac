"""Transfer processes of a restore from a registry (packaging.transfer_procs / transfer_worker): the
rule that picks how many, the blob plan as it crosses to a worker, and what the fetch sees when
a worker fails or dies. Real worker processes; the downloads themselves run against the real
registry in tests/integration/packaging/test_packaging_pipeline.py."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from gpusnap.config import load_settings
from gpusnap.errors import GpusnapError, RegistryError, UsageError
from gpusnap.packaging import transfer_procs
from gpusnap.packaging import layout as lay
from gpusnap.packaging.registry import RegistryClient
from gpusnap.packaging.store import Descriptor


def _blob() -> lay.BlobPlan:
    return lay.BlobPlan(Descriptor("application/octet-stream", "sha256:" + "ab" * 32, 300, {"k": "v"}), [
        lay.Placement("pages-1.img", 0, 0, 100, 100, False, bytes(range(32))),
        lay.Placement("pages-1.img", 4096, 100, 200, 8192, True, None),
    ])


def test_a_blob_plan_crosses_to_a_worker_unchanged() -> None:
    assert lay.BlobPlan.from_wire(_blob().to_wire()) == _blob()


@pytest.mark.parametrize("size, cores, want", [
    (100 << 20, 16, 0),  # a small pull: not worth starting processes
    (4 << 30, 2, 0),  # two cores: the cores are the limit, not the interpreter lock
    (4 << 30, 4, 2),
    (4 << 30, 8, 4),
    (4 << 30, 16, 8),
    (40 << 30, 64, transfer_procs.MAX_PROCESSES),
])
def test_how_many_transfer_processes(size: int, cores: int, want: int) -> None:
    assert transfer_procs.auto_processes(size, cores) == want


@pytest.mark.parametrize("name", ["fetch_processes", "push_processes"])
def test_the_settings_take_auto_or_a_count_and_refuse_the_rest(name: str) -> None:
    var = f"GPUSNAP_{name.upper()}"
    assert getattr(load_settings(env={}), name) is None
    assert getattr(load_settings(env={var: "auto"}), name) is None
    assert getattr(load_settings(env={var: "0"}), name) == 0
    assert getattr(load_settings(env={var: "6"}), name) == 6
    for bad in ("many", "-1", "65"):
        with pytest.raises(UsageError, match=f"{name} must be auto or a whole number"):
            load_settings(env={var: bad})


@pytest.fixture
def dead_port() -> int:
    """A loopback port nothing listens on: every request is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pool(tmp_path: Path, port: int, processes: int = 2) -> tuple[transfer_procs.TransferProcesses, int, list[int]]:
    fd = os.open(tmp_path / "pages-1.img", os.O_RDWR | os.O_CREAT, 0o600)
    got: list[int] = []
    client = RegistryClient(f"127.0.0.1:{port}", insecure=True, retries=1, backoff_s=0.01, timeout_s=5)
    pool = transfer_procs.TransferProcesses(client, "r/x", {"pages-1.img": fd}, processes, on_bytes=got.append,
                                         on_total=got.append, stopped=lambda: False)
    return pool, fd, got


def test_a_workers_error_is_raised_in_the_fetch_as_the_same_kind(tmp_path: Path, dead_port: int) -> None:
    pool, fd, _ = _pool(tmp_path, dead_port)
    try:
        with pytest.raises(RegistryError, match=f"cannot reach registry 127.0.0.1:{dead_port}"):
            pool.run(_blob())
    finally:
        pool.close()
        os.close(fd)
    assert all(w.proc.returncode == 0 for w in pool.workers)  # closed stdin: they finished and exited


def test_a_worker_that_dies_fails_its_blob_and_the_others_carry_on(tmp_path: Path) -> None:
    """A worker killed (OOM) while a blob is out: that blob fails with a one-line error; a blob
    sent afterwards goes to the worker still alive."""
    with socket.socket() as server:  # accepts and never answers: the blob stays out
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        pool, fd, _ = _pool(tmp_path, int(server.getsockname()[1]))
        try:
            errors: list[BaseException] = []

            def one() -> None:
                try:
                    pool.run(_blob())
                except BaseException as exc:  # noqa: BLE001 - looked at below
                    errors.append(exc)

            t = threading.Thread(target=one)
            t.start()
            while not any(w.busy for w in pool.workers):
                pass
            victim = next(w for w in pool.workers if w.busy)
            victim.proc.kill()
            t.join(timeout=30)
            assert not t.is_alive()
            assert len(errors) == 1 and isinstance(errors[0], GpusnapError)
            assert "transfer process ended unexpectedly" in str(errors[0])
            assert victim.dead and sum(not w.dead for w in pool.workers) == 1
        finally:
            pool.close(kill=True)
            os.close(fd)


# ---- the push role ------------------------------------------------------------------------------
@pytest.mark.parametrize("size, cores, want", [
    (None, 16, transfer_procs.PUSH_PROCESSES),  # checkpoint --push: the size is not known yet
    (None, 2, 0),  # two cores: the cores are the limit, not the interpreter lock
    (100 << 20, 16, 0),  # a small push: not worth starting processes
    (4 << 30, 16, transfer_procs.PUSH_PROCESSES),
    (4 << 30, 3, 0),
])
def test_how_many_push_processes(size: int | None, cores: int, want: int) -> None:
    assert transfer_procs.push_processes(size, cores) == want


def test_a_push_workers_error_is_raised_in_the_pusher_as_the_same_kind(tmp_path: Path, dead_port: int) -> None:
    """The worker reads the blob from the store it is given and says what failed in one line;
    the parent raises it as the same error class."""
    from gpusnap.packaging.store import OciStore

    store = OciStore(tmp_path / "store")
    with store.writing():
        digest = store.put_bytes(b"a blob to push")
    client = RegistryClient(f"127.0.0.1:{dead_port}", insecure=True, retries=1, backoff_s=0.01, timeout_s=5)
    got: list[int] = []
    pool = transfer_procs.TransferProcesses(client, "r/x", {}, 2, on_bytes=got.append, on_total=got.append,
                                            stopped=lambda: False, store=str(store.root), nice=5)
    try:
        assert pool.role == "push"
        with pytest.raises(RegistryError, match=f"cannot reach registry 127.0.0.1:{dead_port}"):
            pool.push(Descriptor("application/octet-stream", digest, 14), None)
    finally:
        pool.close()
    assert all(w.proc.returncode == 0 for w in pool.workers)


def test_workers_outlive_the_thread_that_started_them(tmp_path: Path, dead_port: int) -> None:
    """checkpoint --push starts its transfer processes from a short-lived thread: they must
    follow the gpusnap process, not that thread (PR_SET_PDEATHSIG would have killed them when
    it ended), and still end when the process does (the kill -9 test in
    tests/integration/packaging/test_packaging_pipeline.py)."""
    import time

    from gpusnap.packaging.store import OciStore

    store = OciStore(tmp_path / "store")
    client = RegistryClient(f"127.0.0.1:{dead_port}", insecure=True, retries=1, backoff_s=0.01, timeout_s=5)
    made: list[transfer_procs.TransferProcesses] = []

    def start() -> None:
        pool = transfer_procs.TransferProcesses(client, "r/x", {}, 2, on_bytes=lambda n: None, on_total=lambda n: None,
                                                stopped=lambda: False, store=str(store.root), nice=3)
        made.append(pool)
        deadline = time.monotonic() + 30  # until both have read their init line (their nice value says so)
        while time.monotonic() < deadline and any(os.getpriority(os.PRIO_PROCESS, w.proc.pid) != 3 for w in pool.workers):
            time.sleep(0.01)

    t = threading.Thread(target=start)
    t.start()
    t.join()
    pool = made[0]
    try:
        time.sleep(0.3)
        assert all(w.proc.poll() is None for w in pool.workers)
        with pytest.raises(RegistryError, match="cannot reach registry"):
            pool.push(Descriptor("application/octet-stream", "sha256:" + "cd" * 32, 5), None)
    finally:
        pool.close()
    assert all(w.proc.returncode == 0 for w in pool.workers)
