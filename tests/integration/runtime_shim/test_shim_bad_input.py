"""Bad input through gpusnap-runtime: one line naming the problem and the fix, nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from shimstack import COUNTER, RUNC, SHIM, Pipes, Shim, counter_values, make_bundle, run, unique, wait_counting

from gpusnap.errors import ExitCode

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]


def _leftovers(shim: Shim, bundle_root: Path) -> list[str]:
    found = [str(p) for p in shim.run_dir.rglob("*") if p.is_file()] if shim.run_dir.exists() else []
    return found + [p.name for p in bundle_root.iterdir()]


@pytest.mark.parametrize(
    ("mutate", "expect"),
    [
        (lambda text, spec: "{ not json", "not valid JSON at line 1 column 3"),
        (lambda text, spec: json.dumps({**spec, "process": {**spec["process"], "args": "sh -c true"}}), "process.args: 'sh -c true' is not of type 'array'"),
        (lambda text, spec: json.dumps({k: v for k, v in spec.items() if k != "root"}), "(top level): 'root' is a required property"),
        (lambda text, spec: json.dumps({**spec, "linux": {**spec["linux"], "devices": [{"path": "dev/x", "type": "c"}]}}), "linux.devices[0].path: 'dev/x' does not match"),
    ],
    ids=["syntax", "args-type", "no-root", "device-path"],
)
@pytest.mark.parametrize("command", ["create", "run"])
def test_malformed_config_fails_create_and_leaves_nothing(shim: Shim, data_dir: Path, tmp_path: Path, mutate, expect: str, command: str) -> None:
    bundle = make_bundle(tmp_path, ["true"], data_dir)
    config = bundle.path / "config.json"
    config.write_text(mutate(config.read_text(), json.loads(config.read_text())))
    before = config.read_bytes()
    cid = unique("bad")
    proc = run([str(shim.wrapper), "--root", str(bundle.root), command, "--bundle", str(bundle.path), cid], check=False, env=shim.env())
    assert proc.returncode == ExitCode.USAGE
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(config) in lines[0] and expect in lines[0], proc.stderr
    assert "fix the bundle's config.json" in lines[0]
    assert config.read_bytes() == before
    assert _leftovers(shim, bundle.root) == []
    assert run([RUNC, "--root", str(bundle.root), "state", cid], check=False).returncode != 0
    assert sorted(p.name for p in bundle.path.iterdir()) == ["config.json", "rootfs"]


def test_missing_runc_names_what_to_install(shim: Shim, tmp_path: Path) -> None:
    env = {**shim.env(), "GPUSNAP_RUNC": str(tmp_path / "no-runc")}
    proc = run([str(SHIM), "list"], check=False, env=env)
    assert proc.returncode == ExitCode.MISSING_DEPENDENCY
    assert "runc not found" in proc.stderr and "install runc" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    # Nothing called runc on PATH but the shim itself: it must not run itself in a loop.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "runc").symlink_to(SHIM)
    proc = run([str(bin_dir / "runc"), "list"], check=False, env={**shim.env(), "PATH": str(bin_dir)})
    assert proc.returncode == ExitCode.MISSING_DEPENDENCY and "install runc" in proc.stderr


def _fake_criu(path: Path, version: str, check_ok: bool) -> Path:
    path.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --version) echo "Version: {version}";; check) {"echo Looks good." if check_ok else "echo Error: kernel lacks what CRIU needs >&2; exit 1"};; *) exit 1;; esac\n'
    )
    path.chmod(0o755)
    return path


@pytest.mark.parametrize(
    ("criu", "expect"),
    [
        ("missing", "CRIU not found at"),
        ("old", "is 3.17.1, gpusnap needs 4.0 or newer"),
        ("check-fails", "check` failed on this kernel (Error: kernel lacks what CRIU needs)"),
    ],
)
def test_checkpoint_without_usable_criu_names_the_fix_and_keeps_running(shim: Shim, data_dir: Path, tmp_path: Path, criu: str, expect: str) -> None:
    fake = {
        "missing": tmp_path / "no-criu",
        "old": _fake_criu(tmp_path / "criu-old", "3.17.1", True),
        "check-fails": _fake_criu(tmp_path / "criu-bad", "4.1.1", False),
    }[criu]
    bundle = make_bundle(tmp_path, ["sh", "-c", COUNTER], data_dir)
    cid = unique("nocriu")
    pipes = Pipes()
    try:
        subprocess.run([str(shim.wrapper), "--root", str(bundle.root), "run", "-d", "--bundle", str(bundle.path), cid], check=True, env=shim.env(), **pipes.kwargs())
        wait_counting(data_dir, above=1)
        proc = run([str(SHIM), "--root", str(bundle.root), "checkpoint", "--image-path", str(tmp_path / "img"), cid], check=False, env={**shim.env(), "GPUSNAP_CRIU": str(fake)})
        assert proc.returncode == ExitCode.MISSING_DEPENDENCY
        assert expect in proc.stderr and "install CRIU 4.x" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        state = json.loads(run([RUNC, "--root", str(bundle.root), "state", cid]).stdout)
        assert state["status"] == "running"
        wait_counting(data_dir, above=counter_values(data_dir)[-1])
    finally:
        run([RUNC, "--root", str(bundle.root), "delete", "--force", cid], check=False)
        pipes.close()
