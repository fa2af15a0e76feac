"""runc used directly through gpusnap-runtime: run -d, checkpoint, restore (detached and foreground)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from shimstack import COUNTER, RUNC, SHIM, Pipes, Shim, assert_resumed, counter_values, make_bundle, run, unique, wait_counting, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]


def _run_then_checkpoint(rt: list[str], bundle: Path, cid: str, env: dict[str, str], pipes: Pipes, data_dir: Path, images: Path) -> int:
    """Start the counter detached, let it count, checkpoint it into ``images``; its last value."""
    subprocess.run([*rt, "run", "-d", "--bundle", str(bundle), cid], check=True, env=env, **pipes.kwargs())
    wait_counting(data_dir, above=2)
    run([*rt, "checkpoint", "--image-path", str(images), cid], env=env)
    return counter_values(data_dir)[-1]


def _gated_restore(rt: list[str], bundle: Path, images: Path, cid: str, env: dict[str, str], pipes: Pipes) -> tuple[subprocess.Popen[bytes], int]:
    """``restore -d`` through the shim as gpusnap's runc-direct engine starts it: with the read
    end of a gate pipe in GPUSNAP_RESTORE_GATE_FD. Returns the process and the write end."""
    gate_r, gate_w = os.pipe()
    try:
        proc = subprocess.Popen([*rt, "restore", "-d", "--bundle", str(bundle), "--image-path", str(images), cid],
                                env={**env, "GPUSNAP_RESTORE_GATE_FD": str(gate_r)}, pass_fds=(gate_r,), **pipes.kwargs())
    finally:
        os.close(gate_r)
    return proc, gate_w


def test_checkpoint_restore_detached_then_foreground(shim: Shim, data_dir: Path, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path, ["sh", "-c", COUNTER], data_dir)
    cid = unique("runc")
    rt = [str(shim.wrapper), "--root", str(bundle.root)]
    env = shim.env()
    pipes = [Pipes()]
    foreground: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run([*rt, "run", "-d", "--bundle", str(bundle.path), cid], check=True, env=env, **pipes[-1].kwargs())
        spec = json.loads((bundle.path / "config.json").read_text())
        conf = Path(spec["annotations"]["org.criu.config"])
        assert conf == shim.run_dir / "criu" / f"{cid}.conf" and "link-remap" in conf.read_text().split()
        wait_counting(data_dir, above=2)

        # Cycle 1: checkpoint, restore --detach.
        images = tmp_path / "images1"
        run([*rt, "checkpoint", "--image-path", str(images), cid], env=env)
        at_checkpoint = counter_values(data_dir)[-1]
        meta = json.loads((images / "gpusnap.json").read_text())
        assert meta["container_id"] == cid and meta["criu_version"].startswith("4.") and "runc checkpoint" in meta["timings_s"]
        pipes.append(Pipes())
        subprocess.run([*rt, "restore", "-d", "--bundle", str(bundle.path), "--image-path", str(images), cid], check=True, env=env, **pipes[-1].kwargs())
        assert json.loads(run([RUNC, "--root", str(bundle.root), "state", cid]).stdout)["status"] == "running"
        assert_resumed(data_dir, at_checkpoint)

        # Cycle 2: checkpoint, restore in the foreground (the shim waits for runc and keeps its status).
        images = tmp_path / "images2"
        run([*rt, "checkpoint", "--image-path", str(images), cid], env=env)
        at_checkpoint = counter_values(data_dir)[-1]
        pipes.append(Pipes())
        foreground = subprocess.Popen([*rt, "restore", "--bundle", str(bundle.path), "--image-path", str(images), cid], env=env, **pipes[-1].kwargs())
        assert_resumed(data_dir, at_checkpoint)
        assert foreground.poll() is None
        wait_for(lambda: not (shim.run_dir / "restoring" / cid).exists(), "the restore marker to go")
        run([RUNC, "--root", str(bundle.root), "kill", cid, "KILL"])
        assert foreground.wait(timeout=30) == 128 + signal.SIGKILL
    finally:
        if foreground is not None and foreground.poll() is None:
            foreground.kill()
        run([RUNC, "--root", str(bundle.root), "delete", "--force", cid], check=False)
        for p in pipes:
            p.close()


def test_run_foreground_exit_status_matches_runc(shim: Shim, data_dir: Path, tmp_path: Path) -> None:
    statuses = {}
    for label, binary in (("runc", RUNC), ("shim", str(shim.wrapper))):
        bundle = make_bundle(tmp_path / label, ["sh", "-c", "echo out; echo err >&2; exit 3"], data_dir)
        proc = run([binary, "--root", str(bundle.root), "run", "--bundle", str(bundle.path), unique("exit3")], check=False, env=shim.env())
        statuses[label] = (proc.returncode, proc.stdout, proc.stderr)
    assert statuses["shim"] == statuses["runc"] == (3, "out\n", "err\n")


def test_shim_as_runc_on_path_finds_the_real_runc(shim: Shim, tmp_path: Path) -> None:
    """Installed as `runc` ahead of the real one, the shim skips itself on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "runc").symlink_to(SHIM)
    env = {**shim.env(), "PATH": f"{bin_dir}:{shim.env()['PATH']}"}
    proc = run([str(bin_dir / "runc"), "--version"], env=env)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gpusnap-runtime version ") and lines[1].startswith("runc version ")


