from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from gpusnap.errors import ExitCode, GpusnapError, UsageError
from gpusnap.network import AddressInUseError, BridgeConfigError, Ipam, PortInUseError, PortMapping
from gpusnap.network.ipam import IpamState

SUBNET = "10.233.4.0/24"


def test_allocates_lowest_free_host_address_skipping_gateway(tmp_path: Path) -> None:
    ipam = Ipam(tmp_path)
    assert [ipam.allocate(f"c{i}", "br", SUBNET) for i in range(3)] == ["10.233.4.2", "10.233.4.3", "10.233.4.4"]
    ipam.release("c1")
    assert ipam.allocate("c9", "br", SUBNET) == "10.233.4.3"  # freed addresses are reused
    assert ipam.get("c9").address == "10.233.4.3"  # type: ignore[union-attr]


def test_requested_address_and_clear_conflict(tmp_path: Path) -> None:
    ipam = Ipam(tmp_path)
    assert ipam.allocate("a", "br", SUBNET, "10.233.4.50") == "10.233.4.50"
    with pytest.raises(AddressInUseError, match="10.233.4.50 is already in use by container a") as info:
        ipam.allocate("b", "br", SUBNET, "10.233.4.50")
    assert info.value.exit_code == ExitCode.USAGE
    assert "b" not in ipam.read().leases  # a refused allocation leaves nothing
    with pytest.raises(UsageError, match="outside"):
        ipam.allocate("b", "br", SUBNET, "10.233.9.9")
    with pytest.raises(UsageError, match="already has a network"):
        ipam.allocate("a", "br", SUBNET)


def test_same_address_on_two_bridges_is_not_a_conflict_but_overlapping_subnets_are(tmp_path: Path) -> None:
    ipam = Ipam(tmp_path)
    ipam.allocate("a", "br1", SUBNET)
    with pytest.raises(BridgeConfigError, match="overlaps"):
        ipam.allocate("b", "br2", "10.233.0.0/16")
    assert ipam.allocate("b", "br2", "10.233.5.0/24") == "10.233.5.2"


def test_bridge_keeps_its_subnet(tmp_path: Path) -> None:
    ipam = Ipam(tmp_path)
    ipam.allocate("a", "br", SUBNET)
    with pytest.raises(BridgeConfigError, match="configured with subnet 10.233.4.0/24, not 10.233.6.0/24"):
        ipam.allocate("b", "br", "10.233.6.0/24")


def test_published_ports_are_host_wide(tmp_path: Path) -> None:
    ipam = Ipam(tmp_path)
    ipam.allocate("a", "br1", SUBNET, ports=[PortMapping(5300, 80)])
    with pytest.raises(PortInUseError, match="5300/tcp is already published by container a"):
        ipam.allocate("b", "br2", "10.233.5.0/24", ports=[PortMapping(5300, 8080)])
    assert ipam.allocate("b", "br2", "10.233.5.0/24", ports=[PortMapping(5300, 80, "udp")])
    ipam.release("a")
    assert ipam.allocate("c", "br1", SUBNET, ports=[PortMapping(5300, 80)])


def test_exhaustion_is_a_clear_error(tmp_path: Path) -> None:
    ipam = Ipam(tmp_path)
    got = [ipam.allocate(f"c{i}", "br", "10.233.4.0/29") for i in range(5)]  # .2 - .6
    assert got == [f"10.233.4.{i}" for i in range(2, 7)]
    with pytest.raises(GpusnapError, match="no free address left in 10.233.4.0/29"):
        ipam.allocate("c9", "br", "10.233.4.0/29")


def test_corrupt_state_file_is_reported_not_overwritten(tmp_path: Path) -> None:
    ipam = Ipam(tmp_path)
    ipam.dir.mkdir(parents=True)
    ipam.path.write_text("{not json")
    with pytest.raises(GpusnapError, match="corrupt"):
        ipam.allocate("a", "br", SUBNET)
    assert ipam.path.read_text() == "{not json"


def test_failed_transaction_saves_nothing(tmp_path: Path) -> None:
    ipam = Ipam(tmp_path)
    ipam.allocate("a", "br", SUBNET)
    with pytest.raises(RuntimeError):
        with ipam.locked() as state:
            state.allocate("b", "br", None, [])
            raise RuntimeError("netlink failed")
    assert set(ipam.read().leases) == {"a"}


def _worker(state_dir: str, worker: int, count: int, barrier: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:  # type: ignore[name-defined]
    ipam = Ipam(Path(state_dir))
    barrier.wait()
    got = [ipam.allocate(f"w{worker}-{i}", "br", "10.233.4.0/24") for i in range(count)]
    # Release some and take again, so frees race with allocations too.
    for i in range(0, count, 3):
        ipam.release(f"w{worker}-{i}")
        got[i] = ipam.allocate(f"w{worker}-{i}", "br", "10.233.4.0/24")
    out.put(got)


def test_concurrent_processes_never_get_the_same_address(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    workers, count = 8, 12
    barrier = ctx.Barrier(workers)
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), w, count, barrier, out)) for w in range(workers)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    addresses = [a for r in results for a in r]
    assert len(addresses) == workers * count == len(set(addresses))
    state = Ipam(tmp_path).read()
    assert len(state.leases) == workers * count
    assert sorted(lease.address for lease in state.leases.values()) == sorted(addresses)


def test_state_round_trips(tmp_path: Path) -> None:
    ipam = Ipam(tmp_path)
    ipam.allocate("a", "br", SUBNET, ports=[PortMapping(5300, 80)])
    state = ipam.read()
    assert IpamState.from_dict(state.to_dict()).to_dict() == state.to_dict()
