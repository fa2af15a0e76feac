"""`gpusnap demo`: which variant runs, the checks before the GPU one starts, and its verdict.
Both variants run for real in tests/integration/cli/test_demo.py (counter) and
tests/gpu/test_gpu_demo.py (CUDA)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpusnap.cli import demo
from gpusnap.cli.main import main
from gpusnap.config import load_settings
from gpusnap.errors import ExitCode, MissingDependencyError


def never() -> str | None:
    raise AssertionError("the GPU check must not run with --no-gpu")


def test_gpu_available_means_gpu_demo() -> None:
    assert demo.choose_gpu(None, lambda: None) is True
    assert demo.choose_gpu(True, lambda: None) is True


def test_no_gpu_here_means_counter() -> None:
    assert demo.choose_gpu(None, lambda: "libcuda.so.1 not found") is False


def test_no_gpu_flag_forces_counter_without_probing() -> None:
    assert demo.choose_gpu(False, never) is False


def test_gpu_flag_without_gpu_is_one_line_exit_5() -> None:
    with pytest.raises(MissingDependencyError) as exc:
        demo.choose_gpu(True, lambda: "libcuda.so.1 not found")
    assert exc.value.exit_code == ExitCode.MISSING_DEPENDENCY
    assert "libcuda.so.1 not found" in str(exc.value) and "--no-gpu" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("backend", ["none", "standin:/tmp/x"])
def test_non_nvidia_backends_are_not_a_gpu_for_the_demo(backend: str, tmp_path: Path) -> None:
    settings = load_settings({"GPUSNAP_GPU_BACKEND": backend, "GPUSNAP_CONFIG": str(tmp_path / "none.toml")})
    reason = demo.gpu_unavailable_reason(settings)
    assert reason is not None and backend.split(":")[0] in reason


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this host has an NVIDIA driver")
def test_auto_backend_without_driver_has_a_reason(tmp_path: Path) -> None:
    settings = load_settings({"GPUSNAP_CONFIG": str(tmp_path / "none.toml")})
    assert demo.gpu_unavailable_reason(settings)


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("GPUSNAP_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setattr(demo, "gpu_unavailable_reason", lambda _settings: None)  # as on a GPU host


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), err


@pytest.mark.usefixtures("cli_env")
def test_missing_torch_is_one_line_exit_5(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # The test's own interpreter, with an import path where torch cannot be found.
    fake = tmp_path / "python-without-torch"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    fake.chmod(0o755)
    code, err = run_cli(capsys, "demo", "--gpu", "--python", str(fake))
    assert code == ExitCode.MISSING_DEPENDENCY
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cannot import torch" in lines[0] and "--python" in lines[0], err
    assert not (tmp_path / "run" / "engine" / "containers").exists()  # nothing started


@pytest.mark.usefixtures("cli_env")
def test_missing_interpreter_is_one_line_exit_5(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run_cli(capsys, "demo", "--python", str(tmp_path / "no-python"))
    assert code == ExitCode.MISSING_DEPENDENCY
    assert "not found" in err and len(err.strip().splitlines()) == 1


def test_parse_steps_ignores_other_output() -> None:
    text = "ready\nUserWarning: something\nstep 10 123\nstep 20 -5\nstep x 1\nstep 30\n"
    assert demo.parse_steps(text) == {10: 123, 20: -5}


def test_verdict_matches_and_continues() -> None:
    ref = {s: s * 7 for s in range(10, 101, 10)}
    v = demo.compare_with_reference({10: 70, 20: 140}, {30: 210, 40: 280}, ref, 10)
    assert v["resumed"] is True and v["values_matched"] is True and v["steps_compared"] == 4
    assert (v["stopped_at"], v["resumed_at"]) == (20, 30)


def test_verdict_catches_a_restart_and_a_wrong_value() -> None:
    ref = {s: s * 7 for s in range(10, 101, 10)}
    restarted = demo.compare_with_reference({10: 70, 20: 140}, {10: 70, 20: 140}, ref, 10)
    assert restarted["resumed"] is False
    wrong = demo.compare_with_reference({10: 70, 20: 140}, {30: 211, 40: 280}, ref, 10)
    assert wrong["values_matched"] is False and wrong["mismatched_steps"] == [30]
    beyond = demo.compare_with_reference({10: 70}, {20: 140, 110: 770}, ref, 10)
    assert beyond["values_matched"] is False  # a step the reference never reached proves nothing


def test_gpu_timings_names() -> None:
    t = demo.gpu_timings({"gpu_lock": 0.001, "gpu_checkpoint": 1.0, "criu_dump": 1.2, "total": 2.5, "other": 9.0})
    assert t == {"lock": 0.001, "gpu_to_host": 1.0, "criu_dump": 1.2, "total": 2.5}


def test_auto_mode_on_a_gpu_host_without_torch_falls_back_to_the_counter(
    cli_env: None, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "python-without-torch"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setattr(demo, "default_python", lambda: str(fake))
    ran: list[str] = []
    monkeypatch.setattr(demo, "run_gpu_demo", lambda *a, **k: ran.append("gpu") or {})
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: ran.append("counter") or {"resumed": True})
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert int(exc.value.code or 0) == 0 and ran == ["counter"]
    assert out["mode"] == "counter" and "cannot import torch" in out["gpu_skipped"]
    # --gpu, or --python, asks for the CUDA workload: test_missing_torch_is_one_line_exit_5.
