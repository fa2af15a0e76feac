"""`gpusnap checkpoint/restore --engine cri` and `gpusnap cri-image` on the real containerd 2.1,
as a user runs them (the installed entry point, in a subprocess), with the GPU stand-in; and
checkpoint images this node cannot take, refused before anything is created."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from stack.cri import PROTO
from stack.proc import HOST_PATH

from gpusnap.cri.client import CriError
from gpusnap.errors import ExitCode

from .conftest import (
    GPU_COUNTER,
    H200,
    Kubelet,
    processes_with,
    standin_gpus,
    wait_numbers,
)

pytestmark = pytest.mark.integration
GPUSNAP = str(Path(sys.executable).parent / "gpusnap")


def gs(node: Kubelet, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{HOST_PATH}", "GPUSNAP_CONFIG": "/nonexistent/gpusnap.toml",
           "GPUSNAP_STORE": str(node.base / "cli-store"), "GPUSNAP_STATE_DIR": str(node.base / "cli-state"),
           "GPUSNAP_RUN_DIR": str(node.base / "cli-run"), "GPUSNAP_CRI_PROTO": str(PROTO),
           "GPUSNAP_GPU_BACKEND": f"standin:{node.standin}"}
    proc = subprocess.run([GPUSNAP, *args], capture_output=True, text=True, env=env, timeout=300, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"gpusnap {' '.join(args)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


def one_line_error(proc: subprocess.CompletedProcess[str], code: ExitCode) -> str:
    assert proc.returncode == int(code), (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpusnap: error: "), proc.stderr
    return lines[0]


def test_cli_checkpoint_push_and_restore_with_refusals(node: Kubelet) -> None:
    token = "cri-cli-job"
    pod = node.run("job", "gpusnap", node.image, args=[GPU_COUNTER], envs={"GPUSNAP_STANDIN_CUDA": token})
    before = wait_numbers(pod.log, 10)[-1]
    sock = str(node.ctrd.socket)
    image = f"{node.registry.host}/ckpt/job:1"
    archive = node.checkpoint_dir / "checkpoint-job_default-job-cli.tar"
    out = json.loads(gs(node, "checkpoint", "--engine", "cri", "job", "--cri-socket", sock, "--output", str(archive),
                        "--push", image, "--insecure", "--json").stdout)
    after = wait_numbers(pod.log, 1)[-1]
    assert out["gpu_state"] and out["pushed"] == image and out["pod"] == "job" and out["container"] == "job" and archive.is_file()
    assert node.state(pod) == "CONTAINER_RUNNING"
    node.remove(pod)

    # A checkpoint taken on another architecture: refused before any CRI call, nothing created.
    foreign = foreign_archive(archive, node.checkpoint_dir / "checkpoint-job_default-job-arm64.tar", "aarch64")
    arm = f"{node.registry.host}/ckpt/job-arm64:1"
    gs(node, "cri-image", str(foreign), "--push", arm, "--insecure")
    line = one_line_error(gs(node, "restore", "--engine", "cri", arm, "--name", "job-arm", "--cri-socket", sock, "--host-network",
                             "--insecure", check=False), ExitCode.INCOMPATIBLE)
    assert "is a checkpoint for arm64 and this node is amd64" in line
    assert not node.cri.list_pods() and not node.cri.list_containers()
    # The kubelet's own path with that image: containerd 2.1 checks no architecture and creates
    # the container; gpusnap-runtime refuses the restore at StartContainer, and nothing runs.
    other = node.create("job", "gpusnap", arm)
    with pytest.raises(CriError) as refused:
        node.cri.start_container(other.container)
    assert "the checkpoint was taken on aarch64 and this host is x86_64" in str(refused.value), refused.value
    assert node.state(other) != "CONTAINER_RUNNING" and not processes_with(f"GPUSNAP_STANDIN_CUDA={token}")
    node.remove(other)

    # Another GPU model: refused with the reason, before any CRI call.
    (node.standin / "gpus.json").write_text(standin_gpus("NVIDIA A100-SXM4-80GB"))
    line = one_line_error(gs(node, "restore", "--engine", "cri", image, "--name", "job2", "--cri-socket", sock, "--host-network",
                             "--insecure", check=False), ExitCode.INCOMPATIBLE)
    assert f"needs 1x {H200}" in line and "A100" in line
    assert not node.cri.list_pods()

    # The right node, but the driver fails the GPU restore: the runtime rolls back, the CLI
    # removes the pod it made, and nothing is left.
    (node.standin / "gpus.json").write_text(standin_gpus(H200))
    (node.standin / "faults.json").write_text(json.dumps([{"call": "restore", "token": token, "error": "failed"}]))
    line = one_line_error(gs(node, "restore", "--engine", "cri", image, "--name", "job2", "--cri-socket", sock, "--host-network",
                             "--insecure", check=False), ExitCode.RESTORE_FAILED)
    assert "StartContainer failed" in line and "the pod sandbox was removed again" in line
    assert not node.cri.list_pods() and not node.cri.list_containers() and not processes_with(f"GPUSNAP_STANDIN_CUDA={token}")
    (node.standin / "faults.json").unlink()
    calls = [c.split()[0] for c in (node.standin / "calls.log").read_text().splitlines()]

    # The right node: restored as a new pod, GPU state put back, counting on.
    since = time.time()
    res = json.loads(gs(node, "restore", "--engine", "cri", image, "--name", "job2", "--cri-socket", sock, "--host-network",
                        "--insecure", "--json").stdout)
    [restored] = [p for p in node.cri.list_pods() if p.metadata.name == "job2"]
    assert res["pod_id"] == restored.id and res["container"] == "job"
    status = node.cri.container_status(res["container_id"]).status
    log_dir = Path(status.log_path).parent.parent  # the CLI keeps pod logs where the kubelet does, /var/log/pods
    try:
        got = wait_numbers(Path(status.log_path), 5, since=since)
        assert before + 1 <= got[0] <= after + 1 and got == list(range(got[0], got[0] + len(got)))
        now = [c.split()[0] for c in (node.standin / "calls.log").read_text().splitlines()]
        assert now == [*calls, "restore", "unlock"]
        assert len(processes_with(f"GPUSNAP_STANDIN_CUDA={token}")) == 1
        node.cri.stop_pod(restored.id)
        node.cri.remove_pod(restored.id)
        # From the kubelet archive on this node, no registry involved: containerd reads it directly.
        since = time.time()
        res = json.loads(gs(node, "restore", "--engine", "cri", str(archive), "--name", "job3", "--cri-socket", sock, "--host-network", "--json").stdout)
        status = node.cri.container_status(res["container_id"]).status
        shutil.rmtree(log_dir, ignore_errors=True)
        log_dir = Path(status.log_path).parent.parent
        got = wait_numbers(Path(status.log_path), 5, since=since)
        assert before + 1 <= got[0] <= after + 1
        assert [c.split()[0] for c in (node.standin / "calls.log").read_text().splitlines()][-2:] == ["restore", "unlock"]
        node.cri.stop_pod(res["pod_id"])
        node.cri.remove_pod(res["pod_id"])
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def foreign_archive(src: Path, dest: Path, arch: str) -> Path:
    """A copy of a kubelet archive whose gpusnap record says it was taken on ``arch``."""
    with tarfile.open(src) as tin, tarfile.open(dest, "w") as tout:
        for m in tin:
            data = tin.extractfile(m).read() if m.isreg() else None  # type: ignore[union-attr]
            if m.name == "checkpoint/gpusnap.json" and data is not None:
                data = json.dumps({**json.loads(data), "arch": arch}).encode()
                m.size = len(data)
            tout.addfile(m, io.BytesIO(data) if data is not None else None)
    return dest


def test_cli_refuses_what_is_not_a_checkpoint(node: Kubelet, tmp_path: Path) -> None:
    sock = str(node.ctrd.socket)
    line = one_line_error(gs(node, "restore", "--engine", "cri", node.image, "--name", "x", "--cri-socket", sock, "--insecure", check=False),
                          ExitCode.USAGE)
    assert "is not a checkpoint image" in line
    line = one_line_error(gs(node, "checkpoint", "--engine", "cri", "nosuchpod", "--cri-socket", sock, check=False), ExitCode.NOT_FOUND)
    assert "no ready pod default/nosuchpod" in line
    bad = tmp_path / "evil.tar"
    with tarfile.open(bad, "w") as tar:
        info = tarfile.TarInfo("checkpoint/../../../etc/cron.d/x")
        tar.addfile(info, io.BytesIO(b""))
    line = one_line_error(gs(node, "cri-image", str(bad), check=False), ExitCode.INTEGRITY)
    assert "contains '..'" in line
    line = one_line_error(gs(node, "restore", "--engine", "cri", str(bad), "--name", "x", "--cri-socket", sock, check=False), ExitCode.INTEGRITY)
    assert "contains '..'" in line and not node.cri.list_pods()
