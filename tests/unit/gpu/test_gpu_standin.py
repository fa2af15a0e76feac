"""The driver stand-in enforces the CUDA driver's checkpoint state machine, across processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpusnap.errors import UnsupportedError
from gpusnap.gpu.base import GpuCallError, GpuLockTimeout, ProcessGone, ProcessGpuState
from gpusnap.gpu.procs import exited
from gpusnap.gpu.standin import StandinBackend

R, L, C = ProcessGpuState.RUNNING, ProcessGpuState.LOCKED, ProcessGpuState.CHECKPOINTED


def test_full_cycle(fake, standin):
    pid = fake.spawn()
    assert standin.state(pid) == R
    standin.lock(pid, 100)
    assert standin.state(pid) == L
    standin.checkpoint(pid)
    assert standin.state(pid) == C
    assert standin.process_memory(pid) == {}
    standin.restore(pid)
    assert standin.state(pid) == L
    standin.unlock(pid)
    assert standin.state(pid) == R
    assert standin.process_memory(pid) == {standin.describe()[0].uuid: 100 << 20}


@pytest.mark.parametrize(
    "setup, call",
    [
        ([], "checkpoint"),
        ([], "restore"),
        ([], "unlock"),
        (["lock"], "lock"),
        (["lock"], "restore"),
        (["lock", "checkpoint"], "unlock"),
        (["lock", "checkpoint"], "checkpoint"),
        (["lock", "checkpoint"], "lock"),
    ],
)
def test_illegal_transitions_are_refused_and_change_nothing(fake, standin, setup, call):
    pid = fake.spawn()
    for s in setup:
        getattr(standin, s)(pid, 100) if s == "lock" else getattr(standin, s)(pid)
    before = standin.state(pid)
    with pytest.raises(GpuCallError, match="ILLEGAL_STATE"):
        getattr(standin, call)(pid, 100) if call == "lock" else getattr(standin, call)(pid)
    assert standin.state(pid) == before


def test_non_cuda_process_is_not_initialized(fake, standin):
    pid = fake.spawn(cuda=False)
    assert standin.find_processes([pid]) == []
    with pytest.raises(GpuCallError, match="NOT_INITIALIZED"):
        standin.lock(pid, 100)


def test_gone_process(fake, standin):
    pid = fake.spawn()
    fake.procs[0].kill()
    fake.procs[0].wait()
    with pytest.raises(ProcessGone):
        standin.lock(pid, 100)


def test_exited_process_not_reaped_yet_is_gone(fake, standin, tmp_path):
    """A process that ended between the scan and the call but is not reaped (a zombie: no
    environment left) is gone, as the real driver reports it, not "not initialized"."""
    pid = fake.spawn()
    assert standin.state(pid) == R
    fake.procs[0].kill()
    for _ in range(200):  # until the kernel has it as a zombie (the test holds off the reaping)
        stat = open(f"/proc/{pid}/stat").read()
        if stat.rpartition(")")[2].split()[0] == "Z":
            break
        __import__("time").sleep(0.01)
    assert exited(standin.host.proc, pid)
    with pytest.raises(ProcessGone):
        standin.state(pid)
    fake.procs[0].wait()
    assert exited(standin.host.proc, pid)
    live = fake.spawn(cuda=False)
    assert not exited(standin.host.proc, live)  # alive without CUDA: still "not initialized"
    with pytest.raises(GpuCallError, match="NOT_INITIALIZED"):
        standin.state(live)
    odd = tmp_path / "proc" / "77"
    odd.mkdir(parents=True)
    (odd / "stat").write_text("77 (a) b) Z 1 77")  # a comm with ") " in it
    assert exited(tmp_path / "proc", 77)
    (odd / "stat").write_text("77 (a) b) S 1 77")
    assert not exited(tmp_path / "proc", 77)


def test_injected_lock_timeout_leaves_running(fake, standin):
    pid = fake.spawn()
    (standin.state_dir / "faults.json").write_text(json.dumps([{"call": "lock", "error": "timeout"}]))
    with pytest.raises(GpuLockTimeout):
        standin.lock(pid, 20)
    assert standin.state(pid) == R
    standin.lock(pid, 20)  # the fault was used up
    assert standin.state(pid) == L


def test_injected_failure_targets_one_token(fake, standin):
    a, b = fake.spawn(), fake.spawn()
    (standin.state_dir / "faults.json").write_text(json.dumps([{"call": "lock", "token": fake.tokens[1], "error": "failed", "times": 2}]))
    standin.lock(a, 20)
    for _ in range(2):
        with pytest.raises(GpuCallError, match="injected"):
            standin.lock(b, 20)
    standin.lock(b, 20)


def test_managed_memory_checkpoint_not_supported_leaves_locked(fake, standin):
    pid = fake.spawn(GPUSNAP_STANDIN_MANAGED="1")
    assert "managed" in (standin.unsupported_reason(pid) or "")
    standin.lock(pid, 20)
    with pytest.raises(UnsupportedError, match="NOT_SUPPORTED"):
        standin.checkpoint(pid)
    assert standin.state(pid) == L


def test_state_is_shared_between_processes_and_follows_the_token(fake, standin, tmp_path):
    """Another OS process sees the same state; a new process with the same token (as after CRIU restore) too."""
    pid = fake.spawn()
    code = (
        "import sys; from pathlib import Path; from gpusnap.gpu.standin import StandinBackend as S;"
        "b=S(Path(sys.argv[1])); p=int(sys.argv[2]); b.lock(p, 50); b.checkpoint(p)"
    )
    subprocess.run([sys.executable, "-c", code, str(standin.state_dir), str(pid)], check=True)
    assert StandinBackend(standin.state_dir).state(pid) == C
    fake.procs[0].kill()
    fake.procs[0].wait()
    reborn = fake.spawn(token=fake.tokens[0])
    assert reborn != pid
    assert standin.state(reborn) == C
    standin.restore(reborn)
    standin.unlock(reborn)
    assert standin.state(reborn) == R


def test_remap_needs_every_checkpointed_gpu(fake, standin):
    (standin.state_dir / "gpus.json").write_text(json.dumps([{"uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000001"}, {"uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000002"}]))
    pid = fake.spawn()
    standin.lock(pid, 20)
    standin.checkpoint(pid)
    with pytest.raises(GpuCallError, match="missing from the remap"):
        standin.restore(pid, {"GPU-ffffffff-0000-0000-0000-000000000009": "GPU-aaaaaaaa-0000-0000-0000-000000000002"})
    assert standin.state(pid) == C
    standin.restore(pid, {"GPU-aaaaaaaa-0000-0000-0000-000000000001": "GPU-aaaaaaaa-0000-0000-0000-000000000002"})
    standin.unlock(pid)
    assert standin.process_memory(pid) == {"GPU-aaaaaaaa-0000-0000-0000-000000000002": 100 << 20}


def test_no_remap_on_old_driver(fake, standin):
    (standin.state_dir / "driver.json").write_text(json.dumps({"remap": False}))
    pid = fake.spawn()
    standin.lock(pid, 20)
    standin.checkpoint(pid)
    with pytest.raises(UnsupportedError, match="580"):
        standin.restore(pid, {"a": "b"})


def _cgroup_tree(tmp_path, pid: int, v2_frozen: str | None = None, v1_state: str | None = None):
    from gpusnap.config import HostPaths

    host = HostPaths(tmp_path / "host")
    (host.proc / str(pid)).mkdir(parents=True)
    lines = []
    if v1_state is not None:
        lines.append("7:freezer:/ctr/a")
        (host.sys / "fs/cgroup/freezer/ctr/a").mkdir(parents=True)
        (host.sys / "fs/cgroup/freezer/ctr/a/freezer.state").write_text(v1_state + "\n")
    if v2_frozen is not None:
        lines.append("0::/ctr/a")
        (host.sys / "fs/cgroup/ctr/a").mkdir(parents=True)
        (host.sys / "fs/cgroup/ctr/a/cgroup.events").write_text(f"populated 1\nfrozen {v2_frozen}\n")
    (host.proc / str(pid) / "cgroup").write_text("\n".join(lines) + "\n")
    return host


@pytest.mark.parametrize(("v2", "v1", "expected"), [("1", None, True), ("0", None, False), (None, "FROZEN", True),
                                                    (None, "FREEZING", True), (None, "THAWED", False)])
def test_frozen_reads_the_cgroup_freezer(tmp_path, v2, v1, expected):
    from gpusnap.gpu.standin import frozen

    assert frozen(_cgroup_tree(tmp_path, 77, v2, v1), 77) is expected


def test_calls_on_a_frozen_process_fail_instead_of_hanging(fake, standin):
    """The real driver's calls wait for ever on a frozen process: the stand-in refuses them.
    The process is frozen for real, in a cgroup of its own (v1 freezer, or v2 cgroup.freeze)."""
    import os
    import time
    from pathlib import Path

    from gpusnap.config import HostPaths
    from gpusnap.gpu.standin import frozen

    if os.geteuid() != 0:
        pytest.skip("needs root (cgroups)")
    pid = fake.spawn()
    v1 = Path("/sys/fs/cgroup/freezer")
    if (v1 / "cgroup.procs").exists():
        home, sub, knob, on, off = v1, v1 / f"gs-standin-freeze-{os.getpid()}", "freezer.state", "FROZEN", "THAWED"
    elif Path("/sys/fs/cgroup/cgroup.controllers").exists():
        rel = Path(f"/proc/{pid}/cgroup").read_text().split("0::", 1)[1].splitlines()[0].strip("/")
        home = Path("/sys/fs/cgroup") / rel
        sub, knob, on, off = home.parent / f"gs-standin-freeze-{os.getpid()}", "cgroup.freeze", "1", "0"
    else:
        pytest.skip("no cgroup freezer here")
    sub.mkdir()
    try:
        (sub / "cgroup.procs").write_text(str(pid))
        (sub / knob).write_text(on)
        deadline = time.monotonic() + 5
        while not frozen(HostPaths(), pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(GpuCallError, match="frozen"):
            standin.lock(pid, 100)
        with pytest.raises(GpuCallError, match="frozen"):
            standin.state(pid)
        (sub / knob).write_text(off)
        while frozen(HostPaths(), pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert standin.state(pid) == R
        standin.lock(pid, 100)
        assert standin.state(pid) == L
    finally:
        (sub / knob).write_text(off)
        (home / "cgroup.procs").write_text(str(pid))
        sub.rmdir()
