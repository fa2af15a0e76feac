"""Pieces of the runc-direct engine that need no container (the engine itself is tested for
real in tests/integration/cli)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.config import load_settings
from gpusnap.engines.base import FORM_CRIU_DIR, FORM_DOCKER_DIR, FORM_PODMAN_ARCHIVE
from gpusnap.engines.registry import detect_form, find_container, make_engine
from gpusnap.engines.runc_direct import BUNDLE_RECORD, RuncDirectEngine, make_spec, validate_name
from gpusnap.errors import MissingDependencyError, NotFoundError, UsageError


def test_validate_name() -> None:
    assert validate_name("gs-cli_a.1") == "gs-cli_a.1"
    for bad in ("", "-x", "a/b", "..", "x" * 129, "a b"):
        with pytest.raises(UsageError):
            validate_name(bad)


def test_spec_has_no_terminal_and_joins_given_netns() -> None:
    spec = make_spec("n", ["sh"], Path("/r"), ["A=1"], "/var/run/netns/x")
    assert spec["process"]["terminal"] is False
    assert spec["process"]["env"][-1] == "A=1"
    assert {"type": "network", "path": "/var/run/netns/x"} in spec["linux"]["namespaces"]
    assert {"type": "network"} in make_spec("n", ["sh"], Path("/r"), [], None)["linux"]["namespaces"]
    json.dumps(spec)


def test_detect_form(tmp_path: Path) -> None:
    (tmp_path / "rd").mkdir()
    (tmp_path / "rd" / BUNDLE_RECORD).write_text("{}")
    assert detect_form(tmp_path / "rd") == FORM_CRIU_DIR
    (tmp_path / "dk").mkdir()
    (tmp_path / "dk" / "docker-container.json").write_text("{}")
    assert detect_form(tmp_path / "dk") == FORM_DOCKER_DIR
    import tarfile

    with tarfile.open(tmp_path / "p.tar", "w") as tar:
        for n in ("config.dump", "spec.dump"):
            (tmp_path / n).write_text("{}")
            tar.add(tmp_path / n, arcname=n)
    assert detect_form(tmp_path / "p.tar") == FORM_PODMAN_ARCHIVE
    (tmp_path / "other").mkdir()
    with pytest.raises(UsageError):
        detect_form(tmp_path / "other")
    with pytest.raises(NotFoundError):
        detect_form(tmp_path / "missing")


def test_unknown_engine_and_network(tmp_path: Path) -> None:
    settings = load_settings(env={}, run_dir=str(tmp_path))
    with pytest.raises(UsageError, match="unknown engine"):
        make_engine("lxc", settings)
    eng = RuncDirectEngine(settings)
    with pytest.raises(UsageError, match="unknown network"):
        eng.run("gs-cli-n", ["sh"], network="host")
    with pytest.raises(UsageError, match="--publish needs --network bridge"):
        eng.run("gs-cli-n", ["sh"], publish=["8080:80"])
    with pytest.raises(UsageError, match="--ip needs --network bridge"):
        eng.run("gs-cli-n", ["sh"], ip="10.210.0.9")
    with pytest.raises(NotFoundError, match="not a directory"):
        eng.run("gs-cli-n", ["sh"], rootfs=str(tmp_path / "nope"))
    assert eng.list() == []


def test_docker_engine_with_dead_socket_names_the_fix(tmp_path: Path) -> None:
    from gpusnap.engines.docker import DockerEngine

    eng = DockerEngine(base_url=f"unix://{tmp_path}/dead.sock")
    assert eng.available() is False
    with pytest.raises(MissingDependencyError, match="not answering.*start dockerd or fix DOCKER_HOST"):
        eng.get("x")


def test_find_container_auto_reports_unreachable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/dead.sock")
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + ":/usr/sbin:/usr/bin:/sbin:/bin")
    settings = load_settings(env={}, run_dir=str(tmp_path))
    with pytest.raises(NotFoundError, match=r"not reachable: docker"):
        find_container("gs-cli-nosuch", "auto", settings)


def test_logcopy_copies_until_eof(tmp_path: Path) -> None:
    log = tmp_path / "log"
    proc = subprocess.run([sys.executable, "-m", "gpusnap.engines.logcopy", str(log)], input=b"a\nb\n" * 50000, timeout=30)
    assert proc.returncode == 0
    assert log.read_bytes() == b"a\nb\n" * 50000
    assert oct(os.stat(log).st_mode & 0o777) == "0o640"


def test_a_carried_spec_decides_no_host_side_part_of_the_restore() -> None:
    """A checkpoint may come from a registry: its spec's CRIU config, GPU plugin settings and
    hooks (run as root) are dropped; the restoring host's runtime derives them again."""
    from gpusnap.engines.runc_direct import _retarget_spec

    carried = make_spec("old", ["sh"], Path("/r"), [], None)
    carried["annotations"].update({
        "org.criu.config": "/run/gpusnap/criu/old.conf", "gpusnap.io/criu-config": "true", "gpusnap.io/criu-libdir": "/tmp/evil",
        "gpusnap.io/criu-env": '{"KFD_NUMA_CHECK":"0"}', "gpusnap.io/criu-options": "file-locks",
    })
    carried["hooks"] = {"prestart": [{"path": "/bin/sh", "args": ["sh", "-c", "touch /pwned"]}]}
    out = _retarget_spec(carried, "new", Path("/new-root"), None)
    assert "hooks" not in out
    assert out["annotations"] == {**make_spec("x", ["sh"], Path("/r"), [], None)["annotations"], "io.gpusnap.name": "new",
                                  "gpusnap.io/criu-options": "file-locks"}  # the container's own request, re-checked at restore