def test_preserved_fds_and_signals_reach_the_container(shim: Shim, data_dir: Path, tmp_path: Path) -> None:
    """--preserve-fds hands fd 3 through create's exec; SIGTERM to the shim's pid reaches the container."""
    script = "echo via-fd3 >&3; trap 'exit 7' TERM; echo ready; while true; do sleep 0.1; done"
    results = {}
    for label, binary in (("runc", RUNC), ("shim", str(shim.wrapper))):
        bundle = make_bundle(tmp_path / label, ["sh", "-c", script], data_dir)
        extra_r, extra_w = os.pipe()
        # The preserved fd must be fd 3 in the runtime: bash puts the pipe there (dash takes single-digit fds only).
        proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3>&{extra_w}', binary, "--root", str(bundle.root), "run", "--preserve-fds", "1", "--bundle", str(bundle.path), unique("fds")],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(extra_w,), env=shim.env(),
        )
        os.close(extra_w)
        try:
            with os.fdopen(extra_r) as extra:
                via_fd = extra.readline()  # runc keeps its own copy open: no EOF to wait for
            assert proc.stdout is not None
            ready = proc.stdout.readline()
            proc.send_signal(signal.SIGTERM)
            results[label] = (via_fd, ready, proc.wait(timeout=30))
        finally:
            if proc.poll() is None:
                proc.kill()
    assert results["shim"] == results["runc"] == ("via-fd3\n", b"ready\n", 7)


def test_criu_env_annotation_reaches_criu_at_checkpoint_and_restore(shim: Shim, data_dir: Path, tmp_path: Path) -> None:
    """KFD_* from gpusnap.io/criu-env are in the environment of the CRIU that runc starts (the
    amdgpu plugin reads them there); a CRIU wrapper records what it was given."""
    import shutil

    real_criu = shutil.which("criu", path=shim.env()["PATH"])
    assert real_criu is not None
    seen = tmp_path / "criu-env"
    seen.mkdir()
    wrapper = tmp_path / "criu-bin" / "criu"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = swrk ] && env | grep "^KFD_" | sort > {seen}/$$\nexec {real_criu} "$@"\n')
    wrapper.chmod(0o755)
    bundle = make_bundle(tmp_path, ["sh", "-c", COUNTER], data_dir)
    spec = json.loads((bundle.path / "config.json").read_text())
    spec.setdefault("annotations", {})["gpusnap.io/criu-env"] = json.dumps({"KFD_FW_VER_CHECK": "0", "KFD_NUMA_CHECK": "0"})
    (bundle.path / "config.json").write_text(json.dumps(spec))
    cid = unique("kfd")
    rt = [str(shim.wrapper), "--root", str(bundle.root)]
    env = {**shim.env(), "GPUSNAP_CRIU": str(wrapper)}
    pipes = [Pipes()]
    try:
        images = tmp_path / "images"
        at_checkpoint = _run_then_checkpoint(rt, bundle.path, cid, env, pipes[-1], data_dir, images)
        dumps = {p.read_text() for p in seen.iterdir()}
        assert dumps == {"KFD_FW_VER_CHECK=0\nKFD_NUMA_CHECK=0\n"}
        for p in seen.iterdir():
            p.unlink()
        pipes.append(Pipes())
        subprocess.run([*rt, "restore", "-d", "--bundle", str(bundle.path), "--image-path", str(images), cid], check=True, env=env, **pipes[-1].kwargs())
        assert_resumed(data_dir, at_checkpoint)
        assert {p.read_text() for p in seen.iterdir()} == {"KFD_FW_VER_CHECK=0\nKFD_NUMA_CHECK=0\n"}
    finally:
        run([RUNC, "--root", str(bundle.root), "delete", "--force", cid], check=False)
        for p in pipes:
            p.close()


