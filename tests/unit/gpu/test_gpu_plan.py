"""The GPU plan around runc checkpoint/restore, against the driver stand-in: a consistent cut,
metadata, and rollback at every failure point so the container keeps running."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import time

import pytest

from gpusnap.errors import CheckpointError, ExitCode, IncompatibleHostError, RestoreError
from gpusnap.gpu.base import ProcessGpuState
from gpusnap.gpu.plan import CudaPlan, make_gpu_plan
from gpusnap.metadata import CheckpointMetadata
from gpusnap.steps import Step, StepFailed, run_steps, signals_as_exceptions

R, L, C = ProcessGpuState.RUNNING, ProcessGpuState.LOCKED, ProcessGpuState.CHECKPOINTED


def faults(standin, *items):
    (standin.state_dir / "faults.json").write_text(json.dumps(list(items)))


def checkpoint(plan, fake, init, image_dir, *, leave_running, runc=None):
    """What the shim does: the plan's steps around a stand-in for `runc checkpoint`."""
    meta = CheckpointMetadata(container_id="gs-gpu-fake", created="2026-01-01T00:00:00Z")
    ref = fake.container_ref(init)
    seen: dict[str, list[ProcessGpuState]] = {}

    def runc_checkpoint():
        seen["at_dump"] = fake.ns_states(init)  # CRIU needs every CUDA process checkpointed
        if runc is not None:
            runc()
        if not leave_running:
            fake.stop_container(init)

    image_dir.mkdir(parents=True, exist_ok=True)
    with signals_as_exceptions():
        run_steps([*plan.before_dump(ref, image_dir, meta), Step("runc checkpoint", runc_checkpoint), *plan.after_dump(ref, image_dir, meta, leave_running)])
    return meta, seen


@pytest.fixture
def plan(settings):
    p = make_gpu_plan(settings)
    assert isinstance(p, CudaPlan)
    return p


def test_checkpoint_locks_then_checkpoints_all_and_writes_metadata(plan, fake, standin, tmp_path):
    init = fake.start_container(n_cuda=3, mem_mb=300)
    meta, seen = checkpoint(plan, fake, init, tmp_path / "img", leave_running=False)
    assert seen["at_dump"] == [C, C, C]
    calls = [c.split()[0] for c in fake.calls()]
    assert calls == ["lock"] * 3 + ["checkpoint"] * 3, "every process is locked before any is checkpointed"
    saved = CheckpointMetadata.read(tmp_path / "img")
    assert saved is not None and saved.gpu_backend == "standin"
    assert sorted(p.ns_pid for p in saved.processes) == [3, 4, 5]  # 1 is the shell, 2 a plain process
    assert all(p.gpu_memory_bytes == 300 << 20 for p in saved.processes)
    assert [g.name for g in saved.gpus] == ["gpusnap stand-in GPU"]
    assert saved.gpus[0].driver_version and saved.gpus[0].cuda_version
    assert {"gpu_lock", "gpu_checkpoint", "criu_dump", "total"} <= set(saved.timings_s)
    assert not fake.illegal_calls()


def test_leave_running_restores_and_unlocks(plan, fake, tmp_path):
    init = fake.start_container(n_cuda=2)
    meta, seen = checkpoint(plan, fake, init, tmp_path / "img", leave_running=True)
    assert seen["at_dump"] == [C, C]
    assert fake.ns_states(init) == [R, R]
    assert {"gpu_restore", "gpu_unlock"} <= set(meta.timings_s)
    assert not fake.illegal_calls()


def test_container_without_gpu_processes(plan, fake, tmp_path):
    init = fake.start_container(n_cuda=0)
    meta, _ = checkpoint(plan, fake, init, tmp_path / "img", leave_running=False)
    assert meta.processes == [] and meta.gpus == [] and fake.calls() == []


def _crash():
    raise CheckpointError("criu dump failed: (00.1) Error (criu/files-reg.c:1): Can't lookup mount")


def _disk_full():
    raise OSError(errno.ENOSPC, "No space left on device", "/var/lib/img/pages-1.img")


def _signal():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler interrupts this


