"""Faults in a lazy restore (docs/runtime.md, "Lazy pages"): the page server killed while it
fills the restored process's memory, alone or with the ``gpusnap restore`` waiting for it. No
path may leave a process running on zeros unnoticed, and the checkpoint must stay whole."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from integration.cli.conftest import gs  # noqa: E402,F401 (fixture; tests/ is on sys.path: this directory's conftest)
from integration.cli.test_lazy_pages import Gs, checkpointed_big, lazy_gs, servers, wait_lines  # noqa: F401 (lazy_gs: fixture)

pytestmark = pytest.mark.integration


def test_a_page_server_killed_while_it_fills_fails_the_restore_and_removes_the_container(lazy_gs: Gs, ledger) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of the page server once CRIU let the process go: the process would read zeros
    where its memory was, so the restore fails (exit 7) and the container is gone; the
    checkpoint is unchanged and restores eagerly."""

    gs = lazy_gs
    name, ref, log = checkpointed_big(gs, "lazyk")
    killed: list[str] = []

    def kill_when_filling() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            if log.is_file() and "restore finished" in log.read_text():
                for line in servers():
                    subprocess.run(["kill", "-9", line.split()[0]], check=False)
                    killed.append(line)
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=kill_when_filling)
    watcher.start()
    p = gs("restore", ref, "--name", name + "-r", "--lazy-pages", check=False)
    watcher.join()
    assert killed, "the server was not caught while filling"
    assert p.returncode == 7, (p.returncode, p.stderr)
    assert "lazy-pages server failed" in p.stderr and "--eager-pages" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert name + "-r" not in gs("ps").stdout
    gs("restore", ref, "--name", name + "-r", "--eager-pages")
    after = wait_lines(gs, name + "-r", lambda g: len(g) >= 2)
    assert after, "the eager restore of the same checkpoint runs"
    ledger.record("fault", "kill -9 the lazy-pages server while it fills", tried=1, passed=1, lost=0,
                  detail="restore failed (exit 7), container removed, the checkpoint restored eagerly")


