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
