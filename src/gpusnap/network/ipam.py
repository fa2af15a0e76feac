"""A small host-local IPAM: one JSON file under ``Settings.state_dir``, guarded by ``flock``.

Hand-written because what it must do is tiny and specific (leases keyed by container id, the
published ports beside them, and the full NetworkRecord so ``remove`` knows what to take down)
and the alternatives (CNI host-local, netavark) are separate executables with their own state
formats. Every read-modify-write happens under an exclusive ``fcntl.flock`` on a lock file, so
concurrent ``gpusnap run`` processes never hand out the same address; the file is replaced
atomically (write + rename) so a crash never leaves it half-written.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.errors import GpusnapError, UsageError
from gpusnap.network.record import NetworkRecord
from gpusnap.network.request import PortMapping, gateway_of

STATE_VERSION = 1


class AddressInUseError(UsageError):
    """The requested address is leased to another container."""


class PortInUseError(UsageError):
    """A requested host port is already published by another container."""


class BridgeConfigError(UsageError):
    """The bridge exists with a configuration other than the one asked for."""


@dataclass
class Lease:
    container_id: str
    bridge: str
    address: str
    ports: list[PortMapping] = field(default_factory=list)
    record: NetworkRecord | None = None  # None while the container's network is being created

    def to_dict(self) -> dict[str, Any]:
        return {
            "container_id": self.container_id,
            "bridge": self.bridge,
            "address": self.address,
            "ports": [p.to_dict() for p in self.ports],
            "record": self.record.to_dict() if self.record else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Lease":
        return cls(
            container_id=data["container_id"],
            bridge=data["bridge"],
            address=data["address"],
            ports=[PortMapping.from_dict(p) for p in data.get("ports", [])],
            record=NetworkRecord.from_dict(data["record"]) if data.get("record") else None,
        )


@dataclass
class IpamState:
    bridges: dict[str, str] = field(default_factory=dict)  # bridge name -> subnet CIDR
    leases: dict[str, Lease] = field(default_factory=dict)  # container id -> lease

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "bridges": dict(sorted(self.bridges.items())),
            "leases": {k: v.to_dict() for k, v in sorted(self.leases.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "IpamState":
        return cls(
            bridges=dict(data.get("bridges", {})),
            leases={k: Lease.from_dict(v) for k, v in data.get("leases", {}).items()},
        )

    # -- operations; callers hold the lock -------------------------------------------------

    def bind_bridge(self, bridge: str, subnet: str) -> None:
        known = self.bridges.get(bridge)
        if known is None:
            new = ipaddress.IPv4Network(subnet)
            for other, other_subnet in self.bridges.items():
                if new.overlaps(ipaddress.IPv4Network(other_subnet)):
                    raise BridgeConfigError(
                        f"subnet {subnet} overlaps {other_subnet} of bridge {other}; choose a subnet that does not overlap"
                    )
            self.bridges[bridge] = subnet
        elif known != subnet:
            raise BridgeConfigError(
                f"bridge {bridge} is configured with subnet {known}, not {subnet}; use subnet {known} or another bridge name"
            )

    def in_use(self, bridge: str) -> set[str]:
        return {lease.address for lease in self.leases.values() if lease.bridge == bridge}

    def allocate(self, container_id: str, bridge: str, requested: str | None, ports: list[PortMapping]) -> str:
        """Lease an address on ``bridge`` (``requested`` or the lowest free one) and the ports."""
        if container_id in self.leases:
            raise UsageError(f"container {container_id} already has a network; remove it first")
        subnet = ipaddress.IPv4Network(self.bridges[bridge])
        used = self.in_use(bridge)
        if requested is not None:
            if ipaddress.IPv4Address(requested) not in subnet:
                raise UsageError(f"address {requested} is outside {subnet} of bridge {bridge}; choose an address inside it")
            if requested in used:
                owner = next(k for k, v in self.leases.items() if v.bridge == bridge and v.address == requested)
                raise AddressInUseError(
                    f"address {requested} is already in use by container {owner}; choose another with --ip or remove that container"
                )
            address = requested
        else:
            address = self._first_free(subnet, used)
        for p in ports:
            for other in self.leases.values():
                for q in other.ports:
                    if p.clashes_with(q):
                        raise PortInUseError(
                            f"host port {p.host_port}/{p.protocol} is already published by container {other.container_id}; pick another host port"
                        )
        self.leases[container_id] = Lease(container_id, bridge, address, list(ports))
        return address

    @staticmethod
    def _first_free(subnet: ipaddress.IPv4Network, used: set[str]) -> str:
        gateway = gateway_of(subnet)
        for host in subnet.hosts():
            if host != gateway and str(host) not in used:
                return str(host)
        raise GpusnapError(f"no free address left in {subnet}; remove containers or use a larger subnet")


class Ipam:
    """The IPAM file of one state directory (one per host)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir) / "network"
        self.path = self.dir / "ipam.json"
        self.lock_path = self.dir / "ipam.lock"

    @contextmanager
    def locked(self) -> Iterator[IpamState]:
        """Hold the lock; yield the state; save it when the block ends without an exception."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            state = self._read()
            yield state
            self._write(state)
        finally:
            os.close(fd)  # closing drops the flock

    def read(self) -> IpamState:
        """A snapshot, without holding the lock (for listing and inspecting)."""
        return self._read()

    def _read(self) -> IpamState:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return IpamState()
        try:
            return IpamState.from_dict(json.loads(text))
        except (ValueError, KeyError, TypeError) as exc:
            raise GpusnapError(f"{self.path} is corrupt ({exc}); move it away to start with an empty IPAM") from None

    def _write(self, state: IpamState) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state.to_dict(), indent=2))
        os.replace(tmp, self.path)

    # -- convenience wrappers, each one locked transaction ------------------------------------

    def allocate(
        self, container_id: str, bridge: str, subnet: str, requested: str | None = None, ports: list[PortMapping] | None = None
    ) -> str:
        with self.locked() as state:
            state.bind_bridge(bridge, subnet)
            return state.allocate(container_id, bridge, requested, list(ports or []))

    def commit(self, record: NetworkRecord) -> None:
        with self.locked() as state:
            state.leases[record.container_id].record = record

    def release(self, container_id: str) -> Lease | None:
        with self.locked() as state:
            return state.leases.pop(container_id, None)

    def get(self, container_id: str) -> Lease | None:
        return self._read().leases.get(container_id)