def test_a_lazy_restore_killed_with_its_server_leaves_a_container_marked_damaged(lazy_gs: Gs, ledger) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of the page server and of the gpusnap restore waiting for it: nothing is left to
    remove the container, whose missing pages now read zeros; ps says so (whether its process
    still runs or already died of the zeros) and checkpoint refuses it, with what to do."""

    gs = lazy_gs
    name, ref, log = checkpointed_big(gs, "lazyd")
    from integration.cli.conftest import GPUSNAP

    cli = subprocess.Popen([GPUSNAP, "restore", ref, "--name", name + "-r", "--lazy-pages"], env=gs.env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (log.is_file() and "restore finished" in log.read_text()):
        time.sleep(0.005)
    cli.kill()
    for line in servers():
        subprocess.run(["kill", "-9", line.split()[0]], check=False)
    cli.wait(30)
    if "done:" in log.read_text():
        pytest.skip("the server finished before it was killed (a fast host): nothing to mark")
    ps = gs("ps").stdout
    assert name + "-r" in ps and "damaged" in ps, ps
    p = gs("checkpoint", name + "-r", check=False)
    assert p.returncode == 2 and "delete it and restore" in p.stderr, p.stderr
    gs("delete", name + "-r")
    ledger.record("fault", "kill -9 the lazy-pages server and gpusnap restore while it fills", tried=1, passed=1, lost=0,
                  detail="container marked damaged, checkpoint refused; the checkpoint itself unchanged")


def test_pages_that_fail_their_check_after_criu_went_on_fail_the_restore_and_remove_the_container(lazy_gs: Gs, ledger) -> None:  # type: ignore[no-untyped-def]
    """A pages blob of the store corrupt on disk: a lazy restore lets CRIU go once the pages it
    copies itself are in, so the bad piece is met while CRIU restores or the process already
    runs on the page server. The restore must still fail with the integrity error (its exit code, one line),
    the container and the server must be gone, and the checkpoint restores once its blob is
    whole again."""
    from gpusnap.packaging.store import OciStore

    gs = lazy_gs
    name, ref, _ = checkpointed_big(gs, "lazyc")
    store = OciStore(gs.store)
    layers = store.manifest(store.resolve(ref).digest)["layers"]
    packs = [d for d in layers if d["size"] >= 16 << 20]  # the 1 GiB of pages, in packs, in file order
    assert len(packs) >= 8, [d["size"] for d in layers]
    # Far into the pages (CRIU's own are at the end, fetched first): by then CRIU has most
    # likely let the process go; if not yet, the server's failure fails CRIU's restore instead,
    # and the outcome must be the same.
    victim = store.blob_path(packs[2 * len(packs) // 3]["digest"])
    with open(victim, "r+b") as f:
        f.seek(5 << 20)
        byte = f.read(1)
        f.seek(5 << 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        p = gs("restore", ref, "--name", name + "-r", "--lazy-pages", check=False)
    finally:
        with open(victim, "r+b") as f:
            f.seek(5 << 20)
            f.write(byte)
    assert p.returncode == 9, (p.returncode, p.stderr)  # ExitCode.INTEGRITY
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert name + "-r" not in gs("ps").stdout
    assert servers() == []
    gs("restore", ref, "--name", name + "-r")
    assert wait_lines(gs, name + "-r", lambda g: len(g) >= 2), "the restore of the mended checkpoint runs"
    ledger.record("fault", "a pages blob fails its check after CRIU let the lazy restore go", tried=1, passed=1, lost=0,
                  detail="restore failed (integrity, exit 9), container and page server gone, checkpoint restored once mended")


PROXY_PORT = 5357  # this area's hostile servers: 5350-5359


def test_a_page_server_killed_while_the_pull_stalls_removes_the_container_at_once(lazy_gs: Gs, registry, ledger) -> None:  # type: ignore[no-untyped-def]
    """A lazy restore from a registry follows the pull (gpusnap.criu.landed): the process runs
    while blobs still arrive. The page server killed then, with one pages blob stalled in the
    registry: the container must be removed at once — not once the download ends — since its
    missing pages now read zeros; the restore then fails (exit 7) and leaves nothing behind."""
    import json as _json
    import sys as _sys
    from pathlib import Path as _Path

    import requests

    _sys.path.insert(0, str(_Path(__file__).resolve().parents[2] / "unit" / "reliability"))
    from hostile_http import HostileServer, Reply, Seen  # noqa: E402

    from gpusnap.packaging.store import OciStore
    from integration.cli.test_lazy_pages import BIG, PYTHON, unique

    gs = lazy_gs
    name = unique("lazyp")
    gs("run", name, "--rootfs-overlay", "/", "--", PYTHON, "-c", BIG)
    assert ("parent", 1) in wait_lines(gs, name, lambda g: ("parent", 1) in g, timeout=120)
    ref = f"{registry.host}/gs-rel/lazyp:v1"
    local = _json.loads(gs("checkpoint", name, "--push", ref, "--insecure", "--json").stdout)["ref"]
    gs("delete", name)
    store = OciStore(gs.store)
    packs = [d for d in store.manifest(store.resolve(local).digest)["layers"] if d["size"] >= 16 << 20]
    victim = packs[2 * len(packs) // 3]["digest"]  # far from CRIU's own pages (at the end, fetched first)
    stalled, release = threading.Event(), threading.Event()

    def proxy(method: str, path: str, headers: dict[str, str]) -> Reply:
        if victim in path and method == "GET":
            stalled.set()
            release.wait(120)
            return Reply(500)
        fwd = {k: v for k, v in headers.items() if k in ("accept", "range", "authorization")}
        r = requests.request(method, f"http://{registry.host}{path}", headers=fwd, timeout=60)
        keep = ("content-type", "docker-content-digest", "content-range", "location", "www-authenticate", "content-length")
        return Reply(r.status_code, {k: v for k, v in r.headers.items() if k.lower() in keep}, r.content)

    log_path = gs.root / "run" / "engine" / "containers" / (name + "-r") / "lazy-pages.log"
    seen: list[Seen] = []
    result: list[subprocess.CompletedProcess[str]] = []
    with HostileServer("proxy", "127.0.0.1", PROXY_PORT, seen) as server:
        server.script = proxy
        restore = threading.Thread(target=lambda: result.append(
            gs("restore", f"127.0.0.1:{PROXY_PORT}/gs-rel/lazyp:v1", "--insecure", "--name", name + "-r", "--lazy-pages", check=False)))
        restore.start()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (stalled.is_set() and log_path.is_file() and "restore finished" in log_path.read_text()):
                time.sleep(0.01)
            assert stalled.is_set() and "restore finished" in log_path.read_text(), "CRIU did not let the process go while a blob stalled"
            killed = [ln for ln in servers()]
            for ln in killed:
                subprocess.run(["kill", "-9", ln.split()[0]], check=False)
            assert killed
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30 and name + "-r" in gs("ps").stdout:
                time.sleep(0.2)
            gone_after = time.monotonic() - t0
            assert name + "-r" not in gs("ps").stdout, "the container outlived its page server while the pull stalled"
            assert not release.is_set() and gone_after < 30
        finally:
            release.set()
            restore.join(180)
    assert result and result[0].returncode == 7, (result[0].returncode, result[0].stderr) if result else "no result"
    assert "Traceback" not in result[0].stderr and len(result[0].stderr.strip().splitlines()) == 1, result[0].stderr
    assert servers() == []
    ledger.record("fault", "kill -9 the lazy-pages server while the pull it follows stalls", tried=1, passed=1, lost=0,
                  detail=f"container removed {gone_after:.1f} s after the kill with the pull still stalled; restore failed (exit 7)")
