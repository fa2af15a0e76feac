"""``NetworkManager``: a container's network for the runc-direct engine, created before the
container process runs and removed at delete; recreated (same address, same MAC) before a
restore so CRIU can put established TCP connections back.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pyroute2 import netns as pyroute2_netns

from gpusnap.config import Settings
from gpusnap.errors import GpusnapError, NotFoundError, RollbackError, UsageError
from gpusnap.network import links
from gpusnap.network.ipam import Ipam
from gpusnap.network.nft import Nft, rule_comments
from gpusnap.network.record import NetworkRecord, RouteRecord
from gpusnap.network.request import NetworkConfig, NetworkRequest, PortMapping, gateway_of, parse_ip, parse_subnet
from gpusnap.steps import Step, StepFailed, run_steps

CONTAINER_IFNAME = "eth0"
T = TypeVar("T")


class NetworkManager:
    """Bridge + veth + IPAM + nftables for containers of one host (one ``Settings.state_dir``)."""

    def __init__(self, settings: Settings, config: NetworkConfig | None = None) -> None:
        self.settings = settings
        self.config = config or NetworkConfig.from_prefix(settings.network_prefix)
        self.ipam = Ipam(settings.state_dir)
        self.nft = Nft(self.config.table, netns=self.config.host_netns)

    # -- names -------------------------------------------------------------------------------

    def netns_name(self, container_id: str) -> str:
        return f"{self.config.netns_prefix}{container_id}"

    def host_veth(self, container_id: str) -> str:
        return links.host_veth_name(self.config.veth_prefix, container_id)

    # -- public API --------------------------------------------------------------------------

    def request(self, ports: tuple[PortMapping, ...] = (), ip: str | None = None, nat: bool = True) -> NetworkRequest:
        """A request on this host's configured bridge and subnet (``Settings.network_*``)."""
        return NetworkRequest(
            bridge=self.settings.network_bridge, subnet=self.settings.network_subnet, ip=ip, ports=tuple(ports), nat=nat
        )

    def create(self, container_id: str, request: NetworkRequest) -> NetworkRecord:
        """Give ``container_id`` a netns on the bridge; all-or-nothing (undone on any failure)."""
        return self._create(container_id, request, mac=links.random_mac())

    def recreate(self, record: NetworkRecord, ip: str | None = None, container_id: str | None = None) -> NetworkRecord:
        """Rebuild a checkpointed container's network before ``runc restore``; held down until
        :meth:`activate`, which the caller runs once the restore has finished.

        Same address and MAC by default (established TCP connections need the address; the MAC
        keeps peers' ARP caches valid); ``ip`` picks another address in the same subnet, which
        restores the process but not its established connections. ``container_id`` is the name
        the container is restored under (default: the checkpointed one).
        """
        subnet = parse_subnet(record.subnet)
        address = str(parse_ip(ip, subnet)) if ip else record.address
        request = NetworkRequest(
            bridge=record.bridge, subnet=record.subnet, ip=address, ports=record.ports, nat=record.nat, mtu=record.mtu
        )
        return self._create(container_id or record.container_id, request, mac=record.mac, up=False)

    def activate(self, container_id: str) -> None:
        """Connect a recreated network once ``runc restore`` has put the sockets back.

        ``recreate`` leaves the host end of the veth down. While the address exists but the
        restored sockets do not yet, a peer's retransmission would reach the namespace and be
        answered with a RST, killing the very connection being restored. Down, it is simply lost
        and retransmitted later, to the restored socket.
        """
        record = self.get(container_id)
        if record is None:
            raise NotFoundError(f"container {container_id} has no gpusnap network; create or recreate it first")
        self._in_host(lambda ipr: links.set_link_up(ipr, record.host_veth))

    def get(self, container_id: str) -> NetworkRecord | None:
        lease = self.ipam.get(container_id)
        return lease.record if lease else None

    def records(self) -> list[NetworkRecord]:
        return [lease.record for lease in self.ipam.read().leases.values() if lease.record]

    def remove(self, container_id: str, *, missing_ok: bool = True) -> bool:
        """Take down everything ``create`` made for ``container_id``; False if it had nothing.

        Every part is attempted even when one fails; what could not be removed is named in the
        error. The lease is released last so its address is never handed out while in use.
        """
        lease = self.ipam.get(container_id)
        if lease is None and not missing_ok:
            raise NotFoundError(f"container {container_id} has no gpusnap network; nothing to remove")
        record = lease.record if lease else None
        netns_name = record.netns if record else self.netns_name(container_id)
        host_veth = record.host_veth if record else self.host_veth(container_id)
        left: list[str] = []
        for what, action in (
            ("nftables rules", lambda: self.nft.remove_container(container_id)),
            (f"veth {host_veth}", lambda: self._in_host(lambda ipr: links.delete_link(ipr, host_veth))),
            (f"netns {netns_name}", lambda: links.remove_netns(netns_name)),
        ):
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - try the rest, report all that is left
                left.append(f"{what} ({links.netlink_message(exc)})")
        if left:
            raise RollbackError(f"could not remove {', '.join(left)} of container {container_id}; remove by hand and retry")
        if lease is not None:
            self.ipam.release(container_id)
        return lease is not None

    def prune(self) -> list[str]:
        """Remove bridges that no container uses and, when no container is left, the nft table."""
        removed: list[str] = []
        with self.ipam.locked() as state:
            used = {lease.bridge for lease in state.leases.values()}
            for bridge in sorted(set(state.bridges) - used):
                self._delete_host_link(bridge)
                del state.bridges[bridge]
                removed.append(bridge)
            # The table may hold rules of containers recorded in another state directory on the
            # same host: drop it only when no rule at all is left in it.
            if not state.leases and not rule_comments(self.nft.listing()):
                self.nft.delete_table()
        return removed

    # -- internals ---------------------------------------------------------------------------

    def _delete_host_link(self, ifname: str) -> None:
        self._in_host(lambda ipr: links.delete_link(ipr, ifname))

    def _in_host(self, fn: Callable[[links.IPRoute], T]) -> T:
        """Run ``fn`` with an rtnetlink socket in the namespace holding the bridge."""
        with links.rtnl(self.config.host_netns) as ipr:
            return fn(ipr)

    def _create(self, container_id: str, request: NetworkRequest, mac: str, up: bool = True) -> NetworkRecord:
        subnet = ipaddress.IPv4Network(request.subnet)
        gateway = str(gateway_of(subnet))
        netns_name = self.netns_name(container_id)
        host_veth = self.host_veth(container_id)
        if links.netns_exists(netns_name):
            raise UsageError(f"network namespace {netns_name} already exists; remove container {container_id} first")
        state: dict[str, object] = {}

        def ensure_bridge(ipr: links.IPRoute) -> bool:
            if links.check_bridge(ipr, request.bridge, gateway, subnet.prefixlen):
                return False
            links.create_bridge(ipr, request.bridge, gateway, subnet.prefixlen, request.mtu)
            return True

        def lease() -> None:
            # Bridge check/creation and the lease share one lock: two first containers racing
            # must not both create the bridge, and a refused bridge must not leave a lease.
            with self.ipam.locked() as ipam_state:
                ipam_state.bind_bridge(request.bridge, request.subnet)
                state["created_bridge"] = self._in_host(ensure_bridge)
                state["address"] = ipam_state.allocate(container_id, request.bridge, request.ip, list(request.ports))

        def unlease() -> None:
            with self.ipam.locked() as ipam_state:
                ipam_state.leases.pop(container_id, None)
                if state.get("created_bridge") and request.bridge not in {
                    lease.bridge for lease in ipam_state.leases.values()
                }:
                    self._in_host(lambda ipr: links.delete_link(ipr, request.bridge))
                    ipam_state.bridges.pop(request.bridge, None)

        def record() -> NetworkRecord:
            return NetworkRecord(
                container_id=container_id,
                netns=netns_name,
                netns_path=links.netns_path(netns_name),
                bridge=request.bridge,
                subnet=request.subnet,
                address=str(state["address"]),
                prefixlen=subnet.prefixlen,
                gateway=gateway,
                mac=mac,
                ifname=CONTAINER_IFNAME,
                host_veth=host_veth,
                mtu=request.mtu,
                routes=(RouteRecord("default", gateway),),
                ports=tuple(request.ports),
                nat=request.nat,
            )

        def add_rules() -> None:
            self.nft.ensure_table()
            self.nft.add_container(record())

        steps = [
            Step("lease address", lease, unlease),
            Step("create netns", lambda: links.create_netns(netns_name), lambda: links.remove_netns(netns_name)),
            Step(
                "create veth",
                lambda: self._in_host(
                    lambda ipr: links.create_veth(
                        ipr, host_veth, CONTAINER_IFNAME, netns_name, request.bridge, request.mtu, up=up
                    )
                ),
                lambda: self._in_host(lambda ipr: links.delete_link(ipr, host_veth)),
            ),
            Step(
                "configure container interface",
                lambda: links.configure_container_side(
                    netns_name, CONTAINER_IFNAME, mac, str(state["address"]), subnet.prefixlen, gateway
                ),
            ),
            Step("enable forwarding", lambda: self._sysctls(request)),
            Step(
                "add nftables rules",
                add_rules,
                lambda: self.nft.remove_container(container_id),
            ),
            Step("record network", lambda: self.ipam.commit(record())),
        ]
        try:
            run_steps(steps)
        except StepFailed as exc:
            # Fully rolled back: the cause alone is the clearer one-line message (and its class,
            # AddressInUseError / PortInUseError / BridgeConfigError, is what callers match on).
            if not exc.undo_errors and isinstance(exc.cause, GpusnapError):
                raise exc.cause from None
            raise
        return record()

    def _sysctls(self, request: NetworkRequest) -> None:
        """Forwarding for NAT and published ports; route_localnet for 127.0.0.1:PORT clients.

        Only ever switched on, never back off: other engines on the host rely on them too.
        """
        if request.nat or request.ports:
            self._write_sysctl("net/ipv4/ip_forward", "1")
        if request.ports:
            self._write_sysctl(f"net/ipv4/conf/{request.bridge}/route_localnet", "1")

    def _write_sysctl(self, key: str, value: str) -> None:
        path = Path("/proc/sys") / key
        if self.config.host_netns is None:
            _write_if_different(path, value)
            return
        # /proc/sys/net follows the netns of the calling thread; setns(2) moves only this thread.
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(links.netns_path(self.config.host_netns), os.O_RDONLY)
        try:
            pyroute2_netns.setns(target, flags=0)
            try:
                _write_if_different(path, value)
            finally:
                pyroute2_netns.setns(home, flags=0)
        finally:
            os.close(target)
            os.close(home)


def _write_if_different(path: Path, value: str) -> None:
    try:
        if path.read_text().strip() != value:
            path.write_text(value)
    except OSError as exc:
        raise GpusnapError(f"cannot set {path} to {value} ({exc}); run as root") from None

