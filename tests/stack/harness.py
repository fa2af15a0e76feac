"""pytest fixtures over tests/gpu_harness.py, for the suites that run its containers.

``stack`` and ``backend``: CPU containers through gpusnap-runtime with the driver stand-in as
the GPU backend (tests/integration/gpu, tests/integration/reliability); ``containers``: the
test's containers, cleaned up afterwards whatever happened (those and tests/gpu). A conftest
imports the ones its tests use.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_harness import Container, Stack, standin_backend, standin_stack


@pytest.fixture
def stack(tmp_path: Path) -> Stack:
    return standin_stack(tmp_path)


@pytest.fixture
def backend(stack: Stack):  # type: ignore[no-untyped-def]
    return standin_backend(stack)


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    made: list[Container] = []
    yield made
    for c in made:
        c.cleanup()
