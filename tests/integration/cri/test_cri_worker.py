"""The GPU suite's deterministic worker (tests/gpu_worker.py, CPU mode, the driver stand-in as
its GPU) in a pod that runs the host's Python through CRI mounts: checkpointed by CRI, restored
from the checkpoint image in a new pod, and its values after the restore equal, step for step, a
fresh reference run's. tests/gpu/test_gpu_cri.py runs the same pod with CUDA on a GPU machine."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gpu_harness import WORKER, assert_matches, reference
from stack.cri import push_busybox_image

from gpusnap.cri.image import read_archive

from .conftest import H200, Kubelet, processes_with
from .test_cri_checkpoint import push_image

pytestmark = pytest.mark.integration
GB = 0.05
SYSTEM_PYTHON = "/usr/bin/python3"


def worker_pod(node: Kubelet, name: str, image: str, data: Path, token: str, *, start: bool = True):  # type: ignore[no-untyped-def]
    python = SYSTEM_PYTHON  # the worker's CPU mode needs only the standard library
    envs = {"WORKER_MODE": "cpu", "GB": str(GB), "SLEEP": "0.01", "PYTHONUNBUFFERED": "1", "GPUSNAP_STANDIN_CUDA": token,
            "GPUSNAP_STANDIN_GPU_MB": str(int(GB * 1024))}
    mounts = [("/usr", "/usr", True), (str(data), "/data", False)]
    make = node.run if start else node.create
    return make(name, "gpusnap", image, args=[f"exec {python} /data/gpu_worker.py /data/out0"], envs=envs, mounts=mounts)


def steps(data: Path) -> dict[int, int]:
    out = {}
    for line in (data / "out0").read_text().splitlines() if (data / "out0").exists() else []:
        parts = line.split()
        if len(parts) == 2:
            out[int(parts[0])] = int(parts[1])
    return out


def wait_step(data: Path, step: int, timeout: float = 120) -> int:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(steps(data), default=0) >= step:
            return max(steps(data))
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached; at {max(steps(data), default=0)}")


def test_worker_pod_restored_bit_for_bit(node: Kubelet, tmp_path: Path) -> None:
    if not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"no {SYSTEM_PYTHON} (the pod runs the host's /usr)")
    image = f"{node.registry.host}/library/hostfs:1"
    push_busybox_image(node.base / "images", image, ["/bin/sh"], hostfs=True)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(WORKER, data / "gpu_worker.py")
    token = "cri-worker"
    pod = worker_pod(node, "worker", image, data, token)
    wait_step(data, 100)
    archive = node.checkpoint(pod)
    node.remove(pod)
    at_checkpoint = max(steps(data))
    meta = read_archive(archive).meta
    assert meta is not None and [g.name for g in meta.gpus] == [H200] and [p.ns_pid for p in meta.processes] == [1]
    ckpt_image = push_image(node, archive, "checkpoints/worker")

    restored = worker_pod(node, "worker", ckpt_image, data, token)
    wait_step(data, at_checkpoint + 200)
    ref = reference("cpu", GB, at_checkpoint + 200, tmp_path)
    assert_matches(steps(data), ref, after=at_checkpoint)
    calls = [c.split()[0] for c in (node.standin / "calls.log").read_text().splitlines()]
    assert calls == ["lock", "checkpoint", "restore", "unlock", "restore", "unlock"]
    assert len(processes_with(f"GPUSNAP_STANDIN_CUDA={token}")) == 1
    node.remove(restored)
