"""runc-direct's side of bridge networking that needs no root: metadata and option checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpusnap.config import Settings
from gpusnap.engines.base import ContainerInfo, EngineCheckpoint
from gpusnap.engines.runc_direct import BUNDLE_RECORD, RuncDirectEngine
from gpusnap.errors import UsageError


def _checkpoint(tmp_path: Path, network_record: dict | None) -> EngineCheckpoint:  # type: ignore[type-arg]
    (tmp_path / BUNDLE_RECORD).write_text(json.dumps({"record": {"name": "c", "network_record": network_record}, "spec": {}}))
    return EngineCheckpoint(form="criu-dir", path=tmp_path, image_dir=tmp_path, container=ContainerInfo(id="c", name="c", engine="runc-direct"))


def test_checkpoint_extra_carries_the_network_record(tmp_path: Path) -> None:
    engine = RuncDirectEngine(Settings(run_dir=tmp_path / "run", state_dir=tmp_path / "state"))
    record = {"address": "10.233.3.2", "mac": "02:00:00:00:00:01", "ports": []}
    assert engine.checkpoint_extra(_checkpoint(tmp_path, record)) == {"network": record}
    assert engine.checkpoint_extra(_checkpoint(tmp_path, None)) == {}


@pytest.mark.parametrize(("kwargs", "words"), [({"ip": "10.233.3.9"}, "--ip needs --network bridge"), ({"publish": ["5300:80"]}, "--publish needs")])
def test_network_options_need_bridge(tmp_path: Path, kwargs: dict, words: str) -> None:  # type: ignore[type-arg]
    engine = RuncDirectEngine(Settings(run_dir=tmp_path / "run", state_dir=tmp_path / "state"))
    with pytest.raises(UsageError, match=words):
        engine.run("gs-net-x", ["true"], network="none", **kwargs)