def test_criu_env_annotation_with_other_names_is_refused(shim: Shim, data_dir: Path, tmp_path: Path) -> None:
    """An annotation that would set LD_PRELOAD for runc and CRIU: refused at create (exit 2, one
    line), so no container ever holds it; the checkpoint-time check stays for older containers."""
    bundle = make_bundle(tmp_path, ["sh", "-c", COUNTER], data_dir)
    spec = json.loads((bundle.path / "config.json").read_text())
    spec.setdefault("annotations", {})["gpusnap.io/criu-env"] = json.dumps({"LD_PRELOAD": "/tmp/evil.so"})
    (bundle.path / "config.json").write_text(json.dumps(spec))
    before = (bundle.path / "config.json").read_bytes()
    cid = unique("kfdbad")
    rt = [str(shim.wrapper), "--root", str(bundle.root)]
    try:
        proc = run([*rt, "run", "-d", "--bundle", str(bundle.path), cid], check=False, env=shim.env(), stdin=subprocess.DEVNULL)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "may set only KFD_*" in proc.stderr, proc.stderr
        assert (bundle.path / "config.json").read_bytes() == before
        assert run([RUNC, "--root", str(bundle.root), "state", cid], check=False).returncode != 0
    finally:
        run([RUNC, "--root", str(bundle.root), "delete", "--force", cid], check=False)


def test_restore_waits_at_the_gate_and_a_caller_gone_leaves_nothing(shim: Shim, data_dir: Path, tmp_path: Path) -> None:
    """GPUSNAP_RESTORE_GATE_FD (gpusnap's runc-direct engine starts the runtime's restore before
    the root filesystem and images are complete): the runtime waits on that pipe just before
    runc. The pipe closed with no "ok" (the engine killed) stops the restore: no container, no
    marker, config.json as it was; "ok" restores and the container counts on."""
    bundle = make_bundle(tmp_path, ["sh", "-c", COUNTER], data_dir)
    cid = unique("gate")
    rt = [str(shim.wrapper), "--root", str(bundle.root)]
    env = shim.env()
    pipes = [Pipes()]
    try:
        images = tmp_path / "images"
        at_checkpoint = _run_then_checkpoint(rt, bundle.path, cid, env, pipes[-1], data_dir, images)
        spec_before = (bundle.path / "config.json").read_text()
        marker = shim.run_dir / "restoring" / cid
        for word in (None, b"ok\n"):
            pipes.append(Pipes())
            proc, gate_w = _gated_restore(rt, bundle.path, images, cid, env, pipes[-1])
            wait_for(lambda: marker.exists(), "the runtime to reach the gate (its restore marker)")
            assert proc.poll() is None  # waiting: runc has not run
            assert run([RUNC, "--root", str(bundle.root), "state", cid], check=False).returncode != 0
            if word is not None:
                os.write(gate_w, word)
            os.close(gate_w)
            rc = proc.wait(timeout=120)
            if word is None:
                assert rc == 7 and not marker.exists()  # exit 7: restore failed, nothing half-restored
                assert run([RUNC, "--root", str(bundle.root), "state", cid], check=False).returncode != 0
                assert (bundle.path / "config.json").read_text() == spec_before
            else:
                assert rc == 0 and json.loads(run([RUNC, "--root", str(bundle.root), "state", cid]).stdout)["status"] == "running"
                assert_resumed(data_dir, at_checkpoint)
                steps = json.loads((images / "gpusnap-restore.json").read_text())["steps_s"]
                assert "wait for the root filesystem and images" in steps and "runc restore" in steps
    finally:
        run([RUNC, "--root", str(bundle.root), "delete", "--force", cid], check=False)
        for p in pipes:
            p.close()


