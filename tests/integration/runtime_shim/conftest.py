"""Fixtures for the runtime-shim integration tests (defined in shimstack.py, shared by name)."""

from shimstack import data_dir, docker_names, docker_runtime, podman_names, shim  # noqa: F401
