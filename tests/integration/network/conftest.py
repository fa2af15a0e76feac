"""Fixtures for networking on the real stack: root, runc, nft, a CRIU that can dump TCP sockets.

Everything created is named with the area tag ``gs-net`` / ``gsnet``, lives in 10.233.0.0/16,
and is removed after each test even when it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.config import Settings
from gpusnap.network import NetworkConfig, NetworkManager
from gpusnap.network import links

from .helpers import Runc

pytestmark = pytest.mark.integration

# CRIU before 4.2 reads SO_PASSCRED/SO_PASSSEC from every socket, which kernels >= 6.16 refuse
# for TCP sockets: no container with a TCP socket can be dumped. CRIU 4.2 carries the fix
# (tests/host/provision.sh installs it into /opt/gpusnap-criu42).
CRIU_CANDIDATES = (os.environ.get("GPUSNAP_CRIU", ""), "/opt/gpusnap-criu42/bin/criu", shutil.which("criu") or "")


def _criu_version(path: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    m = re.search(r"Version: (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else ()


def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int(re.match(r"\d+", minor).group())  # type: ignore[union-attr]


@pytest.fixture(scope="session")
def stack() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    for tool in ("runc", "nft", "busybox"):
        if not shutil.which(tool) and not Path(f"/bin/{tool}").exists():
            pytest.skip(f"{tool} not installed (run tests/host/provision.sh)")


@pytest.fixture(scope="session")
def criu_tcp(stack: None) -> str:
    """A CRIU that can dump TCP sockets on this kernel."""
    need = (4, 2) if _kernel() >= (6, 16) else (3, 11)
    for path in CRIU_CANDIDATES:
        if path and _criu_version(path) >= need:
            return path
    pytest.fail(f"no CRIU >= {need[0]}.{need[1]} found (kernel {os.uname().release}); run tests/host/provision.sh")


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gs-net-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def net_config() -> NetworkConfig:
    return NetworkConfig(netns_prefix="gs-net-ns-", veth_prefix="gsnetv", table="gsnet")


def teardown_manager(nm: NetworkManager) -> None:
    for cid in list(nm.ipam.read().leases):
        nm.remove(cid)
    nm.prune()


@pytest.fixture
def manager(stack: None, workdir: Path, net_config: NetworkConfig) -> Iterator[NetworkManager]:
    nm = NetworkManager(Settings(state_dir=workdir / "state", run_dir=workdir / "run"), net_config)
    yield nm
    teardown_manager(nm)


@pytest.fixture
def runc(workdir: Path, criu_tcp: str) -> Iterator[Runc]:
    r = Runc(workdir / "runc-root", criu=criu_tcp)
    yield r
    for state in (r.root.glob("*") if r.root.exists() else []):
        r.delete(state.name)
    r.close()


def leftovers(config: NetworkConfig, host_netns: str | None = None) -> dict[str, object]:
    """What of ours exists on the host (or the simulated one): must be empty after removal."""
    return {
        "veths": sorted(n for n in links.link_names(host_netns) if n.startswith(config.veth_prefix)),
        "netns": sorted(n for n in os.listdir(links.NETNS_DIR) if n.startswith(config.netns_prefix))
        if os.path.isdir(links.NETNS_DIR)
        else [],
    }