def test_runtime_restore_timings_are_flattened_under_runtime(tmp_path: Path) -> None:
    from gpusnap.engines.runc_direct import runtime_restore_timings
    from gpusnap.metadata import merge_restore_timings

    assert runtime_restore_timings(tmp_path) == {}  # plain runc writes none
    merge_restore_timings(tmp_path, {"timings_s": {"runc_restore": 1.5, "gpu_restore": 0.4}, "gpu_remap": {}})
    merge_restore_timings(tmp_path, {"steps_s": {"runc restore": 1.6}, "hooks_s": {"prestart": 0.04},
                                     "before_steps_s": {"start-up and imports": 0.2}, "total_s": 2.5})
    assert runtime_restore_timings(tmp_path) == {
        "runtime: start-up and imports": 0.2, "runtime: runc restore": 1.6, "runtime: hook prestart": 0.04,
        "runtime: gpu plan: runc_restore": 1.5, "runtime: gpu plan: gpu_restore": 0.4, "runtime: total": 2.5}
    (tmp_path / "gpusnap-restore.json").write_text("[not an object")
    assert runtime_restore_timings(tmp_path) == {}


def test_keep_logs_moves_criu_logs_out_of_the_image_dir_or_removes_them(tmp_path: Path) -> None:
    from gpusnap.engines.runc_direct import keep_logs

    images = tmp_path / "images"
    images.mkdir()
    (images / "dump.log").write_text("(00.000001) CRIU run id\n")
    (images / "pages-1.img").write_bytes(b"p")
    # no log dir: removed, the images stay
    assert keep_logs(images, None, "c1") == []
    assert sorted(p.name for p in images.iterdir()) == ["pages-1.img"]
    # a log dir (made if missing): moved there under the container's name, twice in one second kept apart
    logs = tmp_path / "logs" / "criu"
    kept = []
    for text in ("first\n", "second\n"):
        (images / "dump.log").write_text(text)
        kept += keep_logs(images, logs, "c1")
    assert [p.read_text() for p in kept] == ["first\n", "second\n"]
    assert all(p.parent == logs and p.name.startswith("c1-") and p.name.endswith("-dump.log") for p in kept)
    assert len(set(kept)) == 2 and not list(images.glob("*.log"))
    # a log dir that cannot be made: the log still leaves the checkpoint
    (tmp_path / "file").write_text("x")
    (images / "dump.log").write_text("third\n")
    assert keep_logs(images, tmp_path / "file" / "sub", "c1") == []
    assert not list(images.glob("*.log"))
