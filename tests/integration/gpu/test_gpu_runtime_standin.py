"""GPU checkpoint/restore through gpusnap-runtime with real runc and CRIU, the driver stood in for.

The containers run gpu_worker.py in CPU mode; their processes carry the stand-in's CUDA marker,
so the runtime locks, checkpoints, restores and unlocks them through the stand-in's state
machine around the real runc checkpoint/restore, and the values are checked bit for bit against
a reference run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from gpu_harness import Container, assert_matches, reference, small_tmpfs

from gpusnap.gpu.base import ProcessGpuState
from gpusnap.gpu.standin import StandinBackend
from gpusnap.gpu.suspend import resume, suspend

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runc"), reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]

REF_STOP = 20000
R, C = ProcessGpuState.RUNNING, ProcessGpuState.CHECKPOINTED


@pytest.fixture
def ref(tmp_path_factory: pytest.TempPathFactory) -> dict[int, int]:
    return reference("cpu", 1, REF_STOP, tmp_path_factory.getbasetemp())


def states(c: Container, backend: StandinBackend) -> list[ProcessGpuState]:
    return [backend.state(p) for p in c.worker_pids()]


@pytest.mark.parametrize("nprocs", [1, 2])
def test_checkpoint_delete_restore(stack, backend, ref, containers, tmp_path, nprocs):
    c = Container(stack, nprocs=nprocs)
    containers.append(c)
    c.start()
    assert states(c, backend) == [R] * nprocs
    from gpusnap.gpu.procs import ns_pid

    worker_ns_pids = sorted(ns_pid(Path("/proc"), p) for p in c.worker_pids())
    img = tmp_path / "img"
    run = c.checkpoint(img)
    assert run.rc == 0, run.stderr
    meta = json.loads((img / "gpusnap.json").read_text())
    assert meta["gpu_backend"] == "standin" and len(meta["processes"]) == nprocs
    assert sorted(p["ns_pid"] for p in meta["processes"]) == worker_ns_pids
    assert 1 not in [p["ns_pid"] for p in meta["processes"]]  # the shell is no CUDA process
    assert {"gpu_lock", "gpu_checkpoint", "criu_dump", "total"} <= set(meta["timings_s"])
    assert meta["gpus"] and meta["gpus"][0]["uuid"].startswith("GPU-")
    before = [c.last_step(i) for i in range(nprocs)]
    assert all(backend.state_dir.joinpath("procs", f"{t}.json").read_text().count('"checkpointed"') for t in c.tokens)
    c.delete()
    assert c.state() is None
    run = c.restore(img)
    assert run.rc == 0, run.stderr
    assert states(c, backend) == [R] * nprocs
    restore_timings = json.loads((img / "gpusnap-restore.json").read_text())["timings_s"]
    assert {"runc_restore", "gpu_restore", "gpu_unlock"} <= set(restore_timings)
    for i in range(nprocs):
        c.wait_step(before[i] + 50)
        assert_matches(c.lines(i), ref, after=before[i])
    assert "ILLEGAL" not in (backend.state_dir / "calls.log").read_text()


def test_leave_running(stack, backend, ref, containers, tmp_path):
    c = Container(stack)
    containers.append(c)
    c.start()
    run = c.checkpoint(tmp_path / "img", leave_running=True)
    assert run.rc == 0, run.stderr
    assert c.state()["status"] == "running" and states(c, backend) == [R]
    at = c.last_step()
    c.wait_step(at + 50)
    assert_matches(c.lines(), ref, after=at)


def test_criu_failure_disk_full_keeps_container_running(stack, backend, ref, containers, tmp_path):
    c = Container(stack, nprocs=2)
    containers.append(c)
    c.start()
    with small_tmpfs(tmp_path / "full", "256k") as img:
        run = c.checkpoint(img)
    assert run.rc != 0
    assert "rolled back" in run.stderr, run.stderr
    assert c.state()["status"] == "running"
    assert states(c, backend) == [R, R]
    log = (backend.state_dir / "calls.log").read_text().split("\n")
    assert [l.split()[0] for l in log if l] == ["lock", "lock", "checkpoint", "checkpoint", "restore", "restore", "unlock", "unlock"]
    at = c.last_step()
    c.wait_step(at + 50)
    assert_matches(c.lines(), ref, after=at)


def test_lock_timeout_refuses_and_changes_nothing(stack, backend, containers, tmp_path):
    c = Container(stack, nprocs=2)
    containers.append(c)
    c.start()
    (backend.state_dir / "faults.json").write_text(json.dumps([{"call": "lock", "token": c.tokens[1], "error": "timeout"}]))
    run = c.checkpoint(tmp_path / "img")
    assert run.rc == 6 and "timeout" in run.stderr.lower(), run.stderr
    assert c.state()["status"] == "running" and states(c, backend) == [R, R]


def test_restore_refused_on_incompatible_host(stack, backend, containers, tmp_path):
    c = Container(stack)
    containers.append(c)
    c.start()
    img = tmp_path / "img"
    assert c.checkpoint(img).rc == 0
    (backend.state_dir / "gpus.json").write_text(json.dumps([{"name": "Another GPU model"}]))
    run = c.restore(img)
    assert run.rc == 4, run.stderr
    assert "same GPU model" in run.stderr
    assert c.state() is None  # runc restore never ran


def test_suspend_resume(stack, backend, ref, containers, tmp_path):
    c = Container(stack, nprocs=2)
    containers.append(c)
    c.start()
    settings = stack.settings()
    rec = suspend(c.id, settings, root=str(c.root))
    assert len(rec.processes) == 2 and rec.gpu_memory_bytes > 0
    assert states(c, backend) == [C, C]
    assert all(backend.process_memory(p) == {} for p in c.worker_pids())
    assert (settings.run_dir / "suspended" / f"{c.id}.json").exists()
    timings = resume(c.id, settings, root=str(c.root))
    assert {"gpu_restore", "gpu_unlock"} <= set(timings)
    assert states(c, backend) == [R, R]
    at = c.last_step()
    c.wait_step(at + 50)
    assert_matches(c.lines(), ref, after=at)


def test_suspend_resume_commands(stack, backend, containers, tmp_path, monkeypatch):
    """`gpusnap suspend/resume` as the CLI registers them (gpusnap.cli.suspend.register)."""
    import typer
    from typer.testing import CliRunner

    from gpusnap.cli.suspend import register

    app = typer.Typer()
    register(app)
    c = Container(stack)
    containers.append(c)
    c.start()
    for k, v in stack.gpusnap_env().items():
        monkeypatch.setenv(k, v)
    runner = CliRunner()
    res = runner.invoke(app, ["suspend", c.id, "--root", str(c.root)])
    assert res.exit_code == 0, res.output
    assert f"suspended {c.id}: 1 GPU process(es)" in res.output
    assert states(c, backend) == [C]
    res = runner.invoke(app, ["suspend", c.id, "--root", str(c.root)])
    assert res.exit_code == 2 and "gpusnap resume" in res.output and len(res.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["resume", c.id, "--root", str(c.root)])
    assert res.exit_code == 0, res.output
    assert states(c, backend) == [R]
    res = runner.invoke(app, ["resume", "gs-gpu-no-such", "--root", str(c.root)])
    assert res.exit_code == 3 and "not found" in res.output
