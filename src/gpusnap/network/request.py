"""What a caller asks of the network (``NetworkRequest``) and how ``-p``/``--ip`` text is parsed.

Parsing is separate from doing so that every bad value is rejected, with a one-line
:class:`~gpusnap.errors.UsageError`, before anything on the host changes.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from gpusnap.errors import UsageError

DEFAULT_BRIDGE = "gpusnap0"
DEFAULT_SUBNET = "10.210.0.0/16"
PROTOCOLS = ("tcp", "udp")
_IFNAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")


@dataclass(frozen=True)
class PortMapping:
    """One published port: traffic to ``host_port`` on the host goes to ``container_port``."""

    host_port: int
    container_port: int
    protocol: str = "tcp"
    host_ip: str = ""  # "" = every address of the host

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PortMapping":
        return cls(**data)

    def __str__(self) -> str:
        host = f"{self.host_ip}:" if self.host_ip else ""
        return f"{host}{self.host_port}:{self.container_port}/{self.protocol}"

    def clashes_with(self, other: "PortMapping") -> bool:
        """True when both would claim the same host port (same protocol, overlapping address)."""
        if self.protocol != other.protocol or self.host_port != other.host_port:
            return False
        return not self.host_ip or not other.host_ip or self.host_ip == other.host_ip


@dataclass(frozen=True)
class NetworkConfig:
    """Names the manager gives to what it creates; tests point them at their own prefixes."""

    netns_prefix: str = "gpusnap-"  # named netns: <prefix><container id>, under /var/run/netns
    veth_prefix: str = "gsv"  # host end of each veth: <prefix><hash>, at most 15 characters
    table: str = "gpusnap"  # the one nftables table (family inet) gpusnap owns
    host_netns: str | None = None  # netns holding the bridge and rules; None = the caller's own

    @classmethod
    def from_prefix(cls, prefix: str, host_netns: str | None = None) -> "NetworkConfig":
        """Names derived from one prefix (``Settings.network_prefix``).

        nft identifiers cannot hold '-', and veth names must leave room for a hash in 15 chars.
        """
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,15}", prefix):
            raise UsageError(f"network prefix {prefix!r} must be 1-16 letters, digits, '_' or '-', starting with a letter")
        flat = prefix.replace("-", "")
        return cls(netns_prefix=f"{prefix}-", veth_prefix=f"{flat[:7]}v", table=flat, host_netns=host_netns)


@dataclass(frozen=True)
class NetworkRequest:
    """The network one container asks for (the runc-direct engine's ``--network bridge``)."""

    bridge: str = DEFAULT_BRIDGE
    subnet: str = DEFAULT_SUBNET
    ip: str | None = None  # a fixed address; None = the next free one
    ports: tuple[PortMapping, ...] = field(default_factory=tuple)
    nat: bool = True  # masquerade the container's outbound traffic
    mtu: int = 1500

    def __post_init__(self) -> None:
        validate_bridge_name(self.bridge)
        net = parse_subnet(self.subnet)
        object.__setattr__(self, "subnet", str(net))
        if self.ip is not None:
            object.__setattr__(self, "ip", str(parse_ip(self.ip, net)))
        if not 68 <= self.mtu <= 65535:
            raise UsageError(f"MTU {self.mtu} is out of range; use 68 to 65535")
        seen: list[PortMapping] = []
        for p in self.ports:
            for q in seen:
                if p.clashes_with(q):
                    raise UsageError(f"port {p} is published twice; give each host port once")
            seen.append(p)


def validate_bridge_name(name: str) -> str:
    if not _IFNAME.match(name):
        raise UsageError(
            f"bridge name {name!r} is not a valid interface name; use 1-15 letters, digits, '_', '-' or '.'"
        )
    return name


def parse_subnet(text: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(text, strict=True)
    except ValueError as exc:
        raise UsageError(f"subnet {text!r} is not an IPv4 network in CIDR form ({exc}); e.g. 10.210.0.0/16") from None
    if net.prefixlen > 29:
        raise UsageError(f"subnet {text} is too small; use a /29 or larger")
    return net


def parse_ip(text: str, subnet: ipaddress.IPv4Network) -> ipaddress.IPv4Address:
    """A container address inside ``subnet`` that is neither the network, broadcast nor gateway."""
    try:
        addr = ipaddress.IPv4Address(text)
    except ValueError:
        raise UsageError(f"--ip {text!r} is not an IPv4 address; e.g. {subnet.network_address + 2}") from None
    if addr not in subnet:
        raise UsageError(f"--ip {addr} is outside the bridge subnet {subnet}; pick an address inside it")
    if addr in (subnet.network_address, subnet.broadcast_address, gateway_of(subnet)):
        raise UsageError(f"--ip {addr} is reserved in {subnet} (network, broadcast or gateway); pick another")
    return addr


def gateway_of(subnet: ipaddress.IPv4Network) -> ipaddress.IPv4Address:
    """The bridge's own address: the first host address of the subnet."""
    return subnet.network_address + 1


def _port(text: str, what: str, spec: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise UsageError(f"-p {spec!r}: {what} port {text!r} must be a number from 1 to 65535")
    return int(text)


def parse_publish(spec: str) -> PortMapping:
    """Parse ``[HOST_IP:]HOST_PORT:CONTAINER_PORT[/tcp|udp]`` (docker's and podman's ``-p`` form)."""
    body, _, proto = spec.partition("/")
    proto = proto or "tcp"
    if proto not in PROTOCOLS:
        raise UsageError(f"-p {spec!r}: protocol {proto!r} is not supported; use tcp or udp")
    parts = body.split(":")
    if len(parts) == 2:
        host_ip, host, ctr = "", parts[0], parts[1]
    elif len(parts) == 3:
        host_ip, host, ctr = parts
        try:
            host_ip = str(ipaddress.IPv4Address(host_ip)) if host_ip else ""
        except ValueError:
            raise UsageError(f"-p {spec!r}: {host_ip!r} is not an IPv4 host address") from None
    else:
        raise UsageError(f"-p {spec!r}: expected HOST_PORT:CONTAINER_PORT, e.g. 8080:80 or 127.0.0.1:8080:80/tcp")
    return PortMapping(_port(host, "host", spec), _port(ctr, "container", spec), proto, host_ip)


def parse_publish_list(specs: list[str] | tuple[str, ...]) -> tuple[PortMapping, ...]:
    return tuple(parse_publish(s) for s in specs)
