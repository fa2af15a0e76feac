from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the stack package
from stack.registry import PKG_PORTS, Registry  # noqa: E402

pytestmark = pytest.mark.integration


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.geteuid() != 0:
        for item in items:
            if "integration/packaging" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason="needs root (runc, podman, mounts)"))


def _need(*tools: str) -> None:
    for t in tools:
        if not shutil.which(t) and not os.path.exists(t):
            pytest.skip(f"{t} not installed (run tests/host/provision.sh)")


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    _need("/usr/bin/docker-registry")
    with Registry(tmp_path / "registry", PKG_PORTS) as reg:
        yield reg


@pytest.fixture
def auth_registry(tmp_path: Path) -> Iterator[Registry]:
    _need("/usr/bin/docker-registry")
    with Registry(tmp_path / "registry-auth", PKG_PORTS, user="gs-pkg-user", password="gs-pkg-secret") as reg:
        yield reg


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture(autouse=True)
def _no_home_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Never read or write the real ~/.docker or auth.json of the machine running the tests.
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
