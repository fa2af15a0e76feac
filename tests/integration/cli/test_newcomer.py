"""What a newcomer hits in the first hour (issue 15), against the real stack: delete several
containers at once, inspect a checkpoint in a registry, import a podman export, doctor on a
host without busybox."""

from __future__ import annotations

import json
import subprocess

import pytest

from .conftest import COUNTER, Gs, unique

pytestmark = pytest.mark.integration


def test_delete_deletes_what_exists_and_reports_the_rest(gs: Gs) -> None:
    names = [unique("rd-del"), unique("rd-del")]
    missing = unique("rd-missing")
    try:
        for n in names:
            gs("run", n, "--", "sh", "-c", COUNTER)
        proc = gs("delete", names[0], missing, names[1], check=False)
        assert proc.returncode == 3, proc  # NOT_FOUND, as the README's table says
        assert proc.stderr.strip().splitlines() == [f"gpusnap: error: no runc-direct container {missing}; `gpusnap ps` lists them"]
        assert [ln for ln in proc.stdout.splitlines() if ln.startswith("deleted ")] == [f"deleted {n}" for n in names]
        assert gs.json("ps") == []
    finally:
        for n in names:
            gs("delete", n, check=False)


def test_doctor_without_busybox_warns_and_says_what_works(gs: Gs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import sys
    from pathlib import Path

    assert shutil_which("busybox"), "the test host has busybox (tests/host/provision.sh)"
    # A host without busybox: each PATH directory that has it is replaced by a copy of its
    # links minus busybox (dropping /usr/bin itself would take CRIU's and runc's tools too).
    path = [str(Path(sys.executable).parent)]
    for i, d in enumerate(os.environ["PATH"].split(":")):
        if d and (Path(d) / "busybox").exists():
            shadow = tmp_path / f"path{i}"
            shadow.mkdir()
            for entry in Path(d).iterdir():
                if entry.name != "busybox":
                    (shadow / entry.name).symlink_to(entry)
            d = str(shadow)
        path.append(d)
    env = {"PATH": ":".join(path)}
    proc = gs("doctor", env=env)  # exit 0: a warning is not a failure
    report = json.loads(gs("doctor", "--json", env=env).stdout)
    [rd] = [c for c in report["checks"] if c["name"] == "engine runc-direct"]
    assert rd["status"] == "warn" and "--rootfs-overlay /" in rd["detail"] and "busybox" in rd["fix"]
    assert report["ok"] is True
    assert proc.stdout.strip().splitlines()[-1] == "all checks passed (1 warning)"
    # What the warning says still works does work, without busybox on PATH.
    name = unique("rd-nobusybox")
    try:
        gs("run", "--rootfs-overlay", "/", name, "--", "sh", "-c", COUNTER, env=env)
        assert [r["status"] for r in gs.json("ps")] == ["running"]  # type: ignore[union-attr,index]
        plain = gs("run", unique("rd-nobusybox"), "--", "true", check=False, env=env)
        assert plain.returncode == 5 and "busybox not found on PATH" in plain.stderr
    finally:
        gs("delete", name, check=False)


def shutil_which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def test_inspect_remote_reads_manifest_and_config_only(gs: Gs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import re

    from stack.registry import CLI_PORTS, Registry

    name = unique("rd-insp")
    with Registry(tmp_path / "registry", CLI_PORTS, log_level="info") as reg:
        remote = f"{reg.host}/gs-cli/inspect-remote:v1"
        try:
            gs("run", name, "--", "sh", "-c", COUNTER)
            gs("checkpoint", name, "--leave-running", "--push", remote, "--insecure")
        finally:
            gs("delete", name, check=False)
        [local] = gs.json("ls")  # type: ignore[misc]
        local_info = gs.json("inspect", local["ref"])  # type: ignore[index]
        layer_digests = {la["digest"] for la in local_info["layers"]}  # type: ignore[index]
        before = reg.log.read_text()
        other = {"GPUSNAP_STORE": str(tmp_path / "empty-store")}
        proc = gs("inspect", remote, "--insecure", "--json", env=other)
        info = json.loads(proc.stdout)
        assert info["ref"] == remote and info["form"] == local_info["form"]  # type: ignore[index]
        assert info["container"]["name"] == name and info["digest"] == local_info["digest"]  # type: ignore[index]
        assert info["stored_size"] == local_info["stored_size"]  # type: ignore[index]
        assert info["process_tree"] == local_info["process_tree"]  # type: ignore[index]
        # The table too, within 80 columns.
        shown = gs("inspect", remote, "--insecure", env=other).stdout
        assert remote in shown and max(len(ln) for ln in shown.splitlines()) <= 80
        # Nothing stored, and no layer fetched: only manifests and the config blob.
        assert not (tmp_path / "empty-store").exists() or not any((tmp_path / "empty-store").rglob("sha256/*"))
        new_log = reg.log.read_text()[len(before):].splitlines()
        fetched = [d for ln in new_log if "GET" in ln for d in re.findall(r"/v2/gs-cli/inspect-remote/blobs/(sha256:[0-9a-f]{64})", ln)]
        assert fetched and not set(fetched) & layer_digests, fetched
        missing = gs("inspect", f"{reg.host}/gs-cli/inspect-remote:nope", "--insecure", check=False, env=other)
        assert missing.returncode == 3 and len(missing.stderr.strip().splitlines()) == 1, missing


def test_import_and_push_a_podman_export_then_restore_it(gs: Gs, podman_counter: str, registry: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from .conftest import podman_logs, wait_numbers

    wait_numbers(lambda: podman_logs(podman_counter), 3)
    archive = tmp_path / "export.tar.zst"
    subprocess.run(["podman", "container", "checkpoint", "--export", str(archive), "--compress", "zstd", podman_counter],
                   check=True, capture_output=True)
    subprocess.run(["podman", "rm", "-f", "-t", "0", podman_counter], check=True, capture_output=True)
    # import PATH REF: into the local store, as any checkpoint of gpusnap's own.
    local = "localhost/gs-cli/imported:v1"
    out = json.loads(gs("import", str(archive), local, "--json").stdout)
    assert out["ref"] == local and out["layers"] >= 3
    info = gs.json("inspect", local)
    assert info["form"] == "podman-archive" and info["container"]["name"] == podman_counter  # type: ignore[index]
    assert info["engine"]["name"] == "podman"  # type: ignore[index]
    # push PATH REMOTE: stored under REMOTE first, then uploaded.
    remote = f"{registry}/gs-cli/imported:v1"
    proc = gs("push", str(archive), remote, "--insecure")
    assert proc.stdout.startswith(f"imported {archive} as {remote}\npushed {remote}")
    listed = {r["ref"]: r["digest"] for r in gs.json("ls")}  # type: ignore[union-attr,index]
    assert sorted(listed) == sorted([local, remote])
    assert gs.json("inspect", remote, "--insecure")["digest"] == listed[remote]  # type: ignore[index]
    # And it restores from the registry, through podman, going on from where it stopped.
    gs("rm", local, remote)
    restored = podman_counter + "-restored"
    gs("restore", remote, "--insecure", "--name", restored)
    before = max(wait_numbers(lambda: podman_logs(restored), 1))
    nums = wait_numbers(lambda: podman_logs(restored), 3 + before)
    assert max(nums) > before
    bad = gs("import", str(tmp_path / "nothing.tar"), "localhost/x:y", check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