def _hold_scripts_running(hold: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(hold).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("last_word", [b"pages\n", b"stop\n", None])
def test_criu_is_held_before_the_memory_pages_until_they_are_whole(shim: Shim, data_dir: Path, tmp_path: Path, last_word: bytes | None) -> None:
    """"rootfs" on the gate lets runc and CRIU start while the pages files are still being
    written; CRIU waits at setup-namespaces (gpusnap.checkpoint.pages_hold). Shown with the
    real runc and CRIU: the pages files are not even in the image directory when CRIU starts
    (CRIU would fail without them) and are put back only while it waits; "pages" then restores
    the counter, "stop" fails the restore with nothing left and CRIU's config as before; the
    runtime killed (-9) while CRIU waits fails CRIU's restore too (the script reads end of
    file) and leaves no container and no waiting script."""
    bundle = make_bundle(tmp_path, ["sh", "-c", COUNTER], data_dir)
    cid = unique("hold")
    rt = [str(shim.wrapper), "--root", str(bundle.root)]
    env = shim.env()
    pipes = [Pipes()]
    try:
        images = tmp_path / "images"
        at_checkpoint = _run_then_checkpoint(rt, bundle.path, cid, env, pipes[-1], data_dir, images)
        aside = tmp_path / "pages-aside"
        aside.mkdir()
        pages = sorted(images.glob("pages-*.img"))
        assert pages
        for p in pages:
            p.rename(aside / p.name)
        conf = shim.run_dir / "criu" / f"{cid}.conf"
        hold = shim.run_dir / "restore-pages"
        pipes.append(Pipes())
        proc, gate_w = _gated_restore(rt, bundle.path, images, cid, env, pipes[-1])
        try:
            os.write(gate_w, b"rootfs\n")
            wait_for(lambda: (hold / f"{cid}.waiting").exists() or proc.poll() is not None, "CRIU to reach the hold", timeout=120)
            assert proc.poll() is None, "the restore ended before CRIU reached the hold"
            assert f"action-script {hold / (cid + '.sh')}" in conf.read_text()
            time.sleep(0.3)
            assert proc.poll() is None  # CRIU still waits
            for p in pages:
                (aside / p.name).rename(p)
            if last_word is None:
                proc.kill()
            else:
                os.write(gate_w, last_word)
        finally:
            os.close(gate_w)
        rc = proc.wait(timeout=120)
        if last_word is None:
            wait_for(lambda: not _hold_scripts_running(hold), "CRIU's hold script to end once the runtime was killed", timeout=60)
            wait_for(lambda: run([RUNC, "--root", str(bundle.root), "state", cid], check=False).returncode != 0,
                     "runc to remove what CRIU had restored", timeout=60)
            return  # its CRIU config keeps the line until the next create or restore rewrites it
        assert "action-script" not in conf.read_text() and not any(hold.iterdir())
        if last_word == b"pages\n":
            assert rc == 0 and json.loads(run([RUNC, "--root", str(bundle.root), "state", cid]).stdout)["status"] == "running"
            assert_resumed(data_dir, at_checkpoint)
            held = json.loads((images / "gpusnap-restore.json").read_text())["pages_hold_s"]
            assert held["CRIU waited for the pages"] >= 0.3
        else:
            assert rc != 0 and not (shim.run_dir / "restoring" / cid).exists()
            assert run([RUNC, "--root", str(bundle.root), "state", cid], check=False).returncode != 0
    finally:
        run([RUNC, "--root", str(bundle.root), "delete", "--force", cid], check=False)
        for p in pipes:
            p.close()