# Every point where a checkpoint can fail; (faults, runc behaviour, leave_running).
FAILURES = {
    "lock fails on first": ([{"call": "lock", "token": 0}], None, False),
    "lock fails on second": ([{"call": "lock", "token": 1}], None, False),
    "lock timeout on third": ([{"call": "lock", "token": 2, "error": "timeout"}], None, False),
    "checkpoint fails on first": ([{"call": "checkpoint", "token": 0}], None, False),
    "checkpoint fails on third": ([{"call": "checkpoint", "token": 2}], None, False),
    "checkpoint not supported on second": ([{"call": "checkpoint", "token": 1, "error": "not_supported"}], None, False),
    "criu error": ([], _crash, False),
    "disk full": ([], _disk_full, False),
    "signal during dump": ([], _signal, False),
    "criu error with leave-running": ([], _crash, True),
    "restore fails after leave-running dump": ([{"call": "restore", "token": 1}], None, True),
    "unlock fails after leave-running dump": ([{"call": "unlock", "token": 2}], None, True),
}


@pytest.mark.parametrize("name", list(FAILURES))
def test_any_failure_leaves_every_process_running(name, plan, fake, standin, tmp_path):
    init = fake.start_container(n_cuda=3)
    fl, runc, leave = FAILURES[name]
    faults(standin, *[dict(f, token=fake.tokens[f["token"]]) for f in fl])
    with pytest.raises(StepFailed) as info:
        checkpoint(plan, fake, init, tmp_path / "img", leave_running=leave, runc=runc)
    err = info.value
    assert err.exit_code != ExitCode.ROLLBACK_FAILED, str(err)
    assert fake.ns_states(init) == [R, R, R], name
    assert not fake.illegal_calls(), fake.calls()
    assert "\n" not in str(err)
    if "not supported" in name:
        assert err.exit_code == ExitCode.UNSUPPORTED
    if "signal" in name:
        assert "SIGTERM" in str(err)


def test_rollback_that_cannot_finish_says_what_is_left(plan, fake, standin, tmp_path):
    init = fake.start_container(n_cuda=2)
    # CRIU fails, and the driver then refuses to restore the second process every time.
    faults(standin, {"call": "restore", "token": fake.tokens[1], "times": 10})
    with pytest.raises(StepFailed) as info:
        checkpoint(plan, fake, init, tmp_path / "img", leave_running=False, runc=_crash)
    assert info.value.exit_code == ExitCode.ROLLBACK_FAILED
    assert "rollback incomplete" in str(info.value) and "restore" in str(info.value)
    assert fake.ns_states(init) == [R, C]


@pytest.mark.parametrize("env, word", [({"GPUSNAP_STANDIN_MANAGED": "1"}, "managed"), ({"CUDA_VISIBLE_DEVICES": "MIG-4f3a"}, "MIG")])
def test_unsupported_refused_before_anything_changes(plan, fake, tmp_path, env, word):
    init = fake.start_container(n_cuda=2, **env)
    with pytest.raises(StepFailed) as info:
        checkpoint(plan, fake, init, tmp_path / "img", leave_running=False)
    assert info.value.exit_code == ExitCode.UNSUPPORTED and word in str(info.value)
    assert fake.calls() == []


def test_mps_refused_before_anything_changes(plan, fake, tmp_path):
    pipe = tmp_path / "mps"
    pipe.mkdir()
    (pipe / "control").touch()
    daemon = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy("/bin/sleep", daemon)
    import subprocess

    d = subprocess.Popen([str(daemon), "600"])
    try:
        init = fake.start_container(n_cuda=1, CUDA_MPS_PIPE_DIRECTORY=str(pipe))
        with pytest.raises(StepFailed) as info:
            checkpoint(plan, fake, init, tmp_path / "img", leave_running=False)
    finally:
        d.kill()
        d.wait()
    assert info.value.exit_code == ExitCode.UNSUPPORTED and "MPS" in str(info.value)
    assert fake.calls() == []


def test_suspended_container_is_refused(plan, fake, standin, tmp_path):
    init = fake.start_container(n_cuda=1)
    pid = [p for p in fake.pids_in(init) if fake.is_cuda(p)][0]
    standin.lock(pid, 10)
    standin.checkpoint(pid)
    with pytest.raises(StepFailed, match="gpusnap resume"):
        checkpoint(plan, fake, init, tmp_path / "img", leave_running=False)
    assert standin.state(pid) == C


# -- restore -------------------------------------------------------------------------------------


