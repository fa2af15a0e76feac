from __future__ import annotations

from pathlib import Path

from gpusnap.criu.config import criu_config_path, options_from_annotations, render_config, write_config


def test_options() -> None:
    assert options_from_annotations({}) == ["link-remap"]
    assert options_from_annotations({"gpusnap.io/tcp-established": "true"}) == ["link-remap", "tcp-established"]
    assert options_from_annotations({"gpusnap.io/tcp-established": "no"}) == ["link-remap"]
    assert options_from_annotations({"gpusnap.io/criu-options": "--ext-unix-sk, file-locks,link-remap"}) == ["link-remap", "ext-unix-sk", "file-locks"]


def test_write(tmp_path: Path) -> None:
    path = criu_config_path(tmp_path / "run", "c1")
    write_config(path, ["link-remap", "tcp-established"])
    assert path == tmp_path / "run" / "criu" / "c1.conf"
    assert path.read_text() == render_config(["link-remap", "tcp-established"])
    assert [ln for ln in path.read_text().splitlines() if not ln.startswith("#")] == ["link-remap", "tcp-established"]
    assert [p.name for p in path.parent.iterdir()] == ["c1.conf"]


def test_network_lock_option_needs_criu_42() -> None:
    from gpusnap.criu.config import takes_network_lock_option

    assert not takes_network_lock_option((4, 1, 1))  # segfaults on it in runc's RPC mode
    assert takes_network_lock_option((4, 2, 0))
    assert takes_network_lock_option((5, 0, 0))


def test_network_lock_skip_annotation_round_trip() -> None:
    from gpusnap.criu.config import skips_network_lock, with_network_lock_skip

    ann = {"gpusnap.io/criu-options": "ext-unix-sk,network-lock iptables"}
    with_network_lock_skip(ann, True)
    assert ann["gpusnap.io/criu-options"] == "ext-unix-sk,network-lock skip"  # one lock method, ours
    assert skips_network_lock(ann)
    assert options_from_annotations(ann) == ["link-remap", "ext-unix-sk", "network-lock skip"]
    with_network_lock_skip(ann, False)
    assert ann == {"gpusnap.io/criu-options": "ext-unix-sk"} and not skips_network_lock(ann)
    empty: dict[str, str] = {"gpusnap.io/criu-options": "network-lock skip"}
    with_network_lock_skip(empty, False)
    assert empty == {}  # no empty annotation left behind
