"""Networking through the `gpusnap` commands (runc-direct engine, --network bridge): an
established TCP connection across `checkpoint --leave-running --tcp-established` and across a
full checkpoint restored under a new name; 20 concurrent `gpusnap run`; nothing left after
`gpusnap delete`."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.config import load_settings
from gpusnap.network import NetworkManager
from gpusnap.network.nft import rule_comments

from .conftest import leftovers
from .helpers import LineClient, http_get

pytestmark = pytest.mark.integration

GPUSNAP = str(Path(sys.executable).parent / "gpusnap")
# It serves /etc (the engine's busybox rootfs has /etc/hostname): runc-direct rebuilds that rootfs
# at restore, so nothing the container writes there, nor a cwd it made there, would survive.
ECHO_SERVER = (
    "httpd -p 8080 -h /etc; "
    "exec nc -ll -p 80 -e sh -c 'n=0; while read line; do n=$((n+1)); echo \"$n:$line\"; done'"
)


class Gpusnap:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([GPUSNAP, *args], capture_output=True, text=True, env=self.env, timeout=300)
        if check and proc.returncode != 0:
            raise AssertionError(f"gpusnap {' '.join(args)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc

    def container(self, name: str) -> dict:  # type: ignore[type-arg]
        items = json.loads(self("ps", "--json").stdout)
        return next(i for i in items if i["name"] == name)

    @property
    def manager(self) -> NetworkManager:
        return NetworkManager(load_settings(env=self.env))


@pytest.fixture
def gsnap(stack: None, criu_tcp: str, workdir: Path) -> Iterator[Gpusnap]:
    env = dict(os.environ)
    env.update(
        GPUSNAP_RUN_DIR=str(workdir / "run"),
        GPUSNAP_STATE_DIR=str(workdir / "state"),
        GPUSNAP_STORE=str(workdir / "store"),
        GPUSNAP_CONFIG=str(workdir / "config.toml"),
        GPUSNAP_CRIU=criu_tcp,
        GPUSNAP_BRIDGE="gsnet1",
        GPUSNAP_SUBNET="10.233.11.0/24",
        GPUSNAP_NET_PREFIX="gs-net",
    )
    g = Gpusnap(env)
    yield g
    runc_root = workdir / "run" / "engine" / "runc"
    if runc_root.is_dir():
        for d in runc_root.iterdir():
            subprocess.run(["runc", "--root", str(runc_root), "delete", "-f", d.name], capture_output=True)
    nm = g.manager
    for cid in list(nm.ipam.read().leases):
        nm.remove(cid)
    nm.prune()


def test_tcp_connection_survives_gpusnap_checkpoints_and_restore_under_new_name(gsnap: Gpusnap, workdir: Path) -> None:
    gsnap("run", "gs-net-e2e1", "--network", "bridge", "-p", "5310:8080", "--", "sh", "-c", ECHO_SERVER)
    ip = gsnap.container("gs-net-e2e1")["labels"]["ip"]
    assert ip.startswith("10.233.11.")
    assert http_get("127.0.0.1", 5310, path="/hostname").endswith("gpusnap\n")
    client = LineClient(ip, 80)
    try:
        assert client.ask("one") == "1:one"
        gsnap("checkpoint", "gs-net-e2e1", "--leave-running", "--tcp-established", "-o", str(workdir / "cp-lr"))
        assert gsnap.container("gs-net-e2e1")["status"] == "running"
        assert client.ask("two") == "2:two"

        gsnap("checkpoint", "gs-net-e2e1", "--tcp-established", "-o", str(workdir / "cp"))
        client.send("three")  # while no process holds the socket
        meta = json.loads((workdir / "cp" / "gpusnap.json").read_text())
        assert meta["tcp_established"] is True
        assert meta["extra"]["network"]["address"] == ip and meta["extra"]["network"]["ports"][0]["host_port"] == 5310
        assert gsnap.manager.records() == []  # the checkpointed container's network is gone...

        gsnap("restore", str(workdir / "cp"), "--name", "gs-net-e2e2", "--tcp-established")
        restored = gsnap.container("gs-net-e2e2")
        assert restored["status"] == "running" and restored["labels"]["ip"] == ip  # ...and back, same address
        assert client.read_line() == "3:three"
        assert client.ask("four") == "4:four"
        assert http_get("127.0.0.1", 5310, path="/hostname").endswith("gpusnap\n")  # the published port follows it
    finally:
        client.close()

    gsnap("delete", "gs-net-e2e1", "gs-net-e2e2")
    nm = gsnap.manager
    assert leftovers(nm.config) == {"veths": [], "netns": []}
    assert rule_comments(nm.nft.listing()) == []
    assert nm.ipam.read().leases == {}


def test_restore_at_another_ip_and_bad_ip_is_refused(gsnap: Gpusnap, workdir: Path) -> None:
    gsnap("run", "gs-net-e2e3", "--network", "bridge", "--ip", "10.233.11.40", "--", "sh", "-c", ECHO_SERVER)
    assert gsnap.container("gs-net-e2e3")["labels"]["ip"] == "10.233.11.40"
    bad = gsnap("run", "gs-net-e2e4", "--network", "bridge", "--ip", "10.233.11.40", "--", "true", check=False)
    assert bad.returncode == 2 and "10.233.11.40 is already in use by container gs-net-e2e3" in bad.stderr + bad.stdout
    assert gsnap("ps", "--json").stdout.count("gs-net-e2e4") == 0  # nothing half-created
    gsnap("checkpoint", "gs-net-e2e3", "-o", str(workdir / "cp"))
    gsnap("restore", str(workdir / "cp"), "--name", "gs-net-e2e5", "--ip", "10.233.11.41")
    assert gsnap.container("gs-net-e2e5")["labels"]["ip"] == "10.233.11.41"
    assert http_get("10.233.11.41", 8080, path="/hostname").endswith("gpusnap\n")
    gsnap("delete", "gs-net-e2e3", "gs-net-e2e5")
    assert gsnap.manager.ipam.read().leases == {}


def test_twenty_gpusnap_runs_at_once_get_distinct_addresses(gsnap: Gpusnap) -> None:
    names = [f"gs-net-par{i:02d}" for i in range(20)]
    cmd = "exec httpd -f -p 8080 -h /etc"

    def start(name: str) -> subprocess.CompletedProcess[str]:
        return gsnap("run", name, "--network", "bridge", "--", "sh", "-c", cmd, check=False)

    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(start, names))
    assert [r.returncode for r in results] == [0] * 20, [r.stderr for r in results if r.returncode]
    ips = {n: gsnap.container(n)["labels"]["ip"] for n in names}
    assert len(set(ips.values())) == 20
    for ip in ips.values():
        assert http_get(ip, 8080, path="/hostname").endswith("gpusnap\n")
    gsnap("delete", *names)
    nm = gsnap.manager
    assert leftovers(nm.config) == {"veths": [], "netns": []}
    assert rule_comments(nm.nft.listing()) == [] and nm.ipam.read().leases == {}
