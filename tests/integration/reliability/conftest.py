"""Wires this directory's tests to the reliability ledger (tests/reliability/ledger.py), gives
them a real registry (tests/stack/registry.py) in this area's ports, and the driver stand-in's
``stack`` and ``backend`` (tests/stack/harness.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "reliability"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the stack package, gpu_harness

import reliability_ledger as _ledger  # noqa: E402
from stack.registry import REL_PORTS, Registry  # noqa: E402
from stack.harness import backend, stack  # noqa: E402,F401 (fixtures; the name ``stack`` is the fixture from here on)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    _ledger.clear_once(config)


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: pytest.Config) -> None:
    _ledger.summary_once(config, terminalreporter)


@pytest.fixture
def ledger(pytestconfig: pytest.Config) -> _ledger.Ledger:
    return _ledger.Ledger(_ledger.ledger_path(pytestconfig.rootpath))


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with Registry(tmp_path / "registry", REL_PORTS) as reg:
        yield reg
