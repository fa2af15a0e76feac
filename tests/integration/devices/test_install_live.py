"""`gpusnap install docker` on the host's real daemon.json and dockerd, and a docker container
started through the runtime it registered (env travels in a wrapper: dockerd drops ours)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from devstack import BIN, DOCKER, DOCKER_IMAGE, PODMAN_IMAGE, PROBE, GpuShim, etc_lock, expected_nodes, make_gpu_shim, parse_probe, run, unique, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]

DAEMON_JSON = Path("/etc/docker/daemon.json")


def gpusnap_install(*args: str) -> subprocess.CompletedProcess[str]:
    # gpusnap's main CLI module is another part's; these commands run in a Typer app of their own.
    code = "import sys, typer; from gpusnap.cli.install import register; app = typer.Typer(); register(app); app(sys.argv[1:])"
    return run([sys.executable, "-c", code, *args], check=False)


def docker_runtimes() -> dict:
    return json.loads(run([DOCKER, "info", "--format", "{{json .Runtimes}}"]).stdout)


def reload_dockerd() -> None:
    os.kill(int(Path("/var/run/docker.pid").read_text().strip()), signal.SIGHUP)


@pytest.fixture
def registered(tmp_path: Path) -> Iterator[tuple[str, GpuShim, list[str]]]:
    """Install a runtime named gs-dev-rt-... into the real daemon.json under the shared lock;
    uninstall it and drop our backups afterwards, whatever happened."""
    name = unique("rt")
    shim = make_gpu_shim(tmp_path / "shim", name)
    outputs: list[str] = []
    backups_before = set(DAEMON_JSON.parent.glob("daemon.json.gpusnap-*.bak"))
    args = ["--name", name, "--runtime-path", str(shim.wrapper), "--hook-path", str(BIN / "gpusnap-hook")]
    try:
        with etc_lock():
            before = json.loads(DAEMON_JSON.read_text())
            first = gpusnap_install("install", "docker", *args)
            second = gpusnap_install("install", "docker", *args)
            after_second = json.loads(DAEMON_JSON.read_text())
            reload_dockerd()
        outputs += [first.stdout + first.stderr, second.stdout + second.stderr]
        assert first.returncode == 0 and second.returncode == 0, outputs
        assert {k: v for k, v in after_second.items() if k != "runtimes"} == {k: v for k, v in before.items() if k != "runtimes"}
        assert after_second["runtimes"][name] == {"path": str(shim.wrapper)}
        assert {k: v for k, v in after_second["runtimes"].items() if k != name} == before.get("runtimes", {})
        wait_for(lambda: name in docker_runtimes(), f"dockerd to load {name}")
        yield name, shim, outputs
    finally:
        with etc_lock():
            gpusnap_install("uninstall", "docker", "--name", name)
            reload_dockerd()
        for b in set(DAEMON_JSON.parent.glob("daemon.json.gpusnap-*.bak")) - backups_before:
            b.unlink()


def test_install_docker_keeps_keys_twice_no_change_and_runs_a_gpu_container(registered) -> None:
    name, shim, outputs = registered
    assert outputs[0].startswith(f"update {DAEMON_JSON}") and "backup" in outputs[0]
    assert outputs[1].startswith(f"unchanged {DAEMON_JSON}")
    cname = unique("docker")
    try:
        out = run([DOCKER, "run", "--rm", "--name", cname, "--runtime", name, "-e", "NVIDIA_VISIBLE_DEVICES=0", DOCKER_IMAGE, "sh", "-c", PROBE]).stdout
    finally:
        run([DOCKER, "rm", "-f", cname], check=False)
    view = parse_probe(out)
    assert view.nodes == expected_nodes(shim.tree, [0])
    assert view.env["GPUSNAP_ASSIGNED_GPUS"] == shim.tree.uuids[0]


def test_uninstall_leaves_daemon_json_as_it_was(tmp_path: Path) -> None:
    name = unique("rt")
    args = ["--name", name, "--runtime-path", "/usr/local/bin/gpusnap-runtime", "--hook-path", "/usr/local/bin/gpusnap-hook"]
    backups_before = set(DAEMON_JSON.parent.glob("daemon.json.gpusnap-*.bak"))
    with etc_lock():
        try:
            before = json.loads(DAEMON_JSON.read_text())
            dry = gpusnap_install("install", "docker", "--dry-run", *args)
            assert dry.returncode == 0 and dry.stdout.startswith("would update") and json.loads(DAEMON_JSON.read_text()) == before
            assert gpusnap_install("install", "docker", *args).returncode == 0
            assert gpusnap_install("uninstall", "docker", "--name", name).returncode == 0
            assert json.loads(DAEMON_JSON.read_text()) == before
        finally:
            gpusnap_install("uninstall", "docker", "--name", name)
            for b in set(DAEMON_JSON.parent.glob("daemon.json.gpusnap-*.bak")) - backups_before:
                b.unlink()


def test_install_containerd_config_is_read_by_containerd(tmp_path: Path) -> None:
    """containerd itself parses the result (`containerd --config FILE config dump`); no daemon is touched."""
    config = tmp_path / "config.toml"
    config.write_text(run(["containerd", "config", "default"]).stdout)
    original = config.read_text()
    args = ["--containerd-config", str(config), "--runtime-path", "/usr/local/bin/gpusnap-runtime", "--hook-path", "/usr/local/bin/gpusnap-hook"]
    assert gpusnap_install("install", "containerd", *args).returncode == 0
    second = gpusnap_install("install", "containerd", *args)
    assert second.returncode == 0 and second.stdout.startswith("unchanged")
    dumped = run(["containerd", "--config", str(config), "config", "dump"]).stdout
    import tomllib

    cri = tomllib.loads(dumped)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["runtimes"]["gpusnap"]["runtime_type"] == "io.containerd.runc.v2"
    assert cri["runtimes"]["gpusnap"]["options"]["BinaryName"] == "/usr/local/bin/gpusnap-runtime"
    assert "runc" in cri["runtimes"]
    assert gpusnap_install("uninstall", "containerd", "--containerd-config", str(config)).returncode == 0
    assert config.read_text() == original


def test_install_podman_runtime_and_hooks_d_used_by_podman(tmp_path: Path) -> None:
    """Real /etc/containers paths under the shared lock, named gs-dev-rt-...: podman finds the
    runtime by name, takes our hooks.d entries for an annotated container, and the shim does not
    add them a second time."""
    name = unique("rt")
    shim = make_gpu_shim(tmp_path / "shim", name)
    args = ["--name", name, "--runtime-path", str(shim.wrapper), "--hook-path", str(BIN / "gpusnap-hook")]
    cname = unique("podman")
    with etc_lock():
        try:
            first = gpusnap_install("install", "podman", *args)
            assert first.returncode == 0, first.stderr
            assert gpusnap_install("install", "podman", *args).stdout.count("unchanged") == 4
            out = run(["podman", "--runtime", name, "run", "--name", cname, "--annotation", "gpusnap.io/gpus=1",
                       PODMAN_IMAGE, "sh", "-c", PROBE]).stdout
            cid = run(["podman", "inspect", "--format", "{{.Id}}", cname]).stdout.strip()
            bundle = Path(run(["podman", "inspect", "--format", "{{.StaticDir}}", cname]).stdout.strip())
            hooks = json.loads((bundle / "config.json").read_text())["hooks"]
        finally:
            run(["podman", "rm", "-f", "-t", "0", cname], check=False)
            gpusnap_install("uninstall", "podman", "--name", name)
    view = parse_probe(out)
    assert view.nodes == expected_nodes(shim.tree, [1])
    for stage in ("createRuntime", "createContainer"):
        ours = [h for h in hooks[stage] if h["path"].endswith("gpusnap-hook")]
        assert ours == [{"path": str(BIN / "gpusnap-hook"), "args": ["gpusnap-hook", stage], "timeout": 30}]  # hooks.d's, once
    # podman runs hooks.d poststop hooks itself, outside the spec: the spec has the shim's only.
    assert len([h for h in hooks["poststop"] if h["path"].endswith("gpusnap-hook")]) == 1
    assert not Path(f"/var/lib/gpusnap/gpus/{cid}.json").exists()  # its poststop cleaned up
    assert not list(Path("/etc/containers/oci/hooks.d").glob(f"{name}-*.json"))
    assert not Path(f"/etc/containers/containers.conf.d/50-{name}.conf").exists()
