import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from gpusnap.config import Settings
from gpusnap.errors import UsageError
from gpusnap.oci_hooks import main as hook
from gpusnap.ocispec.gpu_modifiers import ANN_ASSIGNED, ANN_VENDOR, SCHEMA_DIR, STABLE_LIB_DIR


def state(bundle: Path, cid: str = "gs-dev-h1", **extra) -> dict:
    doc = {"ociVersion": "1.0.2", "id": cid, "status": "creating", "pid": 4242, "bundle": str(bundle),
           "annotations": {ANN_ASSIGNED: "GPU-a,GPU-b", ANN_VENDOR: "nvidia"}}
    doc.update(extra)
    return doc


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(run_dir=tmp_path / "run", state_dir=tmp_path / "state")


def run_hook(stage: str, stdin: str, settings: Settings) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "GPUSNAP_RUN_DIR": str(settings.run_dir), "GPUSNAP_STATE_DIR": str(settings.state_dir),
           "GPUSNAP_CONFIG": "/nonexistent.toml"}
    return subprocess.run([sys.executable, "-m", "gpusnap.oci_hooks.main", stage], input=stdin, capture_output=True, text=True, env=env)


def test_record_then_cleanup_through_the_command(tmp_path: Path, settings: Settings) -> None:
    doc = json.dumps(state(tmp_path))
    r = run_hook("createRuntime", doc, settings)
    assert r.returncode == 0, r.stderr
    rec = json.loads((settings.state_dir / "gpus/gs-dev-h1.json").read_text())
    assert rec["gpus"] == ["GPU-a", "GPU-b"] and rec["pid"] == 4242 and rec["vendor"] == "nvidia" and rec["restores"] == 0
    r = run_hook("poststop", doc, settings)
    assert r.returncode == 0 and not (settings.state_dir / "gpus/gs-dev-h1.json").exists()
    assert run_hook("poststop", doc, settings).returncode == 0  # twice: nothing to clean, no failure


@pytest.mark.parametrize("stdin,needle", [
    ("not json", "not the OCI state JSON"),
    ("[1]", "not a JSON object"),
    ('{"ociVersion":"1.0.2","id":"x","status":"creating"}', "'bundle'"),
    ('{"ociVersion":"1.0.2","id":"x","status":"bogus","bundle":"/b"}', "status 'bogus'"),
    ('{"ociVersion":"1.0.2","id":"x","status":"created","bundle":"rel"}', "not an absolute path"),
    ('{"ociVersion":"1.0.2","id":"x","status":"created","bundle":"/b","pid":-1}', "pid -1"),
])
def test_garbage_on_stdin_is_one_line_and_exit_2(stdin: str, needle: str, settings: Settings) -> None:
    r = run_hook("createRuntime", stdin, settings)
    assert r.returncode == 2
    assert needle in r.stderr and r.stderr.count("\n") == 1 and r.stderr.startswith("gpusnap-hook createRuntime: ")


def test_bad_stage_and_usage(settings: Settings) -> None:
    r = run_hook("prestop", "{}", settings)
    assert r.returncode == 2 and "unknown stage 'prestop'" in r.stderr
    assert hook.main(["--help"]) == 0
    assert hook.main([]) == 2


def test_hand_check_agrees_with_the_state_schema(tmp_path: Path) -> None:
    schema = json.loads((SCHEMA_DIR / "oci-state.schema.json").read_text())
    good = state(tmp_path)
    jsonschema.validate(good, schema)
    hook.parse_state(json.dumps(good))
    for bad in ({**good, "status": "x"}, {**good, "pid": "1"}, {**good, "annotations": {"a": 1}}, {k: v for k, v in good.items() if k != "id"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        with pytest.raises(UsageError):
            hook.parse_state(json.dumps(bad))


def _bundle_with_glibc_rootfs(tmp_path: Path) -> Path:
    bundle = tmp_path / "bundle"
    rootfs = bundle / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    lib = rootfs / STABLE_LIB_DIR.lstrip("/")
    lib.mkdir(parents=True)
    # A real shared object so ldconfig has something to cache under its soname.
    libc = Path(os.path.realpath("/lib/x86_64-linux-gnu/libz.so.1"))
    shutil.copy(libc, lib / "libz.so.1")
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"}}))
    return bundle


def test_create_container_refreshes_ld_cache_with_host_ldconfig(tmp_path: Path, settings: Settings) -> None:
    bundle = _bundle_with_glibc_rootfs(tmp_path)
    msg = hook.run_stage("createContainer", hook.parse_state(json.dumps(state(bundle))), settings)
    assert msg == "ld cache refreshed"
    rootfs = bundle / "rootfs"
    assert (rootfs / "etc/ld.so.conf.d" / hook.LD_CONF_NAME).read_text() == STABLE_LIB_DIR + "\n"
    listed = subprocess.run(["ldconfig", "-p", "-C", str(rootfs / "etc/ld.so.cache")], capture_output=True, text=True, check=True).stdout
    assert f"{STABLE_LIB_DIR}/libz.so.1" in listed


def test_create_container_skips_images_without_glibc_config(tmp_path: Path, settings: Settings) -> None:
    bundle = tmp_path / "b"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}}))
    assert "no glibc" in hook.run_stage("createContainer", hook.parse_state(json.dumps(state(bundle))), settings)
    assert not (bundle / "rootfs/etc").exists()


