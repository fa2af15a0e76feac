"""Suspend/resume moves: all of a container's GPU processes together, or none."""

from __future__ import annotations

import json

import pytest

from gpusnap.config import HostPaths
from gpusnap.errors import GpusnapError
from gpusnap.gpu.base import ProcessGpuState
from gpusnap.gpu.group import GpuGroup
from gpusnap.steps import Step, StepFailed, run_steps

R, L, C = ProcessGpuState.RUNNING, ProcessGpuState.LOCKED, ProcessGpuState.CHECKPOINTED


def suspend_steps(g: GpuGroup):
    return [Step("lock", lambda: g.lock_all(50), g.ensure_running), Step("checkpoint", g.checkpoint_all, g.ensure_not_checkpointed)]


def resume_steps(g: GpuGroup):
    return [Step("restore", g.restore_all, g.ensure_checkpointed), Step("unlock", g.unlock_all)]


def test_suspend_frees_gpu_memory_and_resume_gives_it_back(fake, standin):
    init = fake.start_container(n_cuda=2, mem_mb=256)
    g = GpuGroup.of_container(standin, HostPaths(), init)
    run_steps(suspend_steps(g))
    assert fake.ns_states(init) == [C, C]
    assert all(standin.process_memory(p) == {} for p in g.pids)
    g2 = GpuGroup.of_container(standin, HostPaths(), init, expect=C)
    run_steps(resume_steps(g2))
    assert fake.ns_states(init) == [R, R]
    assert sum(sum(standin.process_memory(p).values()) for p in g.pids) == 512 << 20


@pytest.mark.parametrize("call, idx", [("lock", 1), ("checkpoint", 0), ("checkpoint", 1)])
def test_failed_suspend_leaves_all_running(fake, standin, call, idx):
    init = fake.start_container(n_cuda=2)
    (standin.state_dir / "faults.json").write_text(json.dumps([{"call": call, "token": fake.tokens[idx]}]))
    g = GpuGroup.of_container(standin, HostPaths(), init)
    with pytest.raises(StepFailed):
        run_steps(suspend_steps(g))
    assert fake.ns_states(init) == [R, R]


@pytest.mark.parametrize("call, idx", [("restore", 1), ("unlock", 1)])
def test_failed_resume_leaves_all_suspended(fake, standin, call, idx):
    init = fake.start_container(n_cuda=2)
    g = GpuGroup.of_container(standin, HostPaths(), init)
    run_steps(suspend_steps(g))
    (standin.state_dir / "faults.json").write_text(json.dumps([{"call": call, "token": fake.tokens[idx]}]))
    g2 = GpuGroup.of_container(standin, HostPaths(), init, expect=C)
    with pytest.raises(StepFailed):
        run_steps(resume_steps(g2))
    assert fake.ns_states(init) == [C, C]
    assert not fake.illegal_calls()


def test_resume_of_a_running_container_is_refused(fake, standin):
    init = fake.start_container(n_cuda=1)
    with pytest.raises(GpusnapError, match="running, expected checkpointed"):
        GpuGroup.of_container(standin, HostPaths(), init, expect=C)
