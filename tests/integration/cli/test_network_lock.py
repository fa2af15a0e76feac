"""runc-direct containers without network on a host without iptables (GPU images often lack it).

CRIU locks a dumped container's network namespace with iptables-restore at dump and at restore.
A "none" container's namespace holds only loopback, so gpusnap asks CRIU 4.2+ to skip that lock;
with CRIU 4.1 (which crashes on the option in runc's RPC mode) it refuses up front instead,
leaving the container running. The PATH given to gpusnap here is this host's with every
iptables/ip6tables/nft program left out, so CRIU really cannot find them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import COUNTER, Gs, counter_numbers, unique, wait_numbers

pytestmark = pytest.mark.integration

CRIU42 = os.environ.get("GPUSNAP_TEST_CRIU42", "/opt/gpusnap-criu42/bin/criu")
_HIDDEN = re.compile(r"^(ip6?tables|nft$)")


def _version(criu: str) -> tuple[int, int]:
    out = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"Version: (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@pytest.fixture
def no_iptables_path(tmp_path: Path) -> str:
    """A PATH directory of links to every program on this PATH but the packet-filter tools."""
    bindir = tmp_path / "path-without-iptables"
    bindir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for entry in os.scandir(d):
            link = bindir / entry.name
            if _HIDDEN.match(entry.name) or link.exists() or link.is_symlink():
                continue
            link.symlink_to(entry.path)
    assert shutil.which("iptables-restore", path=str(bindir)) is None
    return str(bindir)


def _logs(gs: Gs, name: str) -> str:
    return gs("logs", name, check=False).stdout


def test_none_network_with_criu42_checkpoints_and_restores_without_iptables(gs: Gs, no_iptables_path: str, tmp_path: Path) -> None:
    if not os.access(CRIU42, os.X_OK) or _version(CRIU42) < (4, 2):
        pytest.skip(f"CRIU 4.2 not at {CRIU42} (tests/host/provision.sh installs it into /opt/gpusnap-criu42)")
    env = {"PATH": no_iptables_path, "GPUSNAP_CRIU": CRIU42}
    name = unique("nolock")
    gs("run", name, "--", "sh", "-c", COUNTER, env=env)
    spec = json.loads((gs.root / "run" / "engine" / "containers" / name / "bundle" / "config.json").read_text())
    assert spec["annotations"]["gpusnap.io/criu-options"] == "network-lock skip"
    assert "network-lock skip" in (gs.root / "run" / "criu" / f"{name}.conf").read_text().splitlines()
    before = wait_numbers(lambda: _logs(gs, name), 3)
    gs("checkpoint", name, "--output", str(tmp_path / "cp"), env=env)
    last = counter_numbers(_logs(gs, name))[-1]
    assert last >= before[-1]
    gs("delete", name, env=env)
    gs("restore", str(tmp_path / "cp"), "--name", name + "-r", env=env)
    after = wait_numbers(lambda: _logs(gs, name + "-r"), 3)
    assert after[0] == last + 1 and after[:3] == [last + 1, last + 2, last + 3], (last, after)
    gs("delete", name + "-r", env=env)


def test_none_network_with_older_criu_refused_up_front_and_keeps_running(gs: Gs, no_iptables_path: str, tmp_path: Path) -> None:
    criu = shutil.which("criu")
    if criu is None or _version(criu) >= (4, 2):
        pytest.skip("needs the default CRIU 4.1 on PATH (tests/host/provision.sh)")
    env = {"PATH": no_iptables_path, "GPUSNAP_CRIU": criu}
    name = unique("lock41")
    gs("run", name, "--", "sh", "-c", COUNTER, env=env)
    assert "network-lock" not in (gs.root / "run" / "criu" / f"{name}.conf").read_text()  # 4.1 would crash on it
    wait_numbers(lambda: _logs(gs, name), 2)
    proc = gs("checkpoint", name, "--output", str(tmp_path / "cp"), env=env, check=False)
    assert proc.returncode == 5, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "iptables-restore, which is not on PATH" in err[0] and "apt-get install iptables" in err[0], proc.stderr
    assert not (tmp_path / "cp").exists()
    seen = len(counter_numbers(_logs(gs, name)))
    assert len(wait_numbers(lambda: _logs(gs, name), seen + 2)) >= seen + 2  # still counting
    assert gs.json("ps")[0]["status"] == "running"  # type: ignore[index]

    # A checkpoint taken where iptables exists cannot be restored here either: said before starting.
    gs("checkpoint", name, "--output", str(tmp_path / "cp"))
    gs("delete", name)
    proc = gs("restore", str(tmp_path / "cp"), "--name", name + "-r", env=env, check=False)
    assert proc.returncode == 5 and "cannot restore" in proc.stderr and "iptables" in proc.stderr, proc.stderr
    assert gs.json("ps") == [] and not (gs.root / "run" / "engine" / "containers" / (name + "-r")).exists()
