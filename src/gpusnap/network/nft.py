"""gpusnap's nftables rules: one table (``inet gpusnap``) that only gpusnap writes.

Why ``nft -j -f -`` and not a Python binding (checked 2026-11, pyroute2 0.9.7, nftables 1.0.6):
- pyroute2's ``pyroute2.nftables`` only ships helpers for address matches, masquerade and
  verdicts; DNAT with a port, ``fib daddr type local`` and comment matching would mean encoding
  raw nftables VM register programs by hand, i.e. re-implementing nft's compiler.
- the ``nftables`` Python module (libnftables over ctypes) is packaged by Debian as
  python3-nftables for the system interpreter only and is not on PyPI, so it cannot be a
  dependency of a virtualenv install.
So rules are built here as nft's documented JSON schema (libnftables-json(5)) — plain data,
unit-testable — and applied with one ``nft -j -f -`` run per change: nft applies a whole input
as one kernel transaction, so a change is all-or-nothing, and nothing is ever parsed from text.

Every per-container rule carries the comment ``gpusnap:<container id>``; removal lists the
table, picks rules by that comment and deletes them by handle, so cleanup is exact and never
touches rules of docker, podman or the administrator.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from pyroute2 import netns as pyroute2_netns

from gpusnap.errors import GpusnapError, MissingDependencyError
from gpusnap.network.record import NetworkRecord

FAMILY = "inet"
# (name, hook, priority): netfilter's standard dstnat (-100) and srcnat (100) priorities.
CHAINS = (("prerouting", "prerouting", -100), ("output", "output", -100), ("postrouting", "postrouting", 100))

Command = dict[str, Any]


def rule_comment(container_id: str) -> str:
    return f"gpusnap:{container_id}"


def _match(left: Any, right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def _payload(protocol: str, field: str) -> dict[str, Any]:
    return {"payload": {"protocol": protocol, "field": field}}


def _meta(key: str) -> dict[str, Any]:
    return {"meta": {"key": key}}


def table_commands(table: str) -> list[Command]:
    """Create the table and its base chains; ``add`` is a no-op for what exists already."""
    cmds: list[Command] = [{"add": {"table": {"family": FAMILY, "name": table}}}]
    for name, hook, prio in CHAINS:
        cmds.append(
            {
                "add": {
                    "chain": {
                        "family": FAMILY,
                        "table": table,
                        "name": name,
                        "type": "nat",
                        "hook": hook,
                        "prio": prio,
                        "policy": "accept",
                    }
                }
            }
        )
    return cmds


def _rule(table: str, chain: str, comment: str, expr: list[dict[str, Any]]) -> Command:
    return {"add": {"rule": {"family": FAMILY, "table": table, "chain": chain, "comment": comment, "expr": expr}}}


def container_rules(table: str, record: NetworkRecord) -> list[Command]:
    """The rules one container needs: outbound masquerade and one DNAT pair per published port."""
    comment = rule_comment(record.container_id)
    rules: list[Command] = []
    if record.nat:
        # Outbound traffic leaving through anything but its own bridge takes the host's address,
        # but only for connections the container starts. After a restore on another host,
        # conntrack there picks up the restored connections mid-stream as "new"; were those
        # masqueraded, their packets would leave with the wrong source address and the peer
        # would drop them. So TCP is masqueraded from its SYN only; other protocols always.
        base = [_match(_payload("ip", "saddr"), record.address), _match(_meta("oifname"), record.bridge, "!=")]
        syn_only = _match(
            {"&": [_payload("tcp", "flags"), ["syn", "ack"]]},
            "syn",
        )
        rules.append(_rule(table, "postrouting", comment, [*base, syn_only, {"masquerade": None}]))
        not_tcp = _match(_meta("l4proto"), "tcp", "!=")
        rules.append(_rule(table, "postrouting", comment, [*base, not_tcp, {"masquerade": None}]))
    for port in record.ports:
        if port.host_ip:
            to_host = _match(_payload("ip", "daddr"), port.host_ip)
        else:
            to_host = _match({"fib": {"result": "type", "flags": ["daddr"]}}, "local")
        dnat = {"dnat": {"family": "ip", "addr": record.address, "port": port.container_port}}
        dport = _match(_payload(port.protocol, "dport"), port.host_port)
        # prerouting: traffic from other machines; output: traffic from the host itself.
        for chain in ("prerouting", "output"):
            rules.append(_rule(table, chain, comment, [to_host, dport, dnat]))
        # Host-local clients connecting to 127.0.0.1 keep a loopback source after DNAT, which no
        # container could answer: rewrite it to the bridge address (needs route_localnet).
        rules.append(
            _rule(
                table,
                "postrouting",
                comment,
                [
                    _match(_payload("ip", "saddr"), {"prefix": {"addr": "127.0.0.0", "len": 8}}),
                    _match(_payload("ip", "daddr"), record.address),
                    _match(_payload(port.protocol, "dport"), port.container_port),
                    {"masquerade": None},
                ],
            )
        )
    return rules


def delete_commands(table: str, listing: dict[str, Any], container_id: str) -> list[Command]:
    """Delete commands for every rule of ``container_id`` found in an ``nft -j list`` output."""
    comment = rule_comment(container_id)
    cmds: list[Command] = []
    for item in listing.get("nftables", []):
        rule = item.get("rule")
        if rule and rule.get("table") == table and rule.get("comment") == comment:
            cmds.append(
                {"delete": {"rule": {"family": FAMILY, "table": table, "chain": rule["chain"], "handle": rule["handle"]}}}
            )
    return cmds


def rule_comments(listing: dict[str, Any]) -> list[str]:
    return [item["rule"].get("comment", "") for item in listing.get("nftables", []) if "rule" in item]


class Nft:
    """Runs ``nft`` (optionally inside a named network namespace: the simulated second host)."""

    def __init__(self, table: str, *, netns: str | None = None, binary: str = "nft") -> None:
        self.table = table
        self.netns = netns
        self.binary = binary

    def _run(self, args: list[str], stdin: str | None = None) -> str:
        target = self.netns

        def enter() -> None:
            if target is not None:
                pyroute2_netns.setns(target, flags=0)

        try:
            proc = subprocess.run(
                [self.binary, *args],
                input=stdin,
                capture_output=True,
                text=True,
                preexec_fn=enter if target is not None else None,
                check=False,
            )
        except FileNotFoundError:
            raise MissingDependencyError(f"{self.binary} not found; install nftables (apt-get install nftables)") from None
        if proc.returncode != 0:
            raise GpusnapError(f"nft {' '.join(args)} failed: {' '.join(proc.stderr.split())[:400]}")
        return proc.stdout

    def apply(self, commands: list[Command]) -> None:
        if commands:
            self._run(["-j", "-f", "-"], json.dumps({"nftables": commands}))

    def listing(self) -> dict[str, Any]:
        """The table as nft's JSON, or an empty listing when the table does not exist."""
        try:
            out = self._run(["-j", "list", "table", FAMILY, self.table])
        except GpusnapError as exc:
            if "No such file or directory" in str(exc):
                return {"nftables": []}
            raise
        return json.loads(out)

    def ensure_table(self) -> None:
        self.apply(table_commands(self.table))

    def add_container(self, record: NetworkRecord) -> None:
        self.apply(container_rules(self.table, record))

    def remove_container(self, container_id: str) -> None:
        self.apply(delete_commands(self.table, self.listing(), container_id))

    def delete_table(self) -> None:
        if self.listing().get("nftables"):
            self.apply([{"delete": {"table": {"family": FAMILY, "name": self.table}}}])
