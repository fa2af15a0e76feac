import json
import tomllib
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from gpusnap.admin import install as core
from gpusnap.cli.install import register
from gpusnap.errors import UsageError


@pytest.fixture
def paths(tmp_path: Path) -> core.InstallPaths:
    return core.InstallPaths(
        hooks_dir=tmp_path / "hooks.d",
        system_containers_conf=tmp_path / "share-containers.conf",
        containers_conf=tmp_path / "containers.conf",
        containers_conf_d=tmp_path / "containers.conf.d",
        daemon_json=tmp_path / "daemon.json",
        containerd_config=tmp_path / "config.toml",
    )


@pytest.fixture
def opts(paths: core.InstallPaths) -> core.InstallOptions:
    return core.InstallOptions("/opt/gpusnap/bin/gpusnap-runtime", "/opt/gpusnap/bin/gpusnap-hook", "gpusnap", paths)


def snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


def test_docker_keeps_other_keys_backs_up_and_is_idempotent(opts, paths, tmp_path) -> None:
    original = {"experimental": True, "default-ulimits": {"nofile": {"Name": "nofile", "Hard": 10000, "Soft": 10000}},
                "runtimes": {"other": {"path": "/usr/bin/other"}}, "log-level": "warn"}
    paths.daemon_json.write_text(json.dumps(original))
    changes = core.install("docker", opts)
    assert [c.action for c in changes] == ["update"]
    cfg = json.loads(paths.daemon_json.read_text())
    assert cfg["runtimes"] == {"other": {"path": "/usr/bin/other"}, "gpusnap": {"path": opts.runtime_path}}
    assert {k: v for k, v in cfg.items() if k != "runtimes"} == {k: v for k, v in original.items() if k != "runtimes"}
    assert changes[0].backup is not None and json.loads(changes[0].backup.read_text()) == original
    before = snapshot(tmp_path)
    again = core.install("docker", opts)
    assert [c.action for c in again] == ["unchanged"] and snapshot(tmp_path) == before
    core.uninstall("docker", opts)
    assert json.loads(paths.daemon_json.read_text()) == original


def test_docker_missing_file_created_and_bad_json_refused(opts, paths) -> None:
    assert core.install("docker", opts)[0].action == "create"
    assert json.loads(paths.daemon_json.read_text()) == {"runtimes": {"gpusnap": {"path": opts.runtime_path}}}
    paths.daemon_json.write_text("{oops")
    with pytest.raises(UsageError, match="not valid JSON"):
        core.install("docker", opts)
    assert paths.daemon_json.read_text() == "{oops"


def test_dry_run_writes_nothing(opts, paths, tmp_path) -> None:
    paths.daemon_json.write_text('{"debug": true}')
    before = snapshot(tmp_path)
    changes = core.install("docker", opts, dry_run=True)
    assert changes[0].describe(dry_run=True).startswith(f"would update {paths.daemon_json}")
    for engine in ("podman", "containerd"):
        assert all(c.action == "create" for c in core.install(engine, opts, dry_run=True))
    assert snapshot(tmp_path) == before


def test_podman_hooks_d_and_dropin(opts, paths, tmp_path) -> None:
    paths.containers_conf.write_text('[containers]\ndefault_ulimits = ["nofile=10000:10000"]\n[engine]\nruntime_supports_json = ["crun", "runc", "mine"]\n')
    changes = core.install("podman", opts)
    assert [c.action for c in changes] == ["create"] * 4
    hooks = sorted(p.name for p in paths.hooks_dir.iterdir())
    assert hooks == ["gpusnap-createcontainer.json", "gpusnap-createruntime.json", "gpusnap-poststop.json"]
    doc = json.loads((paths.hooks_dir / "gpusnap-createcontainer.json").read_text())
    assert doc["hook"] == {"path": opts.hook_path, "args": ["gpusnap-hook", "createContainer"], "timeout": 30}
    assert doc["stages"] == ["createContainer"] and doc["when"] == {"annotations": {r"^gpusnap\.io/gpus$": ".*"}}
    conf = tomllib.loads((paths.containers_conf_d / "50-gpusnap.conf").read_text())
    assert conf["engine"]["runtimes"]["gpusnap"] == [opts.runtime_path]
    assert conf["engine"]["runtime_supports_json"] == ["crun", "runc", "mine", "gpusnap"]
    before = snapshot(tmp_path)
    assert all(c.action == "unchanged" for c in core.install("podman", opts))
    assert snapshot(tmp_path) == before
    assert all(c.action == "remove" for c in core.uninstall("podman", opts))
    assert list(paths.hooks_dir.iterdir()) == [] and not (paths.containers_conf_d / "50-gpusnap.conf").exists()


