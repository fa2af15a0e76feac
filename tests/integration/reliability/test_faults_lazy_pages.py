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
