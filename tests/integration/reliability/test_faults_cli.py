"""kill -9 of `gpusnap checkpoint` (runc-direct engine, real CRIU, a real docker-registry) in the
store and in the push, with and without a registry that stalls the uploads. The checkpoint
stopped the container, so its images in the killed run's work dir may be its only copy: the
next gpusnap run (here `gpusnap ls`) stores them if the tag had not landed, says so in one line,
and removes the work dir; the checkpoint then verifies, restores (the counter goes on where it
stopped) and pushes again. 0 lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "reliability"))
from hostile_http import HostileServer, Reply, Seen  # noqa: E402
from stack.registry import REL_PORTS, Registry  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runc"), reason="needs root and runc")]
GPUSNAP = str(Path(sys.executable).parent / "gpusnap")
COUNTER = "i=0; while true; do echo $i; i=$((i+1)); sleep 0.3; done"
# 48 MB of incompressible memory: a store and a push long enough to be killed in.
BIG = "x=$(head -c 36000000 /dev/urandom | base64); " + COUNTER
STALL_PORT = 5355


def _env(root: Path) -> dict[str, str]:
    """gpusnap's environment for one test: its own run, state and store dirs under ``root``."""
    return {**os.environ, "GPUSNAP_RUN_DIR": str(root / "run"), "GPUSNAP_STATE_DIR": str(root / "state"),
            "GPUSNAP_STORE": str(root / "store"), "GPUSNAP_CONFIG": str(root / "none.toml"), "COLUMNS": "100"}


def _stalling(stalled: threading.Event, release: threading.Event, final: Reply):  # type: ignore[no-untyped-def]
    """A registry script that answers the API check and HEADs, then holds every upload (setting
    ``stalled``) until ``release``, and answers it with ``final``."""

    def stall(method: str, path: str, h: dict[str, str]) -> Reply:
        if path == "/v2/":
            return Reply(200, {}, b"{}")
        if method == "HEAD":
            return Reply(404)
        stalled.set()  # an upload: hold it until the client is dead
        release.wait(60)
        return final

    return stall


def _gs(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUSNAP, *args], capture_output=True, text=True, env=env, timeout=timeout)


def _numbers(env: dict[str, str], name: str) -> list[int]:
    return [int(x) for x in _gs(env, "logs", name).stdout.split() if x.isdigit()]


def _wait(pred, timeout: float = 60) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def _record(root: Path, pid: int) -> dict[str, object]:
    for rec in (root / "state" / "tmp").glob(f"work-{pid}-*/gpusnap-work.json"):
        try:
            return dict(json.loads(rec.read_text()))
        except ValueError:
            pass  # being replaced (the owner writes it atomically, but a read may race the rename)
    return {}


def _tags(root: Path) -> list[str]:
    """The local store's tags, read from its index without running gpusnap (which would recover)."""
    index = root / "store" / "index.json"
    if not index.is_file():
        return []
    return [m["annotations"]["org.opencontainers.image.ref.name"] for m in json.loads(index.read_text()).get("manifests", [])
            if "org.opencontainers.image.ref.name" in (m.get("annotations") or {})]


def _verify_and_restore(env: dict[str, str], stored: str, restored: str, last: int) -> None:
    """The recovered checkpoint verifies, and restored as ``restored`` its counter goes on from
    the number after ``last``, the last one the checkpointed container printed."""
    v = _gs(env, "verify")
    assert v.returncode == 0, v.stdout + v.stderr
    r = _gs(env, "restore", stored, "--name", restored)
    assert r.returncode == 0, r.stderr
    assert _wait(lambda: any(n > last for n in _numbers(env, restored))), "the restored counter does not go on"
    after = _numbers(env, restored)
    assert last + 1 in after, (last, after)


# (id, where the kill lands, whether a registry stalls every upload)
CASES = [
    ("store", "store", False),
    ("store-stalled-registry", "store", True),
    ("push-stalled-registry", "push", True),
    ("push-registry", "push", False),
]


