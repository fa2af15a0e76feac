"""runc containers joining gpusnap networks: reachability, TCP across checkpoint/restore,
concurrency, bad input. Real runc, real CRIU, real netlink and nftables."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from pathlib import Path

import pytest

from gpusnap.config import Settings
from gpusnap.errors import ExitCode
from gpusnap.metadata import CheckpointMetadata
from gpusnap.network import (
    AddressInUseError,
    BridgeConfigError,
    NetworkConfig,
    NetworkManager,
    NetworkRequest,
    PortInUseError,
    load_from_metadata,
    parse_publish_list,
    store_in_metadata,
)
from gpusnap.network import links
from gpusnap.network.nft import rule_comments

from .conftest import leftovers
from .helpers import LineClient, Runc, http_get, make_rootfs, write_bundle

pytestmark = pytest.mark.integration

BRIDGE = "gsnet0"


def request(subnet: str = "10.233.1.0/24", **kw: object) -> NetworkRequest:
    return NetworkRequest(bridge=BRIDGE, subnet=subnet, **kw)  # type: ignore[arg-type]


def assert_clean(nm: NetworkManager) -> None:
    assert leftovers(nm.config, nm.config.host_netns) == {"veths": [], "netns": []}
    assert rule_comments(nm.nft.listing()) == []
    assert nm.ipam.read().leases == {}


def test_container_gets_address_route_mac_and_published_port(manager: NetworkManager, runc: Runc, workdir: Path) -> None:
    rec = manager.create("gs-net-web", request(ports=parse_publish_list(["5301:8080"])))
    seen = links.container_side(rec.netns, "eth0")
    assert seen["addresses"] == [f"{rec.address}/24"] and seen["mac"] == rec.mac and seen["up"]
    assert {"dst": "default", "gateway": "10.233.1.1"} in seen["routes"]
    assert rec.netns_path == f"/var/run/netns/{rec.netns}" and os.path.exists(rec.netns_path)

    runc.run("gs-net-web", write_bundle(workdir / "b", rec.netns_path, make_rootfs(workdir)))
    assert http_get(rec.address, 8080).endswith("hello\n")  # straight to the container
    assert http_get("127.0.0.1", 5301).endswith("hello\n")  # published, from the host's loopback
    assert http_get(rec.gateway, 5301).endswith("hello\n")  # published, on a host address

    # The record travels in checkpoint metadata and comes back equal.
    meta = CheckpointMetadata(container_id="gs-net-web", created="2026-01-01T00:00:00Z")
    store_in_metadata(meta, rec)
    meta.write(workdir)
    assert load_from_metadata(CheckpointMetadata.read(workdir)) == rec  # type: ignore[arg-type]

    runc.delete("gs-net-web")
    assert manager.remove("gs-net-web") is True
    assert_clean(manager)
    assert rec.address not in links.all_addresses()


def test_tcp_connection_survives_leave_running_then_full_checkpoint_and_restore_under_new_name(
    manager: NetworkManager, runc: Runc, workdir: Path
) -> None:
    rec = manager.create("gs-net-tcp1", request())
    rootfs = make_rootfs(workdir)
    runc.run("gs-net-tcp1", write_bundle(workdir / "b1", rec.netns_path, rootfs))
    client = LineClient(rec.address, 80)
    try:
        assert client.ask("before") == "1:before"

        runc.checkpoint("gs-net-tcp1", workdir / "img-lr", leave_running=True)
        assert runc.state("gs-net-tcp1") == "running"
        assert client.ask("after-leave-running") == "2:after-leave-running"

        runc.checkpoint("gs-net-tcp1", workdir / "img", leave_running=False)
        assert runc.state("gs-net-tcp1") in ("stopped", "absent")
        client.send("while-down")  # the kernel retransmits it until the restored socket answers
        runc.delete("gs-net-tcp1")
        manager.remove("gs-net-tcp1")

        rec2 = manager.recreate(rec, container_id="gs-net-tcp2")
        assert (rec2.address, rec2.mac, rec2.netns) == (rec.address, rec.mac, "gs-net-ns-gs-net-tcp2")
        # Held unplugged until the sockets are back: a retransmission reaching the namespace now
        # would meet no socket and be answered with a RST. Give the client time to retransmit.
        assert not links.container_side(rec2.netns, "eth0")["carrier"]
        time.sleep(1.5)
        runc.restore("gs-net-tcp2", write_bundle(workdir / "b2", rec2.netns_path, rootfs), workdir / "img")
        manager.activate("gs-net-tcp2")
        assert client.read_line() == "3:while-down"
        assert client.ask("after-restore") == "4:after-restore"
        assert client.ask("again") == "5:again"
    finally:
        client.close()
    runc.delete("gs-net-tcp2")
    manager.remove("gs-net-tcp2")
    assert_clean(manager)


def _start_one(args: tuple[str, str, str, str]) -> tuple[str, str]:
    """Runs in its own process, as concurrent ``gpusnap run`` invocations would."""
    state_dir, runc_root, criu, workdir = args
    cid = f"gs-net-many-{os.getpid()}"
    nm = NetworkManager(Settings(state_dir=Path(state_dir)), NetworkConfig(netns_prefix="gs-net-ns-", veth_prefix="gsnetv", table="gsnet"))
    rec = nm.create(cid, request("10.233.2.0/24"))
    rootfs = Path(workdir) / "rootfs"
    bundle = write_bundle(Path(workdir) / cid, rec.netns_path, rootfs, ["/bin/sh", "-c", "echo hello > /www/index.html; exec httpd -f -p 8080 -h /www"])
    Runc(Path(runc_root), criu=criu).run(cid, bundle)
    return cid, rec.address


def test_twenty_containers_started_at_once_get_distinct_addresses_and_leave_nothing(
    manager: NetworkManager, runc: Runc, workdir: Path, criu_tcp: str
) -> None:
    make_rootfs(workdir)
    args = (str(manager.settings.state_dir), str(runc.root), criu_tcp, str(workdir))
    with concurrent.futures.ProcessPoolExecutor(max_workers=20) as pool:
        started = list(pool.map(_start_one, [args] * 20))
    addresses = [a for _, a in started]
    assert len(set(addresses)) == 20, addresses
    assert {r.address for r in manager.records()} == set(addresses)
    for _, address in started:
        assert http_get(address, 8080).endswith("hello\n")
    assert len(leftovers(manager.config)["veths"]) == 20

    for cid, _ in started:
        runc.delete(cid)
        manager.remove(cid)
    assert_clean(manager)
    assert not set(addresses) & links.all_addresses()
    assert manager.prune() == [BRIDGE]
    assert BRIDGE not in links.link_names()
    assert manager.nft.listing() == {"nftables": []}


def test_bad_input_is_refused_with_one_line_and_nothing_half_created(manager: NetworkManager) -> None:
    first = manager.create("gs-net-bad1", request(ports=parse_publish_list(["5302:80"])))
    before = (leftovers(manager.config), rule_comments(manager.nft.listing()), json.dumps(manager.ipam.read().to_dict()))

    cases = [
        (AddressInUseError, lambda: manager.create("gs-net-bad2", request(ip=first.address)), "already in use"),
        (PortInUseError, lambda: manager.create("gs-net-bad3", request(ports=parse_publish_list(["5302:81"]))), "already published"),
        (BridgeConfigError, lambda: manager.create("gs-net-bad4", request(subnet="10.233.9.0/24")), "configured with subnet"),
        (BridgeConfigError, lambda: manager.create("gs-net-bad5", NetworkRequest(bridge="lo", subnet="10.233.8.0/24")), "not a bridge"),
    ]
    for cls, call, words in cases:
        with pytest.raises(cls) as info:
            call()
        message = str(info.value)
        assert words in message and "\n" not in message
        assert info.value.exit_code == ExitCode.USAGE
        assert (leftovers(manager.config), rule_comments(manager.nft.listing()), json.dumps(manager.ipam.read().to_dict())) == before

    # A bridge that exists on the host with another address is refused, not reconfigured.
    other = NetworkManager(manager.settings, NetworkConfig(netns_prefix="gs-net-ns-", veth_prefix="gsnetv", table="gsnet"))
    with links.rtnl() as ipr:
        links.create_bridge(ipr, "gsnet7", "10.233.7.1", 24, 1500)
    try:
        with pytest.raises(BridgeConfigError, match="gsnet7 exists with 10.233.7.1/24"):
            other.create("gs-net-bad6", NetworkRequest(bridge="gsnet7", subnet="10.233.6.0/24"))
        assert "gsnet7" not in manager.ipam.read().bridges
    finally:
        with links.rtnl() as ipr:
            links.delete_link(ipr, "gsnet7")

    manager.remove("gs-net-bad1")
    assert_clean(manager)


def test_remove_of_unknown_container_is_harmless_or_not_found(manager: NetworkManager) -> None:
    assert manager.remove("gs-net-never") is False
    with pytest.raises(Exception) as info:
        manager.remove("gs-net-never", missing_ok=False)
    assert getattr(info.value, "exit_code", None) == ExitCode.NOT_FOUND
