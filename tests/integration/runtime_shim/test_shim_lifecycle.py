"""Plain container lifecycle through the shim behaves exactly as with runc itself."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from shimstack import DOCKER, DOCKER_IMAGE, PODMAN_IMAGE, RUNC, Shim, run, unique, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]


def podman_lifecycle(runtime: str, names: list[str]) -> dict[str, object]:
    """run, exec, logs, stop, rm and a container exiting with 3, recorded for comparison."""
    p = ["podman", "--runtime", runtime]
    name = unique("life")
    names.append(name)
    seen: dict[str, object] = {}
    run([*p, "run", "-d", "--name", name, PODMAN_IMAGE, "sh", "-c", "echo started; trap 'echo bye; exit 0' TERM; while true; do sleep 0.1; done"])
    wait_for(lambda: "started" in run([*p, "logs", name]).stdout, "the container's first log line")
    seen["status"] = run([*p, "inspect", "--format", "{{.State.Status}}", name]).stdout.strip()
    ex = run([*p, "exec", name, "sh", "-c", "echo in-container; echo to-stderr >&2; exit 4"], check=False)
    seen["exec"] = (ex.returncode, ex.stdout, ex.stderr)
    seen["exec_env"] = run([*p, "exec", "-e", "GS=1", name, "sh", "-c", "echo $GS"]).stdout
    seen["stop"] = run([*p, "stop", "-t", "5", name]).returncode
    seen["after_stop"] = run([*p, "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name]).stdout.strip()
    seen["logs"] = run([*p, "logs", name]).stdout
    seen["rm"] = run([*p, "rm", name]).returncode
    seen["gone"] = run([*p, "container", "exists", name], check=False).returncode
    exit3 = run([*p, "run", "--rm", PODMAN_IMAGE, "sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    seen["exit3"] = (exit3.returncode, exit3.stdout, exit3.stderr)
    return seen


def test_podman_lifecycle_same_as_runc(shim: Shim, podman_names: list[str]) -> None:
    with_runc = podman_lifecycle(RUNC, podman_names)
    with_shim = podman_lifecycle(str(shim.wrapper), podman_names)
    assert with_shim == with_runc
    assert with_shim["exit3"][0] == 3 and with_shim["exec"][0] == 4 and "bye" in str(with_shim["logs"])


def test_docker_lifecycle_same_as_runc(docker_runtime: tuple[str, Shim], docker_names: list[str]) -> None:
    runtime, _ = docker_runtime
    results = {}
    for label, rt in (("runc", "runc"), ("shim", runtime)):
        name = unique("dlife")
        docker_names.append(name)
        run([DOCKER, "run", "-d", "--runtime", rt, "--name", name, DOCKER_IMAGE, "sh", "-c", "echo started; while true; do sleep 0.1; done"])
        ex = run([DOCKER, "exec", name, "sh", "-c", "echo hi; exit 4"], check=False)
        stop = run([DOCKER, "stop", "-t", "1", name]).returncode
        logs = run([DOCKER, "logs", name]).stdout
        exit3 = run([DOCKER, "run", "--rm", "--runtime", rt, DOCKER_IMAGE, "sh", "-c", "echo out; exit 3"], check=False)
        results[label] = (ex.returncode, ex.stdout, stop, logs, exit3.returncode, exit3.stdout)
        run([DOCKER, "rm", name])
    assert results["shim"] == results["runc"]
    assert results["shim"][4] == 3


def _strip_times(text: str) -> str:
    return re.sub(r'time="[^"]*"', 'time="T"', text)


@pytest.mark.parametrize(
    "args",
    [
        ["--no-such-global", "list"],
        ["list", "--no-such-flag"],
        ["create", "--no-such-flag", "x", "gs-shim-unknown"],
        ["checkpoint", "--no-such-flag", "gs-shim-unknown"],
        ["state", "gs-shim-does-not-exist"],
        ["checkpoint", "gs-shim-does-not-exist"],
        ["restore", "--image-path", "/nonexistent", "gs-shim-does-not-exist"],
        ["kill", "gs-shim-does-not-exist", "KILL"],
    ],
)
def test_runc_errors_pass_through_unchanged(shim: Shim, tmp_path: Path, args: list[str]) -> None:
    """Unknown flags and runc's own failures: same exit status, same stdout and stderr as runc."""
    root = tmp_path / "root"
    root.mkdir()
    out = {}
    for label, binary in (("runc", RUNC), ("shim", str(shim.wrapper))):
        proc = run([binary, "--root", str(root), *args], check=False, env=shim.env(), cwd=tmp_path)
        out[label] = (proc.returncode, proc.stdout, _strip_times(proc.stderr))
    assert out["shim"] == out["runc"]
    assert out["shim"][0] != 0


def test_features_and_version(shim: Shim) -> None:
    env = shim.env()
    assert run([str(shim.wrapper), "features"], env=env).stdout == run([RUNC, "features"]).stdout
    shim_version = run([str(shim.wrapper), "--version"], env=env).stdout.splitlines()
    assert shim_version[0].startswith("gpusnap-runtime version ")
    assert shim_version[1:] == run([RUNC, "--version"]).stdout.splitlines()
