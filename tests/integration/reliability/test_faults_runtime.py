"""Faults injected into gpusnap-runtime's checkpoint and restore, on real runc and CRIU with the
GPU driver stood in for: kill -9 of the runtime at each GPU step, kill -9 of CRIU mid-dump and
mid-restore, and CRIU failing (disk full) after the GPU state was saved.

For each: the container still runs (or is restorable from its last good checkpoint), the
recovery leaves every GPU process RUNNING, the workload keeps making progress, and a retry of
the same operation succeeds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: gpu_harness, gpu_worker
from gpu_harness import Container, Stack, small_tmpfs, standin_stack  # noqa: E402

from gpusnap.checkpoint.recovery import recover  # noqa: E402
from gpusnap.gpu.base import ProcessGpuState  # noqa: E402
from gpusnap.gpu.standin import StandinBackend  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runc"), reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]
R = ProcessGpuState.RUNNING


class RelContainer(Container):
    """The GPU harness's container under this area's name tag (gs-rel)."""

    def __init__(self, stack: Stack, **kw: object) -> None:
        super().__init__(stack, **kw)  # type: ignore[arg-type]
        self.id = f"gs-rel-{uuid.uuid4().hex[:8]}"
        self.dir = stack.base / self.id
        self.bundle = self.dir / "bundle"
        self.rootfs = self.bundle / "rootfs"
        self.data = self.dir / "data"
        self.root = self.dir / "runc-root"
        self.tokens = [f"{self.id}-p{i}" for i in range(self.nprocs)]


@pytest.fixture
def container(stack: Stack):  # type: ignore[no-untyped-def]
    c = RelContainer(stack, gb=0.25, sleep=0.005)
    yield c.start()
    c.cleanup()


CRIU_REAL = shutil.which("criu") or "/usr/local/sbin/criu"
SWRK_PER_CHECKPOINT = SWRK_PER_RESTORE = 2  # measured: test_swrk_count


@pytest.fixture
def criu_stack(tmp_path: Path) -> Stack:
    """A stack whose `criu` records the PID of each `criu swrk` runc starts and holds it for a
    moment before it execs the real CRIU, so the test kills CRIU itself, never racing its end."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "criu").write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = swrk ]; then echo $$ >> {tools}/criu.pids; sleep 1; fi\n'
        f'exec {CRIU_REAL} "$@"\n'
    )
    (tools / "criu").chmod(0o755)
    return standin_stack(tmp_path, tools_bin=str(tools))


@pytest.fixture
def big_container(criu_stack: Stack):  # type: ignore[no-untyped-def]
    c = RelContainer(criu_stack, gb=0.25, sleep=0.005)
    yield c.start()
    c.cleanup()


def _swrk_pids(c: Container) -> list[int]:
    path = Path(c.stack.tools_bin) / "criu.pids"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _kill_criu_when_started(c: Container, nth: int) -> int:
    """Kill the ``nth`` `criu swrk` runc starts from now on (runc first asks CRIU its version
    over swrk, then starts the swrk that dumps or restores)."""
    start = len(_swrk_pids(c))
    _wait(lambda: len(_swrk_pids(c)) >= start + nth, what=f"runc to start CRIU #{nth}")
    pid = _swrk_pids(c)[start + nth - 1]
    os.kill(pid, signal.SIGKILL)
    return pid


def _calls(backend: StandinBackend) -> str:
    path = backend.state_dir / "calls.log"
    return path.read_text() if path.exists() else ""


def _delay(backend: StandinBackend, call: str, seconds: float = 30) -> None:
    backend.state_dir.mkdir(parents=True, exist_ok=True)
    (backend.state_dir / "faults.json").write_text(json.dumps([{"call": call, "token": "*", "error": f"delay:{seconds}"}]))


