"""A GPU container end to end on a CPU host: the GPU driver is gpusnap's stand-in (which keeps
the real driver's checkpoint state machine), everything else is real — runc-direct through
gpusnap-runtime, CRIU, the registry. The checkpoint's metadata is what the runtime recorded."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from gpusnap.errors import ExitCode

from .conftest import Gs, unique, wait_numbers
from .test_bad_input import one_line_error, snapshot
from .test_e2e import assert_continues

pytestmark = pytest.mark.integration

# Only the shell holds "GPU state": its sleep children drop the stand-in's marker.
GPU_COUNTER = "i=0; while true; do echo $i; i=$((i+1)); env -u GPUSNAP_STANDIN_CUDA sleep 0.5; done"


def gpus(model: str) -> str:
    return json.dumps([{"uuid": "GPU-5e1f0000-0000-0000-0000-000000000001", "name": model, "memory_total_bytes": 150 << 30,
                        "memory_free_bytes": 150 << 30, "mig_enabled": False, "driver_version": "580.159.04", "cuda_version": "13.0"}])


def start_gpu_container(gs: Gs, tmp_path: Path, kind: str, script: str) -> tuple[Path, str]:
    """A runc-direct container whose shell the stand-in driver (an H200) treats as a CUDA
    process, counting; returns the stand-in's directory and the container's name."""
    standin = tmp_path / "standin"
    standin.mkdir()
    (standin / "gpus.json").write_text(gpus("NVIDIA H200"))
    gs.env["GPUSNAP_GPU_BACKEND"] = f"standin:{standin}"
    name = unique(kind)
    gs("run", name, "--env", f"GPUSNAP_STANDIN_CUDA={name}", "--", "sh", "-c", script)
    return standin, name


def test_gpu_checkpoint_refused_on_other_gpu_model_then_restored(gs: Gs, registry: str, tmp_path: Path) -> None:
    standin, name = start_gpu_container(gs, tmp_path, "gpu", GPU_COUNTER)
    try:
        wait_numbers(lambda: gs("logs", name).stdout, 3)
        ref = f"{registry}/{name}:v1"
        gs("checkpoint", name, "--push", ref, "--insecure")
        last = wait_numbers(lambda: gs("logs", name).stdout, 1)[-1]
        calls = (standin / "calls.log").read_text().split("\n")
        assert [c.split()[0] for c in calls if c] == ["lock", "checkpoint"]
        gs("delete", name)
        shutil.rmtree(gs.store)


        # Another GPU model: refused before anything is pulled or started.
        (standin / "gpus.json").write_text(gpus("NVIDIA A100-SXM4-80GB"))
        before = snapshot(gs)
        line = one_line_error(gs("restore", ref, "--insecure", "--name", name + "-a100", check=False), ExitCode.INCOMPATIBLE)
        assert "needs 1x NVIDIA H200 and this host has 1x NVIDIA A100-SXM4-80GB" in line
        assert snapshot(gs) == before
        assert not gs.store.exists(), "nothing was pulled"

        # The same model: restored, GPU state put back, and it counts on.
        (standin / "gpus.json").write_text(gpus("NVIDIA H200"))
        new = name + "-restored"
        gs("restore", ref, "--insecure", "--name", new)
        after = wait_numbers(lambda: gs("logs", new).stdout, 3)
        assert_continues(last, wait_numbers(lambda: gs("logs", new).stdout, len(after) + 1))
        calls = [c.split()[0] for c in (standin / "calls.log").read_text().split("\n") if c]
        assert calls == ["lock", "checkpoint", "restore", "unlock"]
        shown = gs.json("inspect", ref)
        assert [g["name"] for g in shown["gpus"]] == ["NVIDIA H200"]  # type: ignore[index]
        assert [p["ns_pid"] for p in shown["gpu_processes"]] == [1]  # type: ignore[index]
    finally:
        for n in (name, name + "-restored"):
            gs("delete", n, check=False)


# The shell holds "GPU state"; a child started without the stand-in's marker holds a file under
# /dev/nvidia open, as a PyTorch DataLoader worker forked after CUDA started holds the driver's
# device files (seen on the GPU machine, where CRIU then fails on them after the GPU state was
# moved out); it ends once /tmp/worker-done exists.
GPU_WITH_BYSTANDER = (
    "touch /dev/nvidia-standin0; "
    "env -u GPUSNAP_STANDIN_CUDA sh -c 'exec 7</dev/nvidia-standin0; while [ ! -e /tmp/worker-done ]; do sleep 0.2; done' & "
    + GPU_COUNTER
)


def test_gpu_checkpoint_refused_while_another_process_holds_nvidia_files(gs: Gs, tmp_path: Path) -> None:
    standin, name = start_gpu_container(gs, tmp_path, "gpu-fork", GPU_WITH_BYSTANDER)
    try:
        wait_numbers(lambda: gs("logs", name).stdout, 3)
        before = snapshot(gs)
        line = one_line_error(gs("checkpoint", name, "--leave-running", check=False), ExitCode.UNSUPPORTED)
        assert "of the container hold NVIDIA device files (/dev/nvidia-standin0)" in line, line  # the shell and its sleep
        assert 'multiprocessing_context="spawn"' in line and "nothing was changed; the container still runs" in line, line
        assert snapshot(gs) == before
        assert not (standin / "calls.log").exists(), "the driver was not called"
        counted = wait_numbers(lambda: gs("logs", name).stdout, 1)
        assert wait_numbers(lambda: gs("logs", name).stdout, len(counted) + 2)[-1] > counted[-1], "still counting"

        # Once the process holding the file has ended, the same container checkpoints.
        (pid,) = [r["pid"] for r in gs.json("ps") if r["name"] == name]  # type: ignore[union-attr,index]
        Path(f"/proc/{pid}/root/tmp/worker-done").touch()
        deadline = time.monotonic() + 20
        while (proc := gs("checkpoint", name, "--leave-running", check=False)).returncode == int(ExitCode.UNSUPPORTED):
            assert time.monotonic() < deadline, proc.stderr
            time.sleep(0.3)
        assert proc.returncode == 0, proc.stderr
        calls = [c.split()[0] for c in (standin / "calls.log").read_text().split("\n") if c]
        assert calls == ["lock", "checkpoint", "restore", "unlock"]
    finally:
        gs("delete", name, check=False)
