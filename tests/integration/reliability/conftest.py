"""Wires this directory's tests to the reliability ledger (tests/reliability/reliability_ledger.py),
gives them a real registry (tests/stack/registry.py) in this area's ports, and the driver
stand-in's ``stack`` and ``backend`` (tests/stack/fixtures.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(TESTS / "reliability"))
sys.path.insert(0, str(TESTS))  # the stack package, gpu_harness

from reliability_ledger import ledger, module_ledger, pytest_collection_modifyitems, pytest_terminal_summary  # noqa: E402,F401
from stack.registry import REL_PORTS, Registry  # noqa: E402
from stack.fixtures import backend, stack  # noqa: E402,F401 (fixtures; the name ``stack`` is the fixture from here on)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with Registry(tmp_path / "registry", REL_PORTS) as reg:
        yield reg