def test_during_restore_skips_mount_tree_work_and_counts_restores(tmp_path: Path, settings: Settings) -> None:
    bundle = _bundle_with_glibc_rootfs(tmp_path)
    st = hook.parse_state(json.dumps(state(bundle)))
    hook.run_stage("createRuntime", st, settings)
    marker = settings.run_dir / "restoring" / st.id
    marker.parent.mkdir(parents=True)
    marker.touch()
    assert hook.run_stage("createContainer", st, settings).startswith("restore:")
    assert not (bundle / "rootfs/etc/ld.so.conf.d").exists()
    st2 = hook.parse_state(json.dumps(state(bundle, pid=777)))
    assert hook.run_stage("createRuntime", st2, settings).endswith("(restore)")
    rec = json.loads(hook.record_path(settings, st.id).read_text())
    assert rec["pid"] == 777 and rec["restores"] == 1


def test_hooks_run_during_a_restore_note_their_time_for_the_shim(tmp_path: Path, settings: Settings) -> None:
    doc = json.dumps(state(tmp_path))
    notes = settings.run_dir / "restore-hooks" / "gs-dev-h1"
    assert run_hook("createRuntime", doc, settings).returncode == 0
    assert not notes.exists()  # not a restore: nothing noted
    (settings.run_dir / "restoring").mkdir(parents=True)
    (settings.run_dir / "restoring" / "gs-dev-h1").touch()
    for stage in ("prestart", "createRuntime"):
        assert run_hook(stage, doc, settings).returncode == 0
    lines = [json.loads(ln) for ln in notes.read_text().splitlines()]
    assert [ln["stage"] for ln in lines] == ["prestart", "createRuntime"]
    assert all(0 < ln["seconds"] < 60 for ln in lines)  # the interpreter's start included


def test_poststart_updates_record_only_where_visible(tmp_path: Path, settings: Settings) -> None:
    st = hook.parse_state(json.dumps(state(tmp_path, status="running")))
    assert hook.run_stage("poststart", st, settings).startswith("no record")
    hook.run_stage("createRuntime", st, settings)
    hook.run_stage("poststart", st, settings)
    assert json.loads(hook.record_path(settings, st.id).read_text())["stage"] == "poststart"


def test_hook_imports_stay_light() -> None:
    code = "import sys, gpusnap.oci_hooks.main; bad = [m for m in ('jsonschema', 'typer', 'rich', 'docker') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize("link", ["etc/ld.so.conf.d", "conf-file"])
def test_create_container_never_writes_through_the_images_symlinks(tmp_path: Path, settings: Settings, link: str) -> None:
    """The hook runs as root before pivot_root: an image whose ld.so.conf.d (or the entry file
    itself) is an absolute link must not make it write a file of the host."""
    bundle = _bundle_with_glibc_rootfs(tmp_path)
    rootfs = bundle / "rootfs"
    host_dir = tmp_path / "host-etc"
    host_dir.mkdir()
    victim = host_dir / hook.LD_CONF_NAME
    victim.write_text("host's own\n")
    if link == "etc/ld.so.conf.d":
        (rootfs / "etc/ld.so.conf.d").symlink_to(host_dir)
    else:
        (rootfs / "etc/ld.so.conf.d").mkdir()
        (rootfs / "etc/ld.so.conf.d" / hook.LD_CONF_NAME).symlink_to(victim)
    msg = hook.run_stage("createContainer", hook.parse_state(json.dumps(state(bundle))), settings)
    assert "links out of the image" in msg
    assert victim.read_text() == "host's own\n" and sorted(p.name for p in host_dir.iterdir()) == [hook.LD_CONF_NAME]