def _wait(pred, timeout: float = 60, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _ancestors(pid: int) -> set[int]:
    out = set()
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        out.add(pid)
    return out


def _criu_of(parent: int) -> int | None:
    """Our CRIU: a process running criu whose ancestors include ``parent`` (others run CRIU too)."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if b"criu" in cmd and b"swrk" in cmd and parent in _ancestors(int(p.name)):
            return int(p.name)
    return None


def _start(c: Container, op: str, image: Path) -> subprocess.Popen[bytes]:
    if op == "checkpoint":
        args = [*c.runtime, "checkpoint", "--image-path", str(image), c.id]
        return subprocess.Popen(args, env=c.stack.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    c.pipes.append(__import__("gpu_harness").Pipes())
    args = [*c.runtime, "restore", "-d", "--bundle", str(c.bundle), "--image-path", str(image), c.id]
    return subprocess.Popen(args, env=c.stack.env(), **c.pipes[-1].kwargs())


def _progress(c: Container, by: int = 30) -> bool:
    at = c.last_step()
    try:
        c.wait_step(at + by, timeout=60)
    except AssertionError:
        return False
    return True


def _gpu_states(c: Container, backend: StandinBackend) -> list[ProcessGpuState]:
    return [backend.state(p) for p in c.worker_pids()]


def _retry_checkpoint_and_restore(c: Container, backend: StandinBackend, tmp: Path) -> bool:
    img = tmp / f"retry-{uuid.uuid4().hex[:6]}"
    run = c.checkpoint(img)
    assert run.rc == 0, f"retry checkpoint failed: {run.stderr[-800:]}"
    c.delete()
    run = c.restore(img)
    assert run.rc == 0, f"restore of the retried checkpoint failed: {run.stderr[-800:]}"
    return _gpu_states(c, backend) == [R] and _progress(c)


def _record(ledger, name: str, held: bool, lost: int = 0, detail: str = "") -> None:  # type: ignore[no-untyped-def]
    ledger.record("fault", name, tried=1, passed=int(held), lost=lost, detail=detail)


@pytest.mark.parametrize("call", ["lock", "checkpoint"])
def test_kill9_runtime_at_gpu_step_of_checkpoint(container, backend, stack, tmp_path, ledger, call):  # type: ignore[no-untyped-def]
    """SIGKILL while the driver call is in flight: no rollback can run; recovery must."""
    c = container
    _delay(backend, call)
    proc = _start(c, "checkpoint", tmp_path / "img")
    _wait(lambda: f"INJECTED(delay" in _calls(backend), what=f"the {call} call")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    (backend.state_dir / "faults.json").write_text("[]")
    time.sleep(0.5)
    assert c.state()["status"] == "running", "the container must survive its runtime's death"
    left = _gpu_states(c, backend)
    assert _progress(c), "the workload must make progress on the CPU"
    # No manual recovery: the retry finds the operation lock free and heals the leftovers itself.
    held = _retry_checkpoint_and_restore(c, backend, tmp_path)
    healed = json.loads(next((tmp_path).glob("retry-*/gpusnap.json")).read_text())["extra"].get("healed_before_checkpoint", {})
    assert healed == {s.value: n for s, n in {x: left.count(x) for x in left if x != R}.items()}
    _record(ledger, f"kill -9 runtime during GPU {call} (checkpoint)", held, detail=f"retry healed {healed or 'nothing'}")
    assert held


def test_kill9_runtime_while_criu_dumps(container, backend, stack, tmp_path, ledger):  # type: ignore[no-untyped-def]
    """GPU state saved, CRIU dumping, runtime killed: runc and CRIU finish without it (the
    container is dumped and gone, the image complete but without gpusnap.json) or the container
    is still there; either way it must come back and a retry must succeed."""
    c = container
    img = tmp_path / "img"
    proc = _start(c, "checkpoint", img)
    _wait(lambda: _criu_of(proc.pid) is not None or proc.poll() is not None, what="CRIU to start")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    # runc and CRIU were the runtime's children, not killed with it: let them end.
    _wait(lambda: _criu_of(proc.pid) is None and not list(Path("/proc").glob("[0-9]*/task")) == [], timeout=60, what="CRIU to end")
    time.sleep(1)
    state = c.state()
    if state is not None and state["status"] == "running":
        outcome = "container kept running"
        recover(c.id, stack.settings(), root=str(c.root))
    else:
        # Dumped and stopped: the image is the last good checkpoint; restore from it.
        outcome = "restored from the image runc completed"
        c.delete()
        run = c.restore(img)
        assert run.rc == 0, run.stderr[-800:]
        recover(c.id, stack.settings(), root=str(c.root))
    assert _gpu_states(c, backend) == [R]
    assert _progress(c)
    held = _retry_checkpoint_and_restore(c, backend, tmp_path)
    _record(ledger, "kill -9 runtime while CRIU dumps", held, detail=outcome)
    assert held


def test_kill9_criu_mid_dump(big_container, criu_stack, tmp_path, ledger):  # type: ignore[no-untyped-def]
    c = big_container
    backend = StandinBackend(Path(criu_stack.gpu_backend.split(":", 1)[1]))
    proc = _start(c, "checkpoint", tmp_path / "img")
    _kill_criu_when_started(c, nth=SWRK_PER_CHECKPOINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert c.state()["status"] == "running"
    assert _gpu_states(c, backend) == [R], "the runtime must have rolled the GPU back itself"
    assert b"\n" not in err.strip() or err.count(b"gpusnap-runtime:") == 1
    held = _progress(c) and _retry_checkpoint_and_restore(c, backend, tmp_path)
    _record(ledger, "kill -9 CRIU mid-dump", held, detail="runtime rolled back")
    assert held


def test_criu_fails_after_gpu_state_saved(container, backend, stack, tmp_path, ledger):  # type: ignore[no-untyped-def]
    """ENOSPC during the dump: the image dir is a tmpfs far too small for the memory."""
    c = container
    with small_tmpfs(tmp_path / "full", "512k") as img:
        run = c.checkpoint(img)
    assert run.rc != 0 and "rolled back" in run.stderr, run.stderr[-500:]
    log = _calls(backend)
    assert "checkpoint" in log and "restore" in log, "the GPU state was saved and must have been put back"
    assert c.state()["status"] == "running" and _gpu_states(c, backend) == [R]
    held = _progress(c) and _retry_checkpoint_and_restore(c, backend, tmp_path)
    _record(ledger, "ENOSPC during dump (CRIU fails after GPU save)", held, detail="rolled back")
    assert held


def test_kill9_runtime_at_gpu_restore(container, backend, stack, tmp_path, ledger):  # type: ignore[no-untyped-def]
    c = container
    img = tmp_path / "img"
    assert c.checkpoint(img).rc == 0
    c.delete()
    _delay(backend, "restore")
    proc = _start(c, "restore", img)
    _wait(lambda: "INJECTED(delay" in _calls(backend), what="the GPU restore call")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    (backend.state_dir / "faults.json").write_text("[]")
    time.sleep(0.5)
    assert c.state()["status"] == "running", "runc restored the container before the GPU step"
    rec = recover(c.id, stack.settings(), root=str(c.root))
    assert rec.stale_marker_removed, "the dead restore's marker must not outlive it"
    assert _gpu_states(c, backend) == [R]
    held = _progress(c) and _retry_checkpoint_and_restore(c, backend, tmp_path)
    _record(ledger, "kill -9 runtime during GPU restore", held, detail=f"recovered {rec.moved}")
    assert held


def test_kill9_criu_mid_restore(big_container, criu_stack, tmp_path, ledger):  # type: ignore[no-untyped-def]
    c = big_container
    backend = StandinBackend(Path(criu_stack.gpu_backend.split(":", 1)[1]))
    img = tmp_path / "img"
    assert c.checkpoint(img).rc == 0
    c.delete()
    proc = _start(c, "restore", img)
    _kill_criu_when_started(c, nth=SWRK_PER_RESTORE)
    proc.wait(120)
    assert proc.returncode != 0
    assert c.state() is None, "a failed restore leaves nothing half-restored"
    # The last good checkpoint is untouched: restore again from it.
    run = c.restore(img)
    assert run.rc == 0, run.stderr[-800:]
    assert _gpu_states(c, backend) == [R]
    held = _progress(c) and _retry_checkpoint_and_restore(c, backend, tmp_path)
    _record(ledger, "kill -9 CRIU mid-restore", held, detail="restored from the last good checkpoint")
    assert held


def test_second_checkpoint_while_one_runs_is_refused(container, backend, stack, tmp_path, ledger):  # type: ignore[no-untyped-def]
    c = container
    _delay(backend, "checkpoint", 3)
    first = _start(c, "checkpoint", tmp_path / "img1")
    _wait(lambda: "INJECTED(delay" in _calls(backend), what="the first checkpoint's GPU step")
    second = c.checkpoint(tmp_path / "img2")
    assert second.rc != 0 and "another gpusnap checkpoint or restore" in second.stderr, second.stderr[-400:]
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-400:]
    c.delete()
    run = c.restore(tmp_path / "img1")
    assert run.rc == 0, run.stderr[-400:]
    held = _gpu_states(c, backend) == [R] and _progress(c)
    _record(ledger, "second checkpoint while one runs", held, detail="refused by the operation lock; the first completes")
    assert held


def test_swrk_count(big_container, tmp_path):  # type: ignore[no-untyped-def]
    """How many `criu swrk` runc starts per checkpoint and per restore (the kill tests aim at the last)."""
    c = big_container
    n0 = len(_swrk_pids(c))
    assert c.checkpoint(tmp_path / "img").rc == 0
    n1 = len(_swrk_pids(c))
    c.delete()
    assert c.restore(tmp_path / "img").rc == 0
    n2 = len(_swrk_pids(c))
    assert (n1 - n0, n2 - n1) == (SWRK_PER_CHECKPOINT, SWRK_PER_RESTORE)
