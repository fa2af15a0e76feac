"""`gpusnap doctor` on the provisioned test host, and with CRIU hidden from PATH."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from gpusnap.errors import ExitCode

from .conftest import Gs

pytestmark = pytest.mark.integration


def test_doctor_reports_everything_ok(gs: Gs) -> None:
    proc = gs("doctor")
    assert proc.stdout.strip().splitlines()[-1] == "all checks passed"
    report = json.loads(gs("doctor", "--json").stdout)
    assert report["ok"] is True
    bad = [c for c in report["checks"] if c["status"] != "ok"]
    assert bad == []
    names = {c["name"] for c in report["checks"]}
    assert {"criu", "criu check", "kernel", "runc", "gpusnap-runtime", "engine runc-direct", "engine podman", "engine docker", "gpu driver", "store"} <= names
    # The table and the JSON say the same thing, line for line.
    lines = proc.stdout.strip().splitlines()[:-1]
    assert [ln.split()[0] for ln in lines] == [c["status"] for c in report["checks"]]
    assert [ln.split(":", 1)[0].split(None, 1)[1] for ln in lines] == [c["name"] for c in report["checks"]]


def test_doctor_without_criu_says_so_and_the_fix(gs: Gs, tmp_path: Path) -> None:
    criu = shutil.which("criu")
    assert criu, "the test host has CRIU (tests/host/provision.sh)"
    path = [d for d in os.environ["PATH"].split(":") if d and not (Path(d) / "criu").exists()]
    path.insert(0, str(Path(sys.executable).parent))
    env = {"PATH": ":".join(path)}
    proc = gs("doctor", check=False, env=env)
    assert proc.returncode == int(ExitCode.MISSING_DEPENDENCY)
    report = json.loads(gs("doctor", "--json", check=False, env=env).stdout)
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["criu", "criu check"]
    assert failed[0]["detail"] == "CRIU not found on PATH"
    assert "install CRIU >= 4.0" in failed[0]["fix"]
    assert "FAIL criu: CRIU not found on PATH -> fix: install CRIU >= 4.0" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "2 check(s) failed"
