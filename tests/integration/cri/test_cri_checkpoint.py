"""Kubernetes' checkpoint and restore on the real containerd 2.1, over CRI, as the kubelet drives
them: a counter pod checkpointed with CheckpointContainer (the kubelet's checkpoint API), the pod
removed, the archive made a checkpoint image and pushed to a registry with gpusnap, and a new pod
whose container image is that checkpoint image restores and counts on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpusnap.cri.client import CriError
from gpusnap.cri.image import ANN_CRIU_NAME, ANN_GPUS, archive_to_image, read_archive
from gpusnap.packaging.api import push

from .conftest import (
    COUNTER,
    GPU_COUNTER,
    H200,
    Kubelet,
    Pod,
    numbers,
    processes_with,
    standin_gpus,
    wait_numbers,
)

pytestmark = pytest.mark.integration


def checkpoint_and_remove(node: Kubelet, pod: Pod) -> tuple[Path, int, int]:
    """Checkpoint (the container keeps running, as with the kubelet) and remove the pod; returns
    the archive and the last numbers logged just before and just after the checkpoint."""
    before = wait_numbers(pod.log, 10)[-1]
    archive = node.checkpoint(pod)
    after = numbers(pod.log)[-1]
    assert node.state(pod) == "CONTAINER_RUNNING", "CheckpointContainer leaves the container running"
    node.remove(pod)
    assert not node.cri.list_containers(), "the pod's containers are gone"
    return archive, before, after


def push_image(node: Kubelet, archive: Path, repo: str) -> str:
    store = node.base / "gpusnap-store"
    image = archive_to_image(store, archive, f"local/{repo}:1")
    remote = f"{node.registry.host}/{repo}:1"
    push(store, image.ref, remote, insecure=True)
    assert node.registry.has_tag(repo, "1")
    return remote


def restore_pod(node: Kubelet, image: str, handler: str, name: str) -> tuple[Pod, float]:
    started = time.time()
    pod = node.run(name, handler, image)
    return pod, started


def assert_counts_on(pod: Pod, since: float, before: int, after: int) -> list[int]:
    got = wait_numbers(pod.log, 5, since=since)
    # The checkpoint was taken between the two reads: the restored counter goes on from there.
    assert before + 1 <= got[0] <= after + 1, f"restored counter starts at {got[0]}, checkpoint was between {before} and {after}"
    assert got == list(range(got[0], got[0] + len(got))), got
    return got


@pytest.mark.parametrize("handler", ["gpusnap", "runc"])
def test_counter_pod_restored_from_checkpoint_image(node: Kubelet, handler: str) -> None:
    pod = node.run("counter", handler, node.image, args=[COUNTER])
    archive, before, after = checkpoint_and_remove(node, pod)

    info = read_archive(archive)
    assert info.container_name == "counter"
    assert info.pod == ("counter", "default")
    # Through gpusnap-runtime the CRIU images carry gpusnap's record; plain runc's do not.
    assert (info.meta is not None) == (handler == "gpusnap")
    if info.meta is not None:
        assert info.meta.leave_running and info.meta.gpus == [] and info.meta.processes == []

    image = push_image(node, archive, f"checkpoints/counter-{handler}")
    restored, since = restore_pod(node, image, handler, "counter")
    got = assert_counts_on(restored, since, before, after)
    status = node.cri.container_status(restored.container).status
    assert status.annotations.get("restored") == "true" and status.annotations.get("checkpointImage") == image
    assert status.image.image == node.image, "the restored container reports its base image"
    assert got[-1] > after, "it counts past where the checkpointed pod was removed"


def test_gpu_pod_through_cri_with_standin(node: Kubelet) -> None:
    """The GPU driver stand-in's state machine around the CRI checkpoint (leave-running: lock,
    checkpoint, restore, unlock) and the restore in the new pod (restore, unlock); a node with
    another GPU model refuses the checkpoint image, leaving nothing running."""
    token = "cri-gpu-counter"
    pod = node.run("trainer", "gpusnap", node.image, args=[GPU_COUNTER], envs={"GPUSNAP_STANDIN_CUDA": token})
    archive, before, after = checkpoint_and_remove(node, pod)
    calls = [c.split()[0] for c in (node.standin / "calls.log").read_text().splitlines()]
    assert calls == ["lock", "checkpoint", "restore", "unlock"]

    meta = read_archive(archive).meta
    assert meta is not None and [g.name for g in meta.gpus] == [H200]
    assert [p.ns_pid for p in meta.processes] == [1]
    image = push_image(node, archive, "checkpoints/trainer")
    assert node.registry.has_tag("checkpoints/trainer", "1")
    store = node.base / "gpusnap-store"
    from gpusnap.packaging.store import OciStore

    manifest = OciStore(store).manifest(OciStore(store).resolve("local/checkpoints/trainer:1").digest)
    assert manifest["annotations"][ANN_CRIU_NAME] == "trainer" and manifest["annotations"][ANN_GPUS] == f"1x {H200}"

    # Another GPU model on this node: gpusnap-runtime refuses the restore (at StartContainer,
    # where containerd runs it) with the reason, and nothing of the container runs.
    (node.standin / "gpus.json").write_text(standin_gpus("NVIDIA A100-SXM4-80GB"))
    other = node.create("trainer", "gpusnap", image)
    with pytest.raises(CriError) as refused:
        node.cri.start_container(other.container)
    assert f"needs 1x {H200} but this host has 1x NVIDIA A100-SXM4-80GB" in str(refused.value), refused.value
    assert node.state(other) != "CONTAINER_RUNNING"
    assert not processes_with(f"GPUSNAP_STANDIN_CUDA={token}")
    assert [c.split()[0] for c in (node.standin / "calls.log").read_text().splitlines()] == calls, "no GPU call was made"
    node.remove(other)

    # The same model: restored, its GPU state put back (restore, unlock), and it counts on.
    (node.standin / "gpus.json").write_text(standin_gpus(H200))
    restored, since = restore_pod(node, image, "gpusnap", "trainer")
    assert_counts_on(restored, since, before, after)
    calls = [c.split()[0] for c in (node.standin / "calls.log").read_text().splitlines()]
    assert calls == ["lock", "checkpoint", "restore", "unlock", "restore", "unlock"]
    assert len(processes_with(f"GPUSNAP_STANDIN_CUDA={token}")) == 1