@pytest.mark.parametrize(("stage", "stalled_registry"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kill9_cli_checkpoint(tmp_path: Path, ledger, stage: str, stalled_registry: bool) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "gs"
    env = _env(root)
    name = f"gs-rel-cli-{uuid.uuid4().hex[:6]}"
    stalled = threading.Event()
    release = threading.Event()
    log: list[Seen] = []

    stall = _stalling(stalled, release, Reply(500))
    reg = Registry(tmp_path / "registry", REL_PORTS).start()
    ref = f"127.0.0.1:{STALL_PORT}/gs-rel/stall:v1" if stalled_registry else f"{reg.host}/gs-rel/kill:v1"
    push = [] if stage == "store" and not stalled_registry else ["--push", ref, "--insecure"]
    held = 0
    try:
        with HostileServer("stall", "127.0.0.1", STALL_PORT, log) as server:
            server.script = stall
            assert _gs(env, "run", name, "--", "sh", "-c", BIG).returncode == 0
            assert _wait(lambda: len(_numbers(env, name)) >= 4)
            proc = subprocess.Popen([GPUSNAP, "checkpoint", name, *push], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            # The kill lands in the store (images dumped and described, no tag yet) or in the
            # push (tagged). The record the run keeps in its work dir says which.
            want = ("described",) if stage == "store" else ("stored",)
            if stalled_registry:
                assert stalled.wait(120), "the push never reached the registry"
            deadline = time.monotonic() + 120
            while _record(root, proc.pid).get("stage") not in want and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)  # the store of 48 MB takes a fraction of a second
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL, "the checkpoint finished before the kill: this case proves nothing"
            release.set()
        at_kill = str(_record(root, proc.pid).get("stage"))
        tagged = _tags(root)
        if stage == "store":
            assert at_kill == "described", at_kill
        else:
            assert at_kill == "stored" and len(tagged) == 1, (at_kill, tagged)
        # What the killed run left: its work dir, with the CRIU images (plain memory) in it.
        debris = list((root / "state" / "tmp").glob(f"work-{proc.pid}-*"))
        assert debris, "expected the killed run's work dir (else this test proves nothing about it)"
        last = _numbers(env, name)[-1]
        # The next gpusnap run stores it if the tag had not landed, and says so on stderr.
        ls = _gs(env, "ls", "--json")
        assert ls.returncode == 0, ls.stderr
        rows = json.loads(ls.stdout)
        assert len(rows) == 1, rows
        stored = rows[0]["ref"]
        notes = [line for line in ls.stderr.splitlines() if line.startswith("gpusnap:")]
        if not tagged:
            assert len(notes) == 1 and f"gpusnap restore {stored}" in notes[0], ls.stderr
        elif push:
            assert len(notes) == 1 and f"gpusnap push {stored} {ref}" in notes[0], ls.stderr
        if push and not stalled_registry:
            assert stored == ref
        assert not any(d.exists() for d in debris), "the recovered work dir must go once its checkpoint is stored"
        _verify_and_restore(env, stored, name + "-r", last)
        p = _gs(env, "push", stored, f"{reg.host}/gs-rel/retry:v1", "--insecure")
        assert p.returncode == 0, p.stderr
        assert reg.has_tag("gs-rel/retry", "v1")
        held = 1
    finally:
        for n in (name, name + "-r"):
            _gs(env, "delete", n)
        reg.kill()
        ledger.record("fault", f"kill -9 `gpusnap checkpoint` in the {stage}" + (" (registry stalls)" if stalled_registry else ""),
                      passed=held,
                      detail=("the next run stored the killed run's images" if stage == "store" else
                              "tagged before the kill; the next run removed the work dir and said how to push")
                      + "; restored from the local store; pushed again")


def test_a_live_checkpoint_is_spared_and_a_failed_push_rolls_back(tmp_path: Path, ledger) -> None:  # type: ignore[no-untyped-def]
    """While `gpusnap checkpoint --push` waits on a stalled registry (stored, tagged, the
    container stopped), other gpusnap runs leave its work dir alone; when the registry then
    fails the upload, the checkpoint rolls back: the container runs again, no tag is left."""
    root = tmp_path / "gs"
    env = _env(root)
    name = f"gs-rel-cli-{uuid.uuid4().hex[:6]}"
    stalled = threading.Event()
    release = threading.Event()
    log: list[Seen] = []

    stall = _stalling(stalled, release, Reply(400, {"Content-Type": "application/json"}, b'{"errors":[{"code":"DENIED","message":"no"}]}'))
    ref = f"127.0.0.1:{STALL_PORT}/gs-rel/live:v1"
    held = 0
    try:
        with HostileServer("stall", "127.0.0.1", STALL_PORT, log) as server:
            server.script = stall
            assert _gs(env, "run", name, "--", "sh", "-c", COUNTER).returncode == 0
            assert _wait(lambda: len(_numbers(env, name)) >= 4)
            proc = subprocess.Popen([GPUSNAP, "checkpoint", name, "--push", ref, "--insecure"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            assert stalled.wait(120), "the push never reached the registry"
            assert _wait(lambda: _record(root, proc.pid).get("stage") == "stored", 60), _record(root, proc.pid)
            live = list((root / "state" / "tmp").glob(f"work-{proc.pid}-*"))
            assert len(live) == 1
            # Two other runs meanwhile: neither stores, removes nor mentions the live one.
            others = [subprocess.Popen([GPUSNAP, "ls", "--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                      for _ in range(2)]
            for o in others:
                out, err = o.communicate(timeout=120)
                assert o.returncode == 0, err
                assert "gpusnap:" not in err, err
                assert [r["ref"] for r in json.loads(out)] == [ref]  # the tag landed while the registry stalls
            assert live[0].is_dir() and (live[0] / "checkpoint").is_dir()
            release.set()
            _, err = proc.communicate(timeout=300)
        # The registry's refusal (exit 8), rolled back.
        assert proc.returncode == 8 and "rolled back: store the checkpoint, checkpoint" in err, (proc.returncode, err)
        assert not live[0].exists()
        assert json.loads(_gs(env, "ls", "--json").stdout) == []
        last = _numbers(env, name)[-1]
        assert _wait(lambda: _numbers(env, name)[-1] > last), "the container does not run again"
        held = 1
    finally:
        _gs(env, "delete", name)
        ledger.record("fault", "registry refuses the upload of a stop-the-container checkpoint --push", passed=held,
                      detail="other runs spared the live work dir; rolled back: container running, no tag")


@pytest.mark.parametrize("overlay", [False, True], ids=["busybox-root", "overlay-root"])
def test_kill9_cli_checkpoint_while_criu_dumps(tmp_path: Path, ledger, overlay: bool) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of `gpusnap checkpoint` while CRIU dumps a container the checkpoint stops: runc and
    CRIU finish without it, so the container is gone and the killed run's work dir holds its only
    copy, short of what runc-direct adds after a dump (the overlay's writable layer). `gpusnap
    doctor` shows it; the next run finishes the engine's part, stores it and says so; it restores
    and the counter goes on."""
    root = tmp_path / "gs"
    env = _env(root)
    name = f"gs-rel-dump-{uuid.uuid4().hex[:6]}"
    held = 0
    try:
        assert _gs(env, "run", name, *(["--rootfs-overlay", "/"] if overlay else []), "--", "sh", "-c", BIG).returncode == 0
        assert _wait(lambda: len(_numbers(env, name)) >= 4)
        proc = subprocess.Popen([GPUSNAP, "checkpoint", name], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        image = None
        while proc.poll() is None and time.monotonic() < deadline:
            rec = _record(root, proc.pid)
            if rec.get("stage") == "started" and (Path(str(rec.get("checkpoint"))) / "inventory.img").exists():
                image = Path(str(rec["checkpoint"]))  # CRIU has begun: it writes the inventory first
                break
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL and image is not None, "the kill did not land while CRIU dumped"
        assert _record(root, proc.pid).get("stage") == "started"
        # runc and CRIU go on without gpusnap: the dump ends (CRIU's stats-dump), runc exits.
        assert _wait(lambda: (image / "stats-dump").exists(), 120), "the dump did not finish after the kill"
        assert _wait(lambda: subprocess.run(["pgrep", "-f", str(image)], capture_output=True).returncode != 0, 60)
        if overlay:
            assert not (image / "rootfs-upper.tar").exists()  # what gpusnap adds after the dump: not there yet
        last = _numbers(env, name)[-1]
        doctor = json.loads(_gs(env, "doctor", "--json").stdout)
        rows = doctor if isinstance(doctor, list) else doctor.get("checks", [])
        work_rows = [r for r in rows if r["name"] == "work dirs"]
        assert any(r["status"] == "warn" and name in r["detail"] and "checkpoint or restore" in r["fix"] for r in work_rows), work_rows
        ls = _gs(env, "ls", "--json")
        assert ls.returncode == 0, ls.stderr
        listed = json.loads(ls.stdout)
        assert len(listed) == 1, (listed, ls.stderr)
        stored = listed[0]["ref"]
        notes = [line for line in ls.stderr.splitlines() if line.startswith("gpusnap:")]
        assert len(notes) == 1 and f"gpusnap restore {stored}" in notes[0], ls.stderr
        assert not list((root / "state" / "tmp").glob(f"work-{proc.pid}-*")), "the recovered work dir must go once stored"
        _verify_and_restore(env, stored, name + "-r", last)
        held = 1
    finally:
        for n in (name, name + "-r"):
            _gs(env, "delete", n)
        ledger.record("fault", f"kill -9 `gpusnap checkpoint` while CRIU dumps ({'overlay' if overlay else 'busybox'} root)",
                      passed=held, detail="runc and CRIU finished without it; doctor showed the work dir; the next run finished the "
                                          "engine's part, stored it and said so; restored, the counter went on")
