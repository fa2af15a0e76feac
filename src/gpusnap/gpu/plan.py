"""Which GPU plan the runtime shim splices around runc (the GPU work replaces this choice)."""

from __future__ import annotations

from gpusnap.config import Settings
from gpusnap.gpu.base import GpuPlan, NoGpuPlan


def make_gpu_plan(settings: Settings) -> GpuPlan:
    """The plan for ``settings.gpu_backend``; without a GPU backend wired in yet: no GPU steps."""
    return NoGpuPlan()
