"""Restore's host check: which GPUs take the state, and every reason to refuse."""

from __future__ import annotations

import pytest

from gpusnap.errors import IncompatibleHostError
from gpusnap.gpu.base import GpuStatus
from gpusnap.gpu.hostcheck import check_host, needed_memory
from gpusnap.metadata import CheckpointMetadata, GpuInfo, GpuProcess

GIB = 1 << 30


def gpu(i: int, uuid: str, name: str = "H200", free: int = 100 * GIB, driver: str = "580.159.04", mig: bool = False) -> GpuStatus:
    return GpuStatus(GpuInfo(i, uuid, name, 141 * GIB, driver, "13.0"), free, mig)


def meta(*procs: tuple[str, int], gpus: list[str]) -> CheckpointMetadata:
    return CheckpointMetadata(
        container_id="c",
        created="now",
        gpus=[GpuInfo(i, u, "H200", 141 * GIB, "580.100", "13.0") for i, u in enumerate(gpus)],
        processes=[GpuProcess(100 + i, 2 + i, mem, [u]) for i, (u, mem) in enumerate(procs)],
    )


def test_same_gpus_need_no_remap():
    m = meta(("GPU-a", 8 * GIB), ("GPU-b", 8 * GIB), gpus=["GPU-a", "GPU-b"])
    assert check_host(m, [gpu(0, "GPU-b"), gpu(1, "GPU-a")], supports_remap=False) == {}


def test_other_gpus_of_the_same_model_are_taken_in_index_order():
    m = meta(("GPU-a", 8 * GIB), ("GPU-b", 8 * GIB), gpus=["GPU-a", "GPU-b"])
    host = [gpu(0, "GPU-x", name="L40S"), gpu(1, "GPU-y"), gpu(2, "GPU-z")]
    assert check_host(m, host, supports_remap=True) == {"GPU-a": "GPU-y", "GPU-b": "GPU-z"}


def test_partial_overlap_keeps_the_gpu_that_is_here():
    m = meta(("GPU-a", GIB), ("GPU-b", GIB), gpus=["GPU-a", "GPU-b"])
    assert check_host(m, [gpu(0, "GPU-z"), gpu(1, "GPU-b")], supports_remap=True) == {"GPU-a": "GPU-z"}


@pytest.mark.parametrize(
    "host, remap, word",
    [
        ([gpu(0, "GPU-y")], True, "1x H200"),  # count
        ([gpu(0, "GPU-a", driver="570.86"), gpu(1, "GPU-b", driver="570.86")], True, "older"),
        ([gpu(0, "GPU-a", free=GIB), gpu(1, "GPU-b")], True, "free"),
        ([gpu(0, "GPU-x"), gpu(1, "GPU-y")], False, "cannot remap"),
        ([gpu(0, "GPU-a", mig=True), gpu(1, "GPU-b")], True, "MIG"),
    ],
)
def test_refusals(host, remap, word):
    m = meta(("GPU-a", 8 * GIB), ("GPU-b", 8 * GIB), gpus=["GPU-a", "GPU-b"])
    with pytest.raises(IncompatibleHostError, match=word):
        check_host(m, host, supports_remap=remap)


def test_no_gpu_processes_need_nothing():
    assert check_host(CheckpointMetadata(container_id="c", created="now"), [], supports_remap=False) == {}


def test_memory_of_a_multi_gpu_process_counts_on_each():
    m = CheckpointMetadata(container_id="c", created="now", processes=[GpuProcess(1, 1, 4 * GIB, ["GPU-a", "GPU-b"]), GpuProcess(2, 2, GIB, ["GPU-a"])])
    assert needed_memory(m) == {"GPU-a": 5 * GIB, "GPU-b": 4 * GIB}
