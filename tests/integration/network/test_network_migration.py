"""Migration to a "second host": two network namespaces stand for two hosts, each with its own
bridge, nftables table and gpusnap state directory; the client sits in the initial namespace and
reaches the container's subnet through whichever host holds it (as a cluster's routing would)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpusnap.config import Settings
from gpusnap.network import NetworkConfig, NetworkManager, NetworkRequest
from gpusnap.network import links

from .conftest import leftovers, teardown_manager
from .helpers import LineClient, Runc, http_get, make_rootfs, write_bundle

pytestmark = pytest.mark.integration

SUBNET = "10.233.5.0/24"


@dataclass
class SimHost:
    name: str  # its network namespace
    uplink: str  # veth end in the initial namespace
    own: str  # its address on the uplink
    peer: str  # the initial namespace's address on the uplink
    manager: NetworkManager


def _make_host(workdir: Path, name: str, uplink: str, net: int) -> SimHost:
    links.create_netns(name)
    own, peer = f"10.233.{net}.2", f"10.233.{net}.1"
    with links.rtnl() as ipr:
        ipr.link("add", ifname=uplink, kind="veth", peer={"ifname": "uplink0", "net_ns_fd": name})
        index = ipr.link_lookup(ifname=uplink)[0]
        ipr.addr("add", index=index, address=peer, prefixlen=30)
        ipr.link("set", index=index, state="up")
    with links.rtnl(name) as ns:
        for ifname in ("lo", "uplink0"):
            ns.link("set", index=ns.link_lookup(ifname=ifname)[0], state="up")
        ns.addr("add", index=ns.link_lookup(ifname="uplink0")[0], address=own, prefixlen=30)
        ns.route("add", dst="0.0.0.0/0", gateway=peer)
    config = NetworkConfig(netns_prefix="gs-net-ns-", veth_prefix="gsnetv", table="gsnet", host_netns=name)
    manager = NetworkManager(Settings(state_dir=workdir / name, run_dir=workdir / name / "run"), config)
    return SimHost(name, uplink, own, peer, manager)


def _route_subnet_via(host: SimHost) -> None:
    with links.rtnl() as ipr:
        ipr.route("replace", dst=SUBNET, gateway=host.own)


@pytest.fixture
def hosts(stack: None, workdir: Path) -> Iterator[tuple[SimHost, SimHost]]:
    made: list[SimHost] = []
    try:
        made.append(_make_host(workdir, "gs-net-hosta", "gsnetupa", 250))
        made.append(_make_host(workdir, "gs-net-hostb", "gsnetupb", 251))
        yield made[0], made[1]
    finally:
        with links.rtnl() as ipr:
            try:
                ipr.route("del", dst=SUBNET)
            except Exception:  # noqa: BLE001 - not added when setup failed early
                pass
        for host in made:
            teardown_manager(host.manager)
            links.remove_netns(host.name)  # takes its veths and bridge with it
        with links.rtnl() as ipr:
            for host in made:
                links.delete_link(ipr, host.uplink)


def test_established_tcp_connection_follows_the_container_to_a_second_host(
    hosts: tuple[SimHost, SimHost], runc: Runc, workdir: Path
) -> None:
    host_a, host_b = hosts
    request = NetworkRequest(bridge="gsnet0", subnet=SUBNET)
    rootfs = make_rootfs(workdir)

    rec = host_a.manager.create("gs-net-mig1", request)
    assert "gsnet0" in links.link_names(host_a.name) and "gsnet0" not in links.link_names(host_b.name)
    _route_subnet_via(host_a)
    runc.run("gs-net-mig1", write_bundle(workdir / "b1", rec.netns_path, rootfs))
    client = LineClient(rec.address, 80)
    try:
        assert client.ask("on-a") == "1:on-a"
        runc.checkpoint("gs-net-mig1", workdir / "img-a", leave_running=False)
        client.send("in-flight")
        runc.delete("gs-net-mig1")
        host_a.manager.remove("gs-net-mig1")
        assert leftovers(host_a.manager.config, host_a.name) == {"veths": [], "netns": []}

        # "Copy" the images to host B; rebuild the network there from the recorded record.
        shutil.copytree(workdir / "img-a", workdir / "img-b")
        rec_b = host_b.manager.recreate(rec, container_id="gs-net-mig2")
        assert (rec_b.address, rec_b.mac, rec_b.gateway) == (rec.address, rec.mac, rec.gateway)
        assert host_b.manager.get("gs-net-mig2") == rec_b and host_a.manager.get("gs-net-mig1") is None
        _route_subnet_via(host_b)
        runc.restore("gs-net-mig2", write_bundle(workdir / "b2", rec_b.netns_path, rootfs), workdir / "img-b")
        host_b.manager.activate("gs-net-mig2")

        assert client.read_line() == "2:in-flight"
        assert client.ask("on-b") == "3:on-b"
        assert http_get(rec.address, 8080).endswith("hello\n")  # and new connections reach it on B
    finally:
        client.close()
    runc.delete("gs-net-mig2")
    host_b.manager.remove("gs-net-mig2")
    assert leftovers(host_b.manager.config, host_b.name) == {"veths": [], "netns": []}
    tables = [i["table"]["name"] for i in host_b.manager.nft.listing()["nftables"] if "table" in i]
    assert tables == ["gsnet"]  # gpusnap's table lives in host B's own netns
    assert host_b.manager.prune() == ["gsnet0"]


def test_restore_with_another_ip_on_the_second_host(hosts: tuple[SimHost, SimHost], runc: Runc, workdir: Path) -> None:
    """--ip: the process comes back under a new address (its old connections cannot follow)."""
    host_a, host_b = hosts
    rootfs = make_rootfs(workdir)
    args = ["/bin/sh", "-c", "echo hello > /www/index.html; exec httpd -f -p 8080 -h /www"]
    rec = host_a.manager.create("gs-net-ip1", NetworkRequest(bridge="gsnet0", subnet=SUBNET))
    runc.run("gs-net-ip1", write_bundle(workdir / "b1", rec.netns_path, rootfs, args))
    runc.checkpoint("gs-net-ip1", workdir / "img", leave_running=False)
    runc.delete("gs-net-ip1")
    host_a.manager.remove("gs-net-ip1")

    rec_b = host_b.manager.recreate(rec, ip="10.233.5.77", container_id="gs-net-ip2")
    assert rec_b.address == "10.233.5.77" and rec_b.mac == rec.mac
    assert links.container_side(rec_b.netns, "eth0")["addresses"] == ["10.233.5.77/24"]
    _route_subnet_via(host_b)
    runc.restore("gs-net-ip2", write_bundle(workdir / "b2", rec_b.netns_path, rootfs, args), workdir / "img")
    host_b.manager.activate("gs-net-ip2")
    assert http_get("10.233.5.77", 8080).endswith("hello\n")
    runc.delete("gs-net-ip2")
    host_b.manager.remove("gs-net-ip2")
