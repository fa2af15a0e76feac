"""What a newcomer hits in the first hour (issue 15), against the real stack: delete several
containers at once, inspect a checkpoint in a registry, import a podman export, doctor on a
host without busybox."""

from __future__ import annotations

import json
import subprocess

import pytest

from .conftest import COUNTER, Gs, unique

pytestmark = pytest.mark.integration


def test_delete_deletes_what_exists_and_reports_the_rest(gs: Gs) -> None:
    names = [unique("rd-del"), unique("rd-del")]
    missing = unique("rd-missing")
    try:
        for n in names:
            gs("run", n, "--", "sh", "-c", COUNTER)
        proc = gs("delete", names[0], missing, names[1], check=False)
        assert proc.returncode == 3, proc  # NOT_FOUND, as the README's table says
        assert proc.stderr.strip().splitlines() == [f"gpusnap: error: no runc-direct container {missing}; `gpusnap ps` lists them"]
        assert [ln for ln in proc.stdout.splitlines() if ln.startswith("deleted ")] == [f"deleted {n}" for n in names]
        assert gs.json("ps") == []
    finally:
        for n in names:
            gs("delete", n, check=False)


def test_doctor_without_busybox_warns_and_says_what_works(gs: Gs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import sys
    from pathlib import Path

    assert shutil_which("busybox"), "the test host has busybox (tests/host/provision.sh)"
    path = [d for d in os.environ["PATH"].split(":") if d and not (Path(d) / "busybox").exists()]
    path.insert(0, str(Path(sys.executable).parent))
    env = {"PATH": ":".join(path)}
    proc = gs("doctor", env=env)  # exit 0: a warning is not a failure
    report = json.loads(gs("doctor", "--json", env=env).stdout)
    [rd] = [c for c in report["checks"] if c["name"] == "engine runc-direct"]
    assert rd["status"] == "warn" and "--rootfs-overlay /" in rd["detail"] and "busybox" in rd["fix"]
    assert report["ok"] is True
    assert proc.stdout.strip().splitlines()[-1] == "all checks passed (1 warning)"
    # What the warning says still works does work, without busybox on PATH.
    name = unique("rd-nobusybox")
    try:
        gs("run", "--rootfs-overlay", "/", name, "--", "sh", "-c", COUNTER, env=env)
        assert [r["status"] for r in gs.json("ps")] == ["running"]  # type: ignore[union-attr,index]
        plain = gs("run", unique("rd-nobusybox"), "--", "true", check=False, env=env)
        assert plain.returncode == 5 and "busybox not found on PATH" in plain.stderr
    finally:
        gs("delete", name, check=False)


def shutil_which(name: str) -> str | None:
    import shutil

    return shutil.which(name)
