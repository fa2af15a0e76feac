"""kill -9 of `gpusnap checkpoint --push` while it pushes (runc-direct engine, real CRIU): the
checkpoint was stored before the push, so the container is restorable from the local store, the
store verifies, and pushing it again succeeds."""

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
STALL_PORT = 5355


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


def test_kill9_cli_checkpoint_during_push(tmp_path: Path, ledger) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "gs"
    env = {**os.environ, "GPUSNAP_RUN_DIR": str(root / "run"), "GPUSNAP_STATE_DIR": str(root / "state"),
           "GPUSNAP_STORE": str(root / "store"), "GPUSNAP_CONFIG": str(root / "none.toml"), "COLUMNS": "100"}
    name = f"gs-rel-cli-{uuid.uuid4().hex[:6]}"
    stalled = threading.Event()
    release = threading.Event()
    log: list[Seen] = []

    def stall(method: str, path: str, h: dict[str, str]) -> Reply:
        if path == "/v2/":
            return Reply(200, {}, b"{}")
        if method == "HEAD":
            return Reply(404)
        stalled.set()  # the first upload: hold it until the client is dead
        release.wait(60)
        return Reply(500)

    ref = f"127.0.0.1:{STALL_PORT}/gs-rel/stall:v1"
    reg = Registry(tmp_path / "registry", REL_PORTS).start()
    try:
        with HostileServer("stall", "127.0.0.1", STALL_PORT, log) as server:
            server.script = stall
            assert _gs(env, "run", name, "--", "sh", "-c", COUNTER).returncode == 0
            assert _wait(lambda: len(_numbers(env, name)) >= 4)
            proc = subprocess.Popen([GPUSNAP, "checkpoint", name, "--push", ref, "--insecure"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            assert stalled.wait(120), "the push never reached the registry"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            release.set()
        # What the killed run left: its work dir, with the CRIU images (plain memory) in it.
        debris = list((root / "state" / "tmp").glob(f"work-{proc.pid}-*"))
        assert debris, "expected the killed run's work dir (else this test proves nothing about its cleanup)"
        last = _numbers(env, name)[-1]
        # The checkpoint was stored before the push began: it is there, whole, under its tag.
        rows = json.loads(_gs(env, "ls", "--json").stdout)
        assert [r["ref"] for r in rows] == [ref], rows
        v = _gs(env, "verify")
        assert v.returncode == 0, v.stdout + v.stderr
        restored = name + "-r"
        r = _gs(env, "restore", ref, "--name", restored)
        assert r.returncode == 0, r.stderr
        assert not any(d.exists() for d in debris), "the next gpusnap run must remove a dead run's work dir"
        assert _wait(lambda: any(n > last for n in _numbers(env, restored))), "the restored counter does not go on"
        after = _numbers(env, restored)
        assert last + 1 in after, (last, after)
        p = _gs(env, "push", ref, f"{reg.host}/gs-rel/retry:v1", "--insecure")
        assert p.returncode == 0, p.stderr
        assert reg.has_tag("gs-rel/retry", "v1")
        held = True
    finally:
        for n in (name, name + "-r"):
            _gs(env, "delete", n)
        reg.kill()
    ledger.record("fault", "kill -9 `gpusnap checkpoint --push` mid-push", passed=int(held),
                  detail="restored from the local store; push retried; dead run's work dir removed")
