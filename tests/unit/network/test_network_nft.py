from __future__ import annotations

from gpusnap.network import NetworkRecord, PortMapping
from gpusnap.network.nft import container_rules, delete_commands, rule_comment, rule_comments, table_commands


def _record(**kw: object) -> NetworkRecord:
    base = dict(
        container_id="c1", netns="n", netns_path="/p", bridge="gsnet0", subnet="10.233.3.0/24", address="10.233.3.2",
        prefixlen=24, gateway="10.233.3.1", mac="02:00:00:00:00:01",
    )
    base.update(kw)
    return NetworkRecord(**base)  # type: ignore[arg-type]


def _rules(cmds: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    return [c["add"]["rule"] for c in cmds]


def test_table_has_nat_base_chains_at_standard_priorities() -> None:
    cmds = table_commands("gpusnap")
    assert cmds[0] == {"add": {"table": {"family": "inet", "name": "gpusnap"}}}
    chains = {c["add"]["chain"]["name"]: (c["add"]["chain"]["hook"], c["add"]["chain"]["prio"], c["add"]["chain"]["type"]) for c in cmds[1:]}
    assert chains == {"prerouting": ("prerouting", -100, "nat"), "output": ("output", -100, "nat"), "postrouting": ("postrouting", 100, "nat")}


def test_nat_masquerades_new_outbound_connections_only() -> None:
    rules = _rules(container_rules("gpusnap", _record()))
    assert [r["chain"] for r in rules] == ["postrouting", "postrouting"]
    assert all(r["comment"] == "gpusnap:c1" and r["family"] == "inet" for r in rules)
    tcp, other = rules
    assert tcp["expr"][0] == {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": "10.233.3.2"}}
    assert tcp["expr"][1] == {"match": {"op": "!=", "left": {"meta": {"key": "oifname"}}, "right": "gsnet0"}}
    # From the SYN only: mid-stream packets of a connection restored here keep their address.
    assert tcp["expr"][2]["match"]["right"] == "syn"
    assert other["expr"][2] == {"match": {"op": "!=", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}}
    assert tcp["expr"][-1] == other["expr"][-1] == {"masquerade": None}


def test_no_nat_no_ports_means_no_rules() -> None:
    assert container_rules("gpusnap", _record(nat=False)) == []


def test_published_port_gets_dnat_in_prerouting_and_output_and_loopback_masquerade() -> None:
    rules = _rules(container_rules("t", _record(nat=False, ports=(PortMapping(5300, 80),))))
    assert [r["chain"] for r in rules] == ["prerouting", "output", "postrouting"]
    for r in rules[:2]:
        assert r["expr"][0] == {"match": {"op": "==", "left": {"fib": {"result": "type", "flags": ["daddr"]}}, "right": "local"}}
        assert r["expr"][1] == {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}}, "right": 5300}}
        assert r["expr"][2] == {"dnat": {"family": "ip", "addr": "10.233.3.2", "port": 80}}
    lo = rules[2]["expr"]
    assert lo[0]["match"]["right"] == {"prefix": {"addr": "127.0.0.0", "len": 8}}
    assert lo[-1] == {"masquerade": None}


def test_port_on_one_host_address_and_udp() -> None:
    rules = _rules(container_rules("t", _record(nat=False, ports=(PortMapping(5353, 53, "udp", "10.233.0.1"),))))
    assert rules[0]["expr"][0] == {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": "10.233.0.1"}}
    assert rules[0]["expr"][1]["match"]["left"] == {"payload": {"protocol": "udp", "field": "dport"}}


def test_delete_picks_exactly_this_containers_rules_by_comment() -> None:
    listing = {
        "nftables": [
            {"metainfo": {"version": "1.0.6"}},
            {"table": {"family": "inet", "name": "gpusnap", "handle": 1}},
            {"rule": {"family": "inet", "table": "gpusnap", "chain": "postrouting", "handle": 7, "comment": rule_comment("c1")}},
            {"rule": {"family": "inet", "table": "gpusnap", "chain": "output", "handle": 8, "comment": rule_comment("c10")}},
            {"rule": {"family": "inet", "table": "gpusnap", "chain": "prerouting", "handle": 9, "comment": rule_comment("c1")}},
            {"rule": {"family": "inet", "table": "other", "chain": "x", "handle": 3, "comment": rule_comment("c1")}},
        ]
    }
    assert delete_commands("gpusnap", listing, "c1") == [
        {"delete": {"rule": {"family": "inet", "table": "gpusnap", "chain": "postrouting", "handle": 7}}},
        {"delete": {"rule": {"family": "inet", "table": "gpusnap", "chain": "prerouting", "handle": 9}}},
    ]
    assert rule_comments(listing) == ["gpusnap:c1", "gpusnap:c10", "gpusnap:c1", "gpusnap:c1"]
