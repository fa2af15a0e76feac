"""EngineBase.available(): each engine's require(), answered as a bool (written once, for all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.engines.base import EngineBase
from gpusnap.engines.docker import DockerEngine
from gpusnap.engines.podman import PodmanEngine
from gpusnap.engines.runc_direct import RuncDirectEngine
from gpusnap.errors import MissingDependencyError


def _podman(tmp_path: Path, status: int) -> str:
    exe = tmp_path / f"podman-{status}"
    exe.write_text(f"#!/bin/sh\necho 'Error: cannot connect' >&2\n[ {status} = 0 ] && echo 5.4.2\nexit {status}\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize(("status", "expected"), [(0, True), (125, False)])
def test_available_is_require_answered(tmp_path: Path, status: int, expected: bool) -> None:
    engine = PodmanEngine(binary=_podman(tmp_path, status))
    assert engine.available() is expected
    if not expected:
        with pytest.raises(MissingDependencyError, match="podman does not work: cannot connect"):
            engine.require()


def test_missing_client_is_unavailable(tmp_path: Path) -> None:
    assert PodmanEngine(binary=str(tmp_path / "no-podman")).available() is False
    assert DockerEngine(base_url=f"unix://{tmp_path}/no-docker.sock").available() is False


def test_every_engine_shares_it() -> None:
    for cls in (DockerEngine, PodmanEngine, RuncDirectEngine):
        assert issubclass(cls, EngineBase) and "available" not in vars(cls), cls
