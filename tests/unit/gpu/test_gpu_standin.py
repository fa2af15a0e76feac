"""The driver stand-in enforces the CUDA driver's checkpoint state machine, across processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpusnap.errors import UnsupportedError
from gpusnap.gpu.base import GpuCallError, GpuLockTimeout, ProcessGone, ProcessGpuState
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
