"""Fixtures for the runtime-shim integration tests (defined in shimstack.py, shared by name)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the stack package

from shimstack import data_dir, docker_names, docker_runtime, shim  # noqa: E402,F401
from stack.fixtures import podman_names  # noqa: E402,F401
