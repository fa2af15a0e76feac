"""The reverse of the kubelet path: a container checkpointed by gpusnap on a host without
Kubernetes (runc-direct, through gpusnap-runtime), pushed as a gpusnap artifact to a registry,
made a checkpoint image with ``gpusnap cri-image --from-artifact``, and restored by the real
containerd 2.1 in a new pod on the ``gpusnap`` handler whose image is that checkpoint image —
with the GPU stand-in too; and artifacts a node cannot take refused with nothing left."""

from __future__ import annotations

import json
import subprocess
import tarfile
import shutil
import time
import uuid
from pathlib import Path

import pytest

from gpusnap.cri.client import CriError
from gpusnap.errors import ExitCode
from gpusnap.packaging import api
from gpusnap.packaging.registry import RegistryClient
from gpusnap.packaging.store import OciStore

from .conftest import GPU_COUNTER, H200, Kubelet, processes_with, standin_gpus, wait_numbers
from .test_cri_cli import gs, one_line_error

pytestmark = pytest.mark.integration
COUNTER = "i=0; while :; do echo $i; i=$((i+1)); sleep 0.1; done"


def gs_numbers(node: Kubelet, name: str, count: int, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    got: list[int] = []
    while time.monotonic() < deadline:
        got = [int(x) for x in gs(node, "logs", name).stdout.split() if x.isdigit()]
        if len(got) >= count:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{name}: {count} numbers not logged in {timeout}s; got {got[-10:]}")


def checkpoint_runc_direct(node: Kubelet, script: str, ref: str, env: list[str] = ()) -> tuple[str, int]:  # type: ignore[assignment]
    """Run a counter on runc-direct, checkpoint it (it stops) with --push, remove it: returns
    its name and the last number it logged."""
    name = f"gs-cri-{uuid.uuid4().hex[:6]}"
    gs(node, "run", name, *[a for e in env for a in ("--env", e)], "--", "sh", "-c", script)
    try:
        gs_numbers(node, name, 10)
        gs(node, "checkpoint", name, "--push", ref, "--insecure")
        last = gs_numbers(node, name, 1)[-1]
    finally:
        gs(node, "delete", name, check=False)
    return name, last


def cri_tags(node: Kubelet) -> list[str]:
    store = node.base / "cli-store"
    return [t.ref for t in OciStore(store).tags() if "cri/" in t.ref or "ckpt" in t.ref] if (store / "index.json").exists() else []


def leftovers(node: Kubelet) -> list[str]:
    return [p.name for p in node.base.iterdir() if p.name.startswith(".cri-image-")]


def test_runc_direct_artifact_restored_as_a_pod(node: Kubelet) -> None:
    reg = node.registry.host
    artifact = f"{reg}/gpusnap/counter:1"
    _, last = checkpoint_runc_direct(node, COUNTER, artifact)
    image = f"{reg}/ckpt/counter-from-gpusnap:1"

    # A runc-direct container ran on a directory: without --base-image there is nothing to pull.
    line = one_line_error(gs(node, "cri-image", "--from-artifact", artifact, "--push", image, "--insecure", check=False), ExitCode.USAGE)
    assert "not a registry image; pass --base-image IMAGE" in line
    assert not node.registry.has_tag("ckpt/counter-from-gpusnap", "1") and not cri_tags(node) and not leftovers(node)

    # The store's copy of the artifact is removed: the registry's is converted (pulled privately).
    shutil.rmtree(node.base / "cli-store")
    out = json.loads(gs(node, "cri-image", "--from-artifact", artifact, "--base-image", node.image, "--push", image, "--insecure",
                        "--json").stdout)
    ann = out["annotations"]
    assert out["pushed"] == image and ann["org.criu.checkpoint.container.name"] and ann["io.kubernetes.cri-o.annotations.checkpoint.name"]
    assert ann["org.criu.checkpoint.rootfsImageName"] == node.image and ann["io.gpusnap.checkpoint.form"] == "criu-dir"
    assert ann["io.gpusnap.checkpoint.arch"] == "amd64" and ann["io.gpusnap.checkpoint.source"].startswith("sha256:")
    assert [t.ref for t in OciStore(node.base / "cli-store").tags()] == [out["ref"]], "only the checkpoint image is kept"
    assert not leftovers(node)

    since = time.time()
    pod = node.run("counter", "gpusnap", image)
    got = wait_numbers(pod.log, 5, since=since)
    assert got[0] == last + 1, f"the restored counter starts at {got[0]}; the checkpoint stopped it after {last}"
    assert got == list(range(got[0], got[0] + len(got))), got
    status = node.cri.container_status(pod.container).status
    assert status.annotations.get("restored") == "true" and status.annotations.get("checkpointImage") == image
    assert status.image.image == node.image, "the restored container reports its base image"


def test_gpu_standin_artifact_restored_as_a_pod_and_refusals(node: Kubelet, tmp_path: Path) -> None:
    reg = node.registry.host
    token = f"gs-cri-gpu-{uuid.uuid4().hex[:6]}"
    artifact = f"{reg}/gpusnap/trainer:1"
    _, last = checkpoint_runc_direct(node, GPU_COUNTER, artifact, env=[f"GPUSNAP_STANDIN_CUDA={token}"])
    calls = [c.split()[0] for c in (node.standin / "calls.log").read_text().splitlines()]
    assert calls == ["lock", "checkpoint"], "the checkpoint stopped the container: its GPU state is in the artifact"
    assert not processes_with(f"GPUSNAP_STANDIN_CUDA={token}")

    # An artifact taken on another architecture, in the local store and in the registry: refused
    # from its config, before a layer is read; nothing tagged, pushed or left in a work directory.
    store = node.base / "cli-store"
    criu = api.materialize_checkpoint(store, artifact, tmp_path / "criu", form="criu-dir")
    meta = json.loads((criu / "gpusnap.json").read_text())
    (criu / "gpusnap.json").write_text(json.dumps({**meta, "arch": "aarch64"}))
    api.store_checkpoint(store, criu, form="criu-dir", ref="local/trainer-arm64:1")
    api.push(store, "local/trainer-arm64:1", f"{reg}/gpusnap/trainer-arm64:1", insecure=True)
    tags = sorted(t.ref for t in OciStore(store).tags())
    for src in ("local/trainer-arm64:1", f"{reg}/gpusnap/trainer-arm64:1"):
        line = one_line_error(gs(node, "cri-image", "--from-artifact", src, "--base-image", node.image, "--push", f"{reg}/ckpt/arm:1",
                                 "--insecure", check=False), ExitCode.INCOMPATIBLE)
        assert "is a checkpoint for arm64 and the image would be for amd64" in line, line
        assert sorted(t.ref for t in OciStore(store).tags()) == tags and not node.registry.has_tag("ckpt/arm", "1") and not leftovers(node)
    # A base image the registry does not have: refused before anything is written.
    line = one_line_error(gs(node, "cri-image", "--from-artifact", artifact, "--base-image", f"{reg}/library/nosuch:1", "--insecure",
                             check=False), ExitCode.NOT_FOUND)
    assert "cannot resolve the base image" in line and sorted(t.ref for t in OciStore(store).tags()) == tags

    image = f"{reg}/ckpt/trainer-from-gpusnap:1"
    out = json.loads(gs(node, "cri-image", "--from-artifact", artifact, "--base-image", node.image, "--push", image, "--insecure",
                        "--json").stdout)
    assert out["annotations"]["io.gpusnap.checkpoint.gpus"] == f"1x {H200}"
    recorded = json.loads(out["annotations"]["io.gpusnap.checkpoint.metadata"])
    assert [g["name"] for g in recorded["gpus"]] == [H200] and [p["ns_pid"] for p in recorded["processes"]] == [1]

    # Another GPU model on this node: gpusnap-runtime refuses at StartContainer, nothing runs.
    (node.standin / "gpus.json").write_text(standin_gpus("NVIDIA A100-SXM4-80GB"))
    other = node.create("trainer", "gpusnap", image)
    with pytest.raises(CriError) as refused:
        node.cri.start_container(other.container)
    assert f"needs 1x {H200} but this host has 1x NVIDIA A100-SXM4-80GB" in str(refused.value), refused.value
    assert node.state(other) != "CONTAINER_RUNNING" and not processes_with(f"GPUSNAP_STANDIN_CUDA={token}")
    node.remove(other)

    # The same model: restored in a pod, its GPU state put back, counting on from where it stopped.
    (node.standin / "gpus.json").write_text(standin_gpus(H200))
    since = time.time()
    pod = node.run("trainer", "gpusnap", image)
    got = wait_numbers(pod.log, 5, since=since)
    assert got[0] == last + 1 and got == list(range(got[0], got[0] + len(got))), (last, got)
    assert [c.split()[0] for c in (node.standin / "calls.log").read_text().splitlines()] == [*calls, "restore", "unlock"]
    assert len(processes_with(f"GPUSNAP_STANDIN_CUDA={token}")) == 1


def test_podman_artifact_refused_for_containerd_and_made_for_crio(node: Kubelet) -> None:
    """A podman container has podman's /run/.containerenv bind mount, which no containerd container
    has: refused for containerd with the reason, before anything is stored. For CRI-O (which has
    one) the image is made, in CRI-O's form: the base image by its image ID."""
    reg = node.registry.host
    name = f"gs-cri-pm-{uuid.uuid4().hex[:6]}"
    subprocess.run(["podman", "run", "--runtime", "runc", "-d", "--name", name, "localhost/gpusnap-busybox:latest", "sh", "-c", COUNTER],
                   check=True, capture_output=True)
    artifact = f"{reg}/gpusnap/podman-counter:1"
    try:
        gs(node, "checkpoint", name, "--push", artifact, "--insecure")
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True)
    store = node.base / "cli-store"
    tags = sorted(t.ref for t in OciStore(store).tags())
    line = one_line_error(gs(node, "cri-image", "--from-artifact", artifact, "--base-image", node.image, "--push", f"{reg}/ckpt/pm:1",
                             "--insecure", check=False), ExitCode.USAGE)
    assert "had the bind mount /run/.containerenv, which a containerd container never has" in line, line
    assert sorted(t.ref for t in OciStore(store).tags()) == tags and not node.registry.has_tag("ckpt/pm", "1") and not leftovers(node)

    out = json.loads(gs(node, "cri-image", "--from-artifact", artifact, "--base-image", node.image, "--cri-runtime", "cri-o",
                        "--tag", "cri/pm-crio:1", "--insecure", "--json").stdout)
    assert out["annotations"]["io.kubernetes.cri-o.annotations.checkpoint.name"] == name
    s = OciStore(store)
    manifest = s.manifest(s.resolve("cri/pm-crio:1").digest)
    with tarfile.open(s.blob_path(manifest["layers"][0]["digest"])) as tar:
        names = set(tar.getnames())
        config = json.loads(tar.extractfile("config.dump").read())  # type: ignore[union-attr]
        spec = json.loads(tar.extractfile("spec.dump").read())  # type: ignore[union-attr]
    assert {"checkpoint/inventory.img", "spec.dump", "status.dump"} <= names
    data, _, _ = RegistryClient(reg, insecure=True).get_manifest("library/busybox", "1")
    assert config["rootfsImageRef"] == json.loads(data)["config"]["digest"].removeprefix("sha256:"), "CRI-O: the node's image ID"
    assert config["rootfsImageName"] == node.image and spec["annotations"]["io.kubernetes.cri-o.Annotations"]
    assert "/run/.containerenv" in [m["destination"] for m in spec["mounts"]], "podman's own spec is kept"
