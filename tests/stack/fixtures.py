"""The shared pytest fixtures (the other modules of this package are plain helpers, which
bench/ uses without pytest). A suite's conftest.py imports the ones its tests use.

``podman_names``: podman containers a test makes, removed afterwards whatever happened.
Over tests/gpu_harness.py: ``stack`` and ``backend``, CPU containers through gpusnap-runtime with
the driver stand-in as the GPU backend; ``containers``, the test's harness containers, cleaned
up afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_harness import Container, Stack, standin_backend, standin_stack

from stack.proc import run


@pytest.fixture
def podman_names() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        run(["podman", "rm", "-f", "-t", "0", name], check=False)


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
