"""Networking for runc-direct containers, in-process over netlink (pyroute2) and nftables.

See docs/network.md. The engine calls :class:`NetworkManager` ``create`` before the container
process runs, puts ``record.netns_path`` into config.json (:func:`set_spec_netns`), stores the
record in the checkpoint metadata, and calls ``recreate`` before ``runc restore``.
"""

from gpusnap.network.ipam import AddressInUseError, BridgeConfigError, Ipam, PortInUseError
from gpusnap.network.manager import NetworkManager
from gpusnap.network.record import (
    NetworkRecord,
    RouteRecord,
    load_from_metadata,
    set_spec_netns,
    store_in_metadata,
)
from gpusnap.network.request import (
    DEFAULT_BRIDGE,
    DEFAULT_SUBNET,
    NetworkConfig,
    NetworkRequest,
    PortMapping,
    parse_publish,
    parse_publish_list,
)

__all__ = [
    "AddressInUseError",
    "BridgeConfigError",
    "DEFAULT_BRIDGE",
    "DEFAULT_SUBNET",
    "Ipam",
    "NetworkConfig",
    "NetworkManager",
    "NetworkRecord",
    "NetworkRequest",
    "PortInUseError",
    "PortMapping",
    "RouteRecord",
    "load_from_metadata",
    "parse_publish",
    "parse_publish_list",
    "set_spec_netns",
    "store_in_metadata",
]
