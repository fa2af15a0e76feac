"""`gpusnap doctor`'s network-lock line: iptables-restore, or which CRIU can do without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.config import load_settings
from gpusnap.admin.doctor import FAIL, OK, WARN, check_network_lock


def fake_criu(tmp_path: Path, version: str) -> str:
    exe = tmp_path / f"criu-{version}"
    exe.write_text(f"#!/bin/sh\necho 'Version: {version}'\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize(("version", "status"), [("4.2.1", WARN), ("4.1.1", FAIL)])
def test_without_iptables_the_criu_version_decides(tmp_path: Path, version: str, status: str) -> None:
    settings = load_settings(env={}, criu=fake_criu(tmp_path, version))
    (check,) = check_network_lock(settings, which=lambda _name: None)
    assert check.status == status and "iptables-restore" in check.detail
    assert "apt-get install iptables" in check.fix
    if status == FAIL:
        assert "CRIU >= 4.2" in check.fix


def test_iptables_present_is_ok(tmp_path: Path) -> None:
    settings = load_settings(env={}, criu=fake_criu(tmp_path, "4.1.1"))
    (check,) = check_network_lock(settings, which=lambda name: f"/usr/sbin/{name}")
    assert check.status == OK and "/usr/sbin/iptables-restore" in check.detail
