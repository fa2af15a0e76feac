"""CRIU held before the memory pages (gpusnap.checkpoint.pages_hold): the gate's words, the
action script run by a real /bin/sh as CRIU runs it, and the runtime's steps around runc.

The real CRIU running the script inside a real restore is in
tests/integration/runtime_shim/test_shim_runc_direct.py."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from gpusnap.checkpoint.pages_hold import Gate, PagesHold, criu_can_hold, hold_dir
from gpusnap.checkpoint.runtime_steps import GATE_STEP, HOLD_STEP, RELEASE_STEP, gate_steps
from gpusnap.config import HostPaths, Settings
from gpusnap.criu.locate import CriuInfo
from gpusnap.errors import RestoreError
from gpusnap.gpu.base import ContainerRef

CONFIG = b"# written by gpusnap-runtime\nlink-remap\n"


def _gate(*words: bytes, close: bool = True) -> tuple[Gate, int]:
    r, w = os.pipe()
    for word in words:
        os.write(w, word + b"\n")
    if close:
        os.close(w)
        w = -1
    return Gate(str(r), "GPUSNAP_RESTORE_GATE_FD"), w


def _criu_action(hold: PagesHold, action: str) -> subprocess.Popen[str]:
    # As CRIU runs an action script: its path alone, the action in the environment.
    return subprocess.Popen([str(hold.script)], env={"PATH": os.environ["PATH"], "CRTOOLS_SCRIPT_ACTION": action},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _hold(tmp_path: Path, *words: bytes) -> tuple[PagesHold, Path, int]:
    config = tmp_path / "criu" / "c1.conf"
    config.parent.mkdir()
    config.write_bytes(CONFIG)
    gate, w = _gate(b"rootfs", *words, close=False)
    gate.wait_first()
    assert gate.pages_pending
    return PagesHold(gate, config, hold_dir(tmp_path / "run"), "c1"), config, w


def _wait(predicate: object, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_gate_words() -> None:
    gate, _ = _gate(b"ok")
    assert not os.get_inheritable(gate.fd)  # runc, CRIU and the container never get it
    gate.wait_first()
    assert not gate.pages_pending
    assert gate.fd == -1  # closed once its last word is read
    gate, _ = _gate(b"rootfs", b"pages")
    gate.wait_first()
    assert gate.pages_pending and gate.wait_pages() and gate.fd == -1
    gate, _ = _gate(b"rootfs", b"stop")
    gate.wait_first()
    assert not gate.wait_pages()
    gate, _ = _gate(b"rootfs")  # the caller gone after the first word
    gate.wait_first()
    assert not gate.wait_pages()
    for words in ((b"stop",), ()):
        gate, _ = _gate(*words)
        with pytest.raises(RestoreError, match="stopped the restore before runc ran"):
            gate.wait_first()
    with pytest.raises(RestoreError, match="is not a file descriptor; unset it"):
        Gate("seven", "GPUSNAP_RESTORE_GATE_FD")
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(RestoreError, match="cannot read the restore's go-ahead"):
        Gate(str(r), "GPUSNAP_RESTORE_GATE_FD")


def test_only_criu_3_19_on_runs_a_config_files_scripts_under_runc() -> None:
    assert criu_can_hold((3, 19, 0)) and criu_can_hold((4, 1, 1)) and not criu_can_hold((3, 18, 9))


def test_criu_waits_at_setup_namespaces_until_the_pages_are_whole(tmp_path: Path) -> None:
    hold, config, w = _hold(tmp_path)
    hold.install()
    try:
        assert config.read_bytes() == CONFIG + f"action-script {hold.script}\n".encode()
        assert (os.stat(hold.directory).st_mode & 0o777) == 0o700
        for action in ("pre-restore", "network-lock"):  # any other action passes at once
            assert _criu_action(hold, action).wait(timeout=10) == 0
        criu = _criu_action(hold, "setup-namespaces")
        _wait(hold.waiting.exists, "the script to start waiting")
        time.sleep(0.2)
        assert criu.poll() is None  # held
        os.write(w, b"pages\n")
        assert criu.wait(timeout=10) == 0 and hold.passed.exists()
        # CRIU 4.x under runc lists a config file's script twice: the second run must not wait
        assert _criu_action(hold, "setup-namespaces").wait(timeout=10) == 0
        assert _criu_action(hold, "pre-resume").wait(timeout=10) == 0
        assert hold.timings["CRIU waited for the pages"] >= 0.15
        assert hold.timings["pages whole, after runc was let go"] >= 0.15
    finally:
        os.close(w)
        hold.release()
    assert config.read_bytes() == CONFIG  # put back as it was
    assert not any(hold.directory.iterdir())


@pytest.mark.parametrize("end", ["stop", "caller gone", "restore ended"])
def test_criu_stops_when_the_pages_never_come(tmp_path: Path, end: str) -> None:
    hold, config, w = _hold(tmp_path)
    hold.install()
    try:
        criu = _criu_action(hold, "setup-namespaces")
        _wait(hold.waiting.exists, "the script to start waiting")
        if end == "stop":
            os.write(w, b"stop\n")
        elif end == "caller gone":
            os.close(w)
            w = -1
        else:
            hold.release()  # runc failed elsewhere: the runtime undoes the hold; the script reads EOF
        _, err = criu.communicate(timeout=10)
        assert criu.returncode == 1 and err.count("\n") == 1 and "memory pages could not be made ready" in err
        assert not hold.passed.exists()
        if end != "restore ended":  # (then the script is gone, and CRIU's exec of it fails)
            # CRIU runs its second listing of the script too: it fails at once rather than wait
            assert _criu_action(hold, "setup-namespaces").wait(timeout=10) == 1
    finally:
        if w >= 0:
            os.close(w)
        hold.release()
    assert config.read_bytes() == CONFIG


def test_a_restore_that_skipped_the_hold_never_resumes(tmp_path: Path) -> None:
    hold, _, w = _hold(tmp_path)
    hold.install()
    try:
        criu = _criu_action(hold, "pre-resume")
        _, err = criu.communicate(timeout=10)
        assert criu.returncode == 1 and "without waiting for the memory pages" in err
    finally:
        os.close(w)
        hold.release()


def test_a_killed_restores_leftovers_go_before_the_next_hold(tmp_path: Path) -> None:
    hold, config, w = _hold(tmp_path, b"pages")
    hold.directory.mkdir(parents=True)
    hold.passed.write_text("")  # a killed restore's: must not let the next one skip its wait
    os.mkfifo(hold.fifo)
    hold.install()
    try:
        assert not hold.passed.exists()
    finally:
        os.close(w)
        hold.release()


# ---- the runtime's steps around runc -------------------------------------------------------------

def _steps(tmp_path: Path, words: tuple[bytes, ...], *, version: tuple[int, int, int] = (4, 1, 1), managed: bool = True,
           ) -> tuple[list, list, dict[str, float], Path]:
    run_dir = tmp_path / "run"
    config = run_dir / "criu" / "c1.conf"
    config.parent.mkdir(parents=True)
    config.write_bytes(CONFIG)
    settings = Settings(host=HostPaths(tmp_path / "host"), run_dir=run_dir)
    ref = ContainerRef(container_id="c1", init_pid=0, bundle=tmp_path / "bundle")
    gate, _ = _gate(*words)
    timings: dict[str, float] = {}
    before, after = gate_steps(str(gate.fd), settings, CriuInfo("/usr/sbin/criu", version), ref, timings)
    # the restored spec is read after the steps are made, before they run
    ref.annotations = {"org.criu.config": str(config), "gpusnap.io/criu-config": "true"} if managed else {"org.criu.config": "/etc/criu/admin.conf"}
    return before, after, timings, config


def test_the_runtime_holds_criu_only_when_the_pages_are_still_coming(tmp_path: Path) -> None:
    before, after, timings, config = _steps(tmp_path, (b"ok",))
    assert [s.name for s in before] == [GATE_STEP, HOLD_STEP] and [s.name for s in after] == [RELEASE_STEP]
    for s in before:
        s.do()
    assert config.read_bytes() == CONFIG and not timings  # nothing to hold


def test_the_runtime_adds_the_hold_to_criu_config_and_takes_it_away(tmp_path: Path) -> None:
    before, after, timings, config = _steps(tmp_path, (b"rootfs",))
    for s in before:
        s.do()
    assert b"action-script " in config.read_bytes()
    after[0].do()
    assert config.read_bytes() == CONFIG
    before[1].undo()  # idempotent: a failed runc restore undoes it again
    assert config.read_bytes() == CONFIG


@pytest.mark.parametrize("why", ["old CRIU", "admin's own CRIU config"])
def test_where_criu_cannot_be_held_the_runtime_waits_for_the_pages_before_runc(tmp_path: Path, why: str) -> None:
    kwargs = {"version": (3, 18, 0)} if why == "old CRIU" else {"managed": False}
    before, _, timings, config = _steps(tmp_path, (b"rootfs", b"pages"), **kwargs)
    for s in before:
        s.do()
    assert config.read_bytes() == CONFIG and "pages whole, waited for before runc" in timings
    before, _, _, _ = _steps(tmp_path / "stop", (b"rootfs", b"stop"), **kwargs)
    before[0].do()
    with pytest.raises(RestoreError, match="memory pages could not be made ready"):
        before[1].do()


def test_a_hold_that_cannot_be_installed_leaves_nothing(tmp_path: Path) -> None:
    hold, config, w = _hold(tmp_path)
    config.unlink()  # its bundle went away: the config cannot be read
    with pytest.raises(FileNotFoundError):
        hold.install()
    os.close(w)
    assert not any(hold.directory.iterdir()) and hold._fd == -1
