"""Restore's host check: which GPUs take the state, and every reason to refuse."""

from __future__ import annotations

import pytest

from gpusnap.errors import IncompatibleHostError
from gpusnap.gpu.base import GpuStatus
from gpusnap.gpu.compat import check_host, needed_memory, pairs_for
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


def test_partial_overlap_keeps_the_gpu_that_is_here_and_pairs_every_gpu():
    # The driver wants a pair for every checkpointed GPU once any moves: identity pairs too.
    m = meta(("GPU-a", GIB), ("GPU-b", GIB), gpus=["GPU-a", "GPU-b"])
    assert check_host(m, [gpu(0, "GPU-z"), gpu(1, "GPU-b")], supports_remap=True) == {"GPU-a": "GPU-z", "GPU-b": "GPU-b"}


def test_targets_choose_the_gpus_even_when_the_old_one_is_here():
    # Checkpointed on GPU 0 of this host, restored with only GPU 1 given: GPU 0 must not be kept.
    m = meta(("GPU-a", 8 * GIB), gpus=["GPU-a"])
    host = [gpu(0, "GPU-a"), gpu(1, "GPU-b")]
    assert check_host(m, host, supports_remap=True) == {}
    assert check_host(m, host, supports_remap=True, targets=["GPU-b"]) == {"GPU-a": "GPU-b"}
    assert check_host(m, host, supports_remap=True, targets=["GPU-a"]) == {}


def test_targets_keep_what_is_given_and_pair_the_rest_in_their_order():
    m = meta(("GPU-a", GIB), ("GPU-b", GIB), gpus=["GPU-a", "GPU-b"])
    host = [gpu(0, "GPU-a"), gpu(1, "GPU-b"), gpu(2, "GPU-c"), gpu(3, "GPU-d")]
    assert check_host(m, host, supports_remap=True, targets=["GPU-d", "GPU-b"]) == {"GPU-a": "GPU-d", "GPU-b": "GPU-b"}
    assert check_host(m, host, supports_remap=True, targets=["GPU-d", "GPU-c"]) == {"GPU-a": "GPU-d", "GPU-b": "GPU-c"}


@pytest.mark.parametrize(
    "targets, remap, word",
    [
        (["GPU-b"], True, "given 1x H200"),  # fewer GPUs given than checkpointed
        ([], True, "given no GPUs"),  # NVIDIA_VISIBLE_DEVICES=none
        (["GPU-nope", "GPU-b"], True, "does not list"),
        (["GPU-c", "GPU-d"], False, "cannot remap"),
    ],
)
def test_target_refusals(targets, remap, word):
    m = meta(("GPU-a", GIB), ("GPU-b", GIB), gpus=["GPU-a", "GPU-b"])
    host = [gpu(0, "GPU-a"), gpu(1, "GPU-b"), gpu(2, "GPU-c"), gpu(3, "GPU-d")]
    with pytest.raises(IncompatibleHostError, match=word):
        check_host(m, host, supports_remap=remap, targets=targets)


def test_target_of_another_model_is_refused():
    m = meta(("GPU-a", GIB), gpus=["GPU-a"])
    with pytest.raises(IncompatibleHostError, match="needs 1x H200 but the restored container is given 1x L40S"):
        check_host(m, [gpu(0, "GPU-a"), gpu(1, "GPU-x", name="L40S")], supports_remap=True, targets=["GPU-x"])


def test_free_memory_is_checked_on_the_target():
    m = meta(("GPU-a", 8 * GIB), gpus=["GPU-a"])
    with pytest.raises(IncompatibleHostError, match="GPU-b has 1.0 GiB free"):
        check_host(m, [gpu(0, "GPU-a"), gpu(1, "GPU-b", free=GIB)], supports_remap=True, targets=["GPU-b"])


def test_pairs_for_each_process_are_its_own_gpus():
    remap = {"GPU-a": "GPU-c", "GPU-b": "GPU-b"}
    assert pairs_for(remap, ["GPU-a"]) == {"GPU-a": "GPU-c"}
    assert pairs_for(remap, ["GPU-a", "GPU-b"]) == {"GPU-a": "GPU-c", "GPU-b": "GPU-b"}
    assert pairs_for(remap, ["GPU-b"]) is None  # none of its GPUs moves: a plain restore
    assert pairs_for(remap, []) == remap  # unknown: every pair
    assert pairs_for({}, ["GPU-a"]) is None


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


def test_memory_per_gpu_is_used_when_known():
    p = GpuProcess(1, 1, 5 * GIB, ["GPU-a", "GPU-b"], gpu_memory_by_uuid={"GPU-a": 4 * GIB, "GPU-b": GIB})
    m = CheckpointMetadata(container_id="c", created="now", processes=[p])
    assert needed_memory(m) == {"GPU-a": 4 * GIB, "GPU-b": GIB}