CONTAINERD_V2 = '''version = 2
# operator's comment
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
'''


def test_containerd_block_appended_kept_and_removed(opts, paths, tmp_path) -> None:
    paths.containerd_config.write_text(CONTAINERD_V2)
    assert core.install("containerd", opts)[0].action == "update"
    text = paths.containerd_config.read_text()
    assert text.startswith(CONTAINERD_V2)  # the operator's file byte for byte, comments included
    cri = tomllib.loads(text)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["runtimes"]["gpusnap"] == {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": opts.runtime_path}}
    assert cri["default_runtime_name"] == "runc" and "runc" in cri["runtimes"]
    before = snapshot(tmp_path)
    assert core.install("containerd", opts)[0].action == "unchanged" and snapshot(tmp_path) == before
    core.uninstall("containerd", opts)
    assert paths.containerd_config.read_text() == CONTAINERD_V2


def test_containerd_new_file_v1_and_foreign_entry(opts, paths) -> None:
    core.install("containerd", opts)
    data = tomllib.loads(paths.containerd_config.read_text())
    assert data["version"] == 2 and data["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["gpusnap"]
    core.uninstall("containerd", opts)
    assert not paths.containerd_config.exists()
    paths.containerd_config.write_text('[plugins.cri.containerd]\nsnapshotter = "overlayfs"\n')
    core.install("containerd", opts)
    assert tomllib.loads(paths.containerd_config.read_text())["plugins"]["cri"]["containerd"]["runtimes"]["gpusnap"]
    paths.containerd_config.write_text(CONTAINERD_V2 + '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpusnap]\n    runtime_type = "x"\n')
    with pytest.raises(UsageError, match="did not write"):
        core.install("containerd", opts)


def test_bad_engine_and_name(opts) -> None:
    with pytest.raises(UsageError, match="unknown engine"):
        core.install("lxc", opts)
    opts.name = "bad name"
    with pytest.raises(UsageError, match="runtime name"):
        core.install("docker", opts)


def test_failed_write_rolls_back_the_files_already_written(opts, paths, tmp_path) -> None:
    paths.containers_conf_d.write_text("a file where the drop-in directory should be")
    with pytest.raises(Exception, match="no file was left changed"):
        core.install("podman", opts)
    assert not paths.hooks_dir.exists() or list(paths.hooks_dir.iterdir()) == []


def test_cli_commands(paths, tmp_path) -> None:
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    paths.daemon_json.write_text('{"debug": true}')
    args = ["--runtime-path", "/opt/g/gpusnap-runtime", "--hook-path", "/opt/g/gpusnap-hook", "--daemon-json", str(paths.daemon_json)]
    r = runner.invoke(app, ["install", "docker", "--dry-run", *args])
    assert r.exit_code == 0 and r.output.startswith("would update") and json.loads(paths.daemon_json.read_text()) == {"debug": True}
    r = runner.invoke(app, ["install", "docker", *args])
    assert r.exit_code == 0 and r.output.startswith("update ") and "backup" in r.output
    r = runner.invoke(app, ["install", "docker", *args])
    assert r.exit_code == 0 and r.output.startswith("unchanged ")
    r = runner.invoke(app, ["uninstall", "docker", "--daemon-json", str(paths.daemon_json)])
    assert r.exit_code == 0 and json.loads(paths.daemon_json.read_text()) == {"debug": True}
    paths.daemon_json.write_text("[]")
    r = runner.invoke(app, ["install", "docker", *args])
    assert r.exit_code == 2 and "must hold a JSON object" in r.output


def test_podman_hooks_dir_from_config_or_default(paths, tmp_path) -> None:
    from dataclasses import replace

    unset = replace(paths, hooks_dir=None)
    assert core.podman_hooks_dir(unset) == core.PODMAN_DEFAULT_HOOKS_DIR
    paths.system_containers_conf.write_text('[engine]\nhooks_dir = ["/opt/hooks-a", "/opt/hooks-b"]\n')
    assert core.podman_hooks_dir(unset) == Path("/opt/hooks-a")
    paths.containers_conf.write_text(f'[engine]\nhooks_dir = ["{tmp_path}/mine"]\n')
    assert core.podman_hooks_dir(unset) == tmp_path / "mine"
    core.install("podman", core.InstallOptions("/r", "/h", "gpusnap", unset))
    assert len(list((tmp_path / "mine").glob("gpusnap-*.json"))) == 3
