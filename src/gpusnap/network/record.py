"""``NetworkRecord``: everything gpusnap set up for one container, enough to undo it or redo it.

A record is kept in the IPAM state file (so ``remove`` knows what to take down) and written into
the checkpoint metadata as ``extra["network"]`` (so restore can rebuild the same network before
CRIU puts established TCP sockets back: they need the same address, and the same MAC keeps the
peers' ARP caches right).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gpusnap.metadata import CheckpointMetadata
from gpusnap.network.request import PortMapping

METADATA_KEY = "network"


@dataclass(frozen=True)
class RouteRecord:
    dst: str  # "default" or a CIDR
    gateway: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NetworkRecord:
    container_id: str
    netns: str  # name of the named network namespace
    netns_path: str  # what goes into config.json linux.namespaces[type=network].path
    bridge: str
    subnet: str  # CIDR of the bridge network
    address: str  # the container's IPv4 address
    prefixlen: int
    gateway: str
    mac: str
    ifname: str = "eth0"  # name inside the container
    host_veth: str = ""  # host end of the veth pair
    mtu: int = 1500
    routes: tuple[RouteRecord, ...] = field(default_factory=tuple)
    ports: tuple[PortMapping, ...] = field(default_factory=tuple)
    nat: bool = True

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["routes"] = [r.to_dict() for r in self.routes]
        data["ports"] = [p.to_dict() for p in self.ports]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NetworkRecord":
        data = dict(data)
        data["routes"] = tuple(RouteRecord(**r) for r in data.get("routes", []))
        data["ports"] = tuple(PortMapping.from_dict(p) for p in data.get("ports", []))
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def store_in_metadata(meta: CheckpointMetadata, record: NetworkRecord) -> None:
    meta.extra[METADATA_KEY] = record.to_dict()


def load_from_metadata(meta: CheckpointMetadata) -> NetworkRecord | None:
    data = meta.extra.get(METADATA_KEY)
    return NetworkRecord.from_dict(data) if data else None


def set_spec_netns(spec: dict[str, Any], netns_path: str) -> dict[str, Any]:
    """Make an OCI config.json join ``netns_path`` instead of creating a fresh network namespace.

    runc then checkpoints the namespace as external (``--external net[<inode>]:extRootNetNS``)
    and, at restore, hands CRIU the namespace found at the same path (``--inherit-fd``), which is
    why the path must exist again, with the same addresses, before ``runc restore``.
    """
    linux = spec.setdefault("linux", {})
    namespaces = [ns for ns in linux.get("namespaces", []) if ns.get("type") != "network"]
    namespaces.append({"type": "network", "path": netns_path})
    linux["namespaces"] = namespaces
    return spec
