"""The NVIDIA backend on a host without the driver, and picking the plan from settings."""

from __future__ import annotations


import pytest

from gpusnap.config import Settings
from gpusnap.errors import ExitCode, MissingDependencyError, UsageError
from gpusnap.gpu.base import NoGpuPlan
from gpusnap.gpu.nvidia import NvidiaBackend, uuid_bytes
from gpusnap.gpu.plan import CudaPlan, NoDriverPlan, make_gpu_plan
from gpusnap.metadata import CheckpointMetadata, GpuInfo, GpuProcess
from gpusnap.steps import StepFailed, run_steps

pytestmark = pytest.mark.skipif(NvidiaBackend().available(), reason="this host has a working NVIDIA driver")


def test_missing_driver_is_a_clear_missing_dependency():
    with pytest.raises(MissingDependencyError) as info:
        NvidiaBackend().lock(1, 10)
    assert info.value.exit_code == ExitCode.MISSING_DEPENDENCY
    msg = str(info.value)
    assert ("cuda-bindings" in msg or "driver" in msg) and "\n" not in msg


def test_explicit_nvidia_backend_refuses_up_front():
    with pytest.raises(MissingDependencyError):
        make_gpu_plan(Settings(gpu_backend="nvidia"))


def test_auto_without_driver_checkpoints_nothing_but_refuses_gpu_restores(tmp_path):
    plan = make_gpu_plan(Settings(gpu_backend="auto"))
    assert isinstance(plan, NoDriverPlan)
    meta = CheckpointMetadata(container_id="c", created="now", gpus=[GpuInfo(0, "GPU-x", "H200", 1)], processes=[GpuProcess(10, 1, 5)])
    with pytest.raises(StepFailed) as info:
        run_steps(plan.before_restore(tmp_path, meta))
    assert info.value.exit_code == ExitCode.INCOMPATIBLE and "GPU host" in str(info.value)
    assert run_steps(plan.before_restore(tmp_path, CheckpointMetadata(container_id="c", created="now"))) == []


def test_plan_choice(tmp_path):
    assert isinstance(make_gpu_plan(Settings(gpu_backend="none")), NoGpuPlan)
    assert isinstance(make_gpu_plan(Settings(gpu_backend=f"standin:{tmp_path}")), CudaPlan)
    with pytest.raises(UsageError, match="standin:<dir>"):
        make_gpu_plan(Settings(gpu_backend="amd"))
    with pytest.raises(UsageError, match="state directory"):
        make_gpu_plan(Settings(gpu_backend="standin:"))


def test_uuid_bytes():
    assert uuid_bytes("GPU-b44ed0df-bdc9-cc37-d890-d6941ad47c31").hex() == "b44ed0dfbdc9cc37d890d6941ad47c31"
    with pytest.raises(ValueError):
        uuid_bytes("GPU-1234")


def test_auto_without_driver_refuses_a_container_that_uses_the_gpu(tmp_path):
    import os
    from pathlib import Path

    from gpusnap.config import HostPaths
    from gpusnap.gpu.base import ContainerRef

    for pid, node in ((100, "/dev/nvidia0"), (101, "/dev/null")):
        (tmp_path / "proc" / str(pid) / "fd").mkdir(parents=True)
        os.symlink(node, tmp_path / "proc" / str(pid) / "fd" / "5")
    plan = make_gpu_plan(Settings(gpu_backend="auto", host=HostPaths(tmp_path)))
    ref = ContainerRef("c", 100, Path("/b"), cgroup_procs=[100, 101])
    with pytest.raises(StepFailed) as info:
        run_steps(plan.before_dump(ref, tmp_path, CheckpointMetadata(container_id="c", created="now")))
    assert info.value.exit_code == ExitCode.MISSING_DEPENDENCY and "host PID(s) 100 " in str(info.value)
    ref.cgroup_procs = [101]
    assert [r.name for r in run_steps(plan.before_dump(ref, tmp_path, CheckpointMetadata(container_id="c", created="now")))] == ["gpu: check for GPU processes"]
