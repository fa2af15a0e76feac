"""podman through gpusnap-runtime: checkpoint --export, rm, restore --import, twice."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from shimstack import PODMAN_IMAGE, COUNTER, Shim, assert_resumed, counter_values, make_shim, run, unique, wait_counting

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]


def podman(shim: Shim, *args: str, check: bool = True, env: dict[str, str] | None = None):
    return run(["podman", "--runtime", str(shim.wrapper), *args], check=check, env=env)


def test_checkpoint_export_rm_restore_import_twice(shim: Shim, data_dir: Path, tmp_path: Path, podman_names: list[str]) -> None:
    name = unique("podman")
    podman_names.append(name)
    podman(shim, "run", "-d", "--name", name, "-v", f"{data_dir}:/data", PODMAN_IMAGE, "sh", "-c", COUNTER)
    wait_counting(data_dir, above=2)
    # The shim's create put a CRIU config for this container in its run dir.
    cid = podman(shim, "inspect", "--format", "{{.Id}}", name).stdout.strip()
    conf = shim.run_dir / "criu" / f"{cid}.conf"
    assert "link-remap" in conf.read_text().split()

    for cycle in (1, 2):
        archive = tmp_path / f"{name}-{cycle}.tar.zst"
        podman(shim, "container", "checkpoint", "--export", str(archive), name)
        at_checkpoint = counter_values(data_dir)[-1]
        assert podman(shim, "inspect", "--format", "{{.State.Status}}", name).stdout.strip() == "exited"
        # gpusnap.json travels inside the exported archive, beside CRIU's images.
        assert "checkpoint/gpusnap.json" in run(["tar", "--zstd", "-tf", str(archive)]).stdout.split()
        podman(shim, "rm", name)
        podman(shim, "container", "restore", "--import", str(archive))
        assert podman(shim, "inspect", "--format", "{{.State.Status}}", name).stdout.strip() == "running"
        assert_resumed(data_dir, at_checkpoint)
        # The restore marker exists only while a restore runs.
        assert not (shim.run_dir / "restoring" / cid).exists()
    podman(shim, "rm", "-f", "-t", "0", name)


def test_runtime_by_name_in_containers_conf(tmp_path: Path, data_dir: Path, podman_names: list[str]) -> None:
    """Registered by name in a containers.conf (runtime_supports_json) instead of by path."""
    rt = unique("rt").replace("-", "_")
    shim = make_shim(tmp_path / "shim", rt)
    conf = tmp_path / "containers.conf"
    conf.write_text(
        f"[containers]\ndefault_ulimits = [\"nofile=10000:10000\", \"nproc=4096:4096\"]\n"
        f"[engine]\nruntime_supports_json = [\"{rt}\", \"runc\", \"crun\"]\n"
        f"[engine.runtimes]\n{rt} = [\"{shim.wrapper}\"]\n"
    )
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    name = unique("podman-named")
    podman_names.append(name)
    run(["podman", "--runtime", rt, "run", "-d", "--name", name, "-v", f"{data_dir}:/data", PODMAN_IMAGE, "sh", "-c", COUNTER], env=env)
    assert run(["podman", "inspect", "--format", "{{.OCIRuntime}}", name], env=env).stdout.strip() == rt
    wait_counting(data_dir, above=2)
    run(["podman", "--runtime", rt, "container", "checkpoint", name], env=env)
    at_checkpoint = counter_values(data_dir)[-1]
    run(["podman", "--runtime", rt, "container", "restore", name], env=env)
    assert_resumed(data_dir, at_checkpoint)
    run(["podman", "rm", "-f", "-t", "0", name], env=env)
