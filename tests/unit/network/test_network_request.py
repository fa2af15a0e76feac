from __future__ import annotations

import pytest

from gpusnap.errors import ExitCode, UsageError
from gpusnap.metadata import CheckpointMetadata
from gpusnap.network import (
    NetworkRecord,
    NetworkRequest,
    PortMapping,
    RouteRecord,
    load_from_metadata,
    parse_publish,
    parse_publish_list,
    set_spec_netns,
    store_in_metadata,
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("8080:80", PortMapping(8080, 80, "tcp", "")),
        ("8080:80/udp", PortMapping(8080, 80, "udp", "")),
        ("127.0.0.1:5300:80/tcp", PortMapping(5300, 80, "tcp", "127.0.0.1")),
        (":5300:80", PortMapping(5300, 80, "tcp", "")),
    ],
)
def test_parse_publish_accepts_docker_forms(spec: str, expected: PortMapping) -> None:
    assert parse_publish(spec) == expected


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("80", "expected HOST_PORT:CONTAINER_PORT"),
        ("a:80", "host port 'a'"),
        ("8080:0", "container port '0'"),
        ("70000:80", "host port '70000'"),
        ("8080:80/sctp", "protocol 'sctp'"),
        ("1.2.3:8080:80", "not an IPv4 host address"),
        ("1:2:3:4", "expected HOST_PORT"),
    ],
)
def test_parse_publish_rejects_with_one_line(spec: str, words: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_publish(spec)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert info.value.exit_code == ExitCode.USAGE


def test_str_of_mapping_parses_back() -> None:
    for p in (PortMapping(1, 2), PortMapping(5300, 53, "udp", "10.0.0.1")):
        assert parse_publish(str(p)) == p


def test_clashes_compare_port_protocol_and_address() -> None:
    any_ip = PortMapping(5300, 80)
    assert any_ip.clashes_with(PortMapping(5300, 81, "tcp", "127.0.0.1"))
    assert not any_ip.clashes_with(PortMapping(5300, 80, "udp"))
    assert not PortMapping(5300, 80, "tcp", "127.0.0.1").clashes_with(PortMapping(5300, 80, "tcp", "127.0.0.2"))


def test_request_normalises_and_validates() -> None:
    req = NetworkRequest(bridge="gsnet0", subnet="10.233.0.0/16", ip="10.233.0.9")
    assert req.subnet == "10.233.0.0/16" and req.ip == "10.233.0.9"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"bridge": "x" * 16}, "not a valid interface name"),
        ({"bridge": "bad name"}, "not a valid interface name"),
        ({"subnet": "10.233.1.1/24"}, "not an IPv4 network"),
        ({"subnet": "10.233.1.0/30"}, "too small"),
        ({"subnet": "10.233.1.0/24", "ip": "10.233.2.5"}, "outside the bridge subnet"),
        ({"subnet": "10.233.1.0/24", "ip": "10.233.1.1"}, "reserved"),
        ({"subnet": "10.233.1.0/24", "ip": "10.233.1.255"}, "reserved"),
        ({"subnet": "10.233.1.0/24", "ip": "nope"}, "not an IPv4 address"),
        ({"mtu": 10}, "MTU"),
        ({"ports": parse_publish_list(["5300:80", "5300:81"])}, "published twice"),
    ],
)
def test_request_rejects_bad_values(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(UsageError, match=words):
        NetworkRequest(**kwargs)  # type: ignore[arg-type]


def _record() -> NetworkRecord:
    return NetworkRecord(
        container_id="c",
        netns="gpusnap-c",
        netns_path="/var/run/netns/gpusnap-c",
        bridge="gpusnap0",
        subnet="10.233.3.0/24",
        address="10.233.3.2",
        prefixlen=24,
        gateway="10.233.3.1",
        mac="02:11:22:33:44:55",
        host_veth="gsv123",
        routes=(RouteRecord("default", "10.233.3.1"),),
        ports=(PortMapping(5300, 80), PortMapping(5301, 53, "udp", "127.0.0.1")),
    )


def test_record_round_trips_through_checkpoint_metadata_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    meta = CheckpointMetadata(container_id="c", created="2026-01-01T00:00:00Z")
    assert load_from_metadata(meta) is None
    store_in_metadata(meta, _record())
    meta.write(tmp_path)
    back = CheckpointMetadata.read(tmp_path)
    assert back is not None and load_from_metadata(back) == _record()
    assert back.extra["network"]["ports"][1] == {"host_port": 5301, "container_port": 53, "protocol": "udp", "host_ip": "127.0.0.1"}


def test_set_spec_netns_replaces_only_the_network_namespace() -> None:
    spec = {"linux": {"namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "mount"}]}}
    set_spec_netns(spec, "/var/run/netns/gpusnap-c")
    assert spec["linux"]["namespaces"] == [{"type": "pid"}, {"type": "mount"}, {"type": "network", "path": "/var/run/netns/gpusnap-c"}]
    assert set_spec_netns({}, "/x") == {"linux": {"namespaces": [{"type": "network", "path": "/x"}]}}


def test_names_derive_from_the_settings_prefix() -> None:
    from gpusnap.config import load_settings
    from gpusnap.network import NetworkConfig, NetworkManager

    assert NetworkConfig.from_prefix("gpusnap") == NetworkConfig(netns_prefix="gpusnap-", veth_prefix="gpusnapv", table="gpusnap")
    assert NetworkConfig.from_prefix("gs-net") == NetworkConfig(netns_prefix="gs-net-", veth_prefix="gsnetv", table="gsnet")
    with pytest.raises(UsageError, match="network prefix"):
        NetworkConfig.from_prefix("bad prefix")
    settings = load_settings(env={"GPUSNAP_BRIDGE": "gsnet3", "GPUSNAP_SUBNET": "10.233.30.0/24", "GPUSNAP_NET_PREFIX": "gs-net"})
    nm = NetworkManager(settings)
    assert nm.config.table == "gsnet" and nm.netns_name("c") == "gs-net-c"
    assert len(nm.host_veth("a-very-long-container-name-" * 4)) == 15
    req = nm.request(parse_publish_list(["5300:80"]), ip="10.233.30.9")
    assert (req.bridge, req.subnet, req.ip, req.ports) == ("gsnet3", "10.233.30.0/24", "10.233.30.9", (PortMapping(5300, 80),))