def restore(plan, fake, tokens, image_dir, *, runc_fails=False):
    meta = CheckpointMetadata.read(image_dir)
    steps = [*plan.before_restore(image_dir, meta)]
    box = {}

    def runc_restore():
        if runc_fails:
            raise RestoreError("runc restore failed: criu failed: type RESTORE errno 0")
        box["init"] = fake.start_container(n_cuda=len(tokens), tokens=tokens)

    run_steps([*steps, Step("runc restore", runc_restore)])
    ref = fake.container_ref(box["init"])
    run_steps(plan.after_restore(ref, image_dir, meta))
    return box["init"], meta


def test_checkpoint_then_restore_in_new_pids(plan, fake, standin, tmp_path):
    init = fake.start_container(n_cuda=2)
    old = sorted(fake.pids_in(init))
    checkpoint(plan, fake, init, tmp_path / "img", leave_running=False)
    tokens = list(fake.tokens)
    new_init, meta = restore(make_gpu_plan(plan.settings), fake, tokens, tmp_path / "img")
    assert sorted(fake.pids_in(new_init)) != old
    assert fake.ns_states(new_init) == [R, R]
    timings = json.loads((tmp_path / "img" / "gpusnap-restore.json").read_text())["timings_s"]
    assert {"runc_restore", "gpu_restore", "gpu_unlock", "total"} <= set(timings)
    assert not fake.illegal_calls()


def test_restore_remaps_to_another_gpu_of_the_same_model(plan, fake, standin, tmp_path):
    init = fake.start_container(n_cuda=1)
    checkpoint(plan, fake, init, tmp_path / "img", leave_running=False)
    other = "GPU-0000beef-0000-0000-0000-000000000002"
    (standin.state_dir / "gpus.json").write_text(json.dumps([{"uuid": other}]))
    new_init, meta = restore(make_gpu_plan(plan.settings), fake, list(fake.tokens), tmp_path / "img")
    pid = [p for p in fake.pids_in(new_init) if fake.is_cuda(p)][0]
    assert standin.process_memory(pid) == {other: 100 << 20}
    assert meta.extra["restore_gpu_remap"] == {meta.gpus[0].uuid: other}


@pytest.mark.parametrize(
    "gpus, driver, word",
    [
        ([{"name": "Other GPU"}], None, "same GPU model"),
        ([], None, "none usable"),
        ([{"driver_version": "570.10"}], None, "older"),
        ([{"memory_free_bytes": 1 << 20}], None, "free"),
        ([{"uuid": "GPU-0000beef-0000-0000-0000-000000000002"}], {"remap": False}, "cannot remap"),
        ([{"mig_enabled": True}], None, "MIG"),
    ],
)
def test_restore_refused_before_anything_changes(plan, fake, standin, tmp_path, gpus, driver, word):
    init = fake.start_container(n_cuda=1, mem_mb=500)
    checkpoint(plan, fake, init, tmp_path / "img", leave_running=False)
    (standin.state_dir / "gpus.json").write_text(json.dumps(gpus))
    if driver:
        (standin.state_dir / "driver.json").write_text(json.dumps(driver))
    n_calls = len(fake.calls())
    with pytest.raises(StepFailed) as info:
        restore(make_gpu_plan(plan.settings), fake, list(fake.tokens), tmp_path / "img")
    assert isinstance(info.value.cause, IncompatibleHostError), info.value
    assert info.value.step.startswith("gpu: check") and word in str(info.value)
    assert len(fake.calls()) == n_calls and len(fake.inits) == 1, "runc restore never ran"


def test_restore_missing_process_is_a_clear_error(plan, fake, tmp_path):
    init = fake.start_container(n_cuda=2)
    checkpoint(plan, fake, init, tmp_path / "img", leave_running=False)
    with pytest.raises(StepFailed) as info:
        restore(make_gpu_plan(plan.settings), fake, fake.tokens[:1], tmp_path / "img")
    assert info.value.exit_code == ExitCode.RESTORE_FAILED and "not in the restored container" in str(info.value)


def test_restore_failure_of_driver_is_reported(plan, fake, standin, tmp_path):
    init = fake.start_container(n_cuda=2)
    checkpoint(plan, fake, init, tmp_path / "img", leave_running=False)
    faults(standin, {"call": "restore", "token": fake.tokens[1]})
    with pytest.raises(StepFailed, match="restore of host PID"):
        restore(make_gpu_plan(plan.settings), fake, list(fake.tokens), tmp_path / "img")
    assert not fake.illegal_calls()
