"""Links, addresses, routes and named network namespaces, all over netlink with pyroute2.

Nothing here runs ``ip``: pyroute2 speaks rtnetlink in-process, which gives exact error codes
(EEXIST, ENODEV) to turn into one-line messages, and no dependency on iproute2's output format.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pyroute2 import IPRoute, NetlinkError, NetNS, netns

from gpusnap.errors import GpusnapError, UsageError
from gpusnap.network.ipam import BridgeConfigError

NETNS_DIR = netns.NETNS_RUN_DIR


@contextmanager
def rtnl(netns_name: str | None = None) -> Iterator[IPRoute]:
    """An rtnetlink socket in ``netns_name`` (None: the caller's own namespace)."""
    sock = IPRoute() if netns_name is None else NetNS(netns_name)
    try:
        yield sock
    finally:
        sock.close()


def netns_path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


def netns_exists(name: str) -> bool:
    return os.path.exists(netns_path(name))


def create_netns(name: str) -> str:
    if netns_exists(name):
        raise UsageError(f"network namespace {name} already exists; remove the container that owns it or pick another name")
    netns.create(name)
    return netns_path(name)


def remove_netns(name: str) -> None:
    if netns_exists(name):
        netns.remove(name)


def host_veth_name(prefix: str, container_id: str) -> str:
    """A stable host-side veth name: Linux allows 15 characters, container ids are longer."""
    digest = hashlib.sha256(container_id.encode()).hexdigest()
    return (prefix + digest)[:15]


def random_mac() -> str:
    """A locally administered unicast MAC (the same scheme veth would pick, but kept for restore)."""
    octets = bytearray(os.urandom(6))
    octets[0] = (octets[0] & 0xFE) | 0x02
    return ":".join(f"{b:02x}" for b in octets)


def _index(ipr: IPRoute, ifname: str) -> int | None:
    found = ipr.link_lookup(ifname=ifname)
    return found[0] if found else None


def _link_kind(link: Any) -> str | None:
    info = link.get("IFLA_LINKINFO")
    return info.get("IFLA_INFO_KIND") if info else None


def _addresses(ipr: IPRoute, index: int) -> set[tuple[str, int]]:
    return {(a.get("IFA_ADDRESS"), a["prefixlen"]) for a in ipr.get_addr(index=index, family=2)}


def check_bridge(ipr: IPRoute, name: str, gateway: str, prefixlen: int) -> bool:
    """True when bridge ``name`` exists as gpusnap wants it, False when it does not exist.

    A link of that name that is not a bridge, or a bridge without our gateway address, belongs
    to someone else (docker0, a libvirt bridge...): refuse rather than reconfigure it.
    """
    index = _index(ipr, name)
    if index is None:
        return False
    link = ipr.get_links(index)[0]
    kind = _link_kind(link)
    if kind != "bridge":
        raise BridgeConfigError(f"{name} exists and is a {kind or 'non-bridge'} link, not a bridge; choose another bridge name")
    addrs = _addresses(ipr, index)
    if (gateway, prefixlen) not in addrs:
        have = ", ".join(f"{a}/{p}" for a, p in sorted(addrs)) or "no IPv4 address"
        raise BridgeConfigError(
            f"bridge {name} exists with {have}, not {gateway}/{prefixlen}; use its subnet or another bridge name"
        )
    return True


def create_bridge(ipr: IPRoute, name: str, gateway: str, prefixlen: int, mtu: int) -> None:
    ipr.link("add", ifname=name, kind="bridge", mtu=mtu)
    index = _index(ipr, name)
    ipr.addr("add", index=index, address=gateway, prefixlen=prefixlen)
    ipr.link("set", index=index, state="up")


def delete_link(ipr: IPRoute, ifname: str) -> None:
    index = _index(ipr, ifname)
    if index is None:
        return
    try:
        ipr.link("del", index=index)
    except NetlinkError as exc:
        if exc.code != errno.ENODEV:  # gone already: the netns took its peer down with it
            raise


def create_veth(
    ipr: IPRoute, host_name: str, peer_name: str, peer_netns: str, bridge: str, mtu: int, *, up: bool = True
) -> None:
    """A veth pair whose peer is created straight inside ``peer_netns``, host end on ``bridge``.

    ``up=False`` leaves the host end down: the container side has no carrier, so nothing from
    outside reaches the namespace until :func:`set_link_up`.
    """
    if _index(ipr, host_name) is not None:
        raise UsageError(f"interface {host_name} already exists; a container with this id already has a network")
    ipr.link("add", ifname=host_name, kind="veth", mtu=mtu, peer={"ifname": peer_name, "net_ns_fd": peer_netns})
    index = _index(ipr, host_name)
    ipr.link("set", index=index, master=_index(ipr, bridge), state="up" if up else "down")


def set_link_up(ipr: IPRoute, ifname: str) -> None:
    index = _index(ipr, ifname)
    if index is None:
        raise GpusnapError(f"interface {ifname} does not exist; recreate the container's network")
    ipr.link("set", index=index, state="up")


def configure_container_side(
    netns_name: str, ifname: str, mac: str, address: str, prefixlen: int, gateway: str
) -> None:
    with rtnl(netns_name) as ns:
        lo = _index(ns, "lo")
        ns.link("set", index=lo, state="up")
        index = _index(ns, ifname)
        if index is None:
            raise GpusnapError(f"{ifname} did not appear in network namespace {netns_name}")
        ns.link("set", index=index, address=mac)
        ns.addr("add", index=index, address=address, prefixlen=prefixlen)
        ns.link("set", index=index, state="up")
        ns.route("add", dst="0.0.0.0/0", gateway=gateway)


def container_side(netns_name: str, ifname: str) -> dict[str, Any]:
    """What the container sees: its MAC, addresses and routes (for tests and ``inspect``)."""
    with rtnl(netns_name) as ns:
        index = _index(ns, ifname)
        if index is None:
            return {}
        link = ns.get_links(index)[0]
        routes = []
        for r in ns.get_routes(family=2, table=254):
            dst = f"{r.get('RTA_DST')}/{r['dst_len']}" if r.get("RTA_DST") else "default"
            routes.append({"dst": dst, "gateway": r.get("RTA_GATEWAY") or ""})
        return {
            "mac": link.get("IFLA_ADDRESS"),
            "up": bool(link["flags"] & 1),
            "carrier": bool(link.get("IFLA_CARRIER")),
            "addresses": sorted(f"{a}/{p}" for a, p in _addresses(ns, index)),
            "routes": routes,
        }


def link_names(netns_name: str | None = None) -> set[str]:
    with rtnl(netns_name) as ipr:
        return {link.get("IFLA_IFNAME") for link in ipr.get_links()}


def all_addresses(netns_name: str | None = None) -> set[str]:
    with rtnl(netns_name) as ipr:
        return {a.get("IFA_ADDRESS") for a in ipr.get_addr(family=2)}


def netlink_message(exc: BaseException) -> str:
    if isinstance(exc, NetlinkError):
        return f"{os.strerror(exc.code)} (errno {exc.code})"
    return str(exc)
