"""Faults on the packaging path with the real registry: kill -9 of a push, a pull and a store at
several points, ENOSPC during pull and store (a small tmpfs), the registry killed and restarted
mid-push and mid-pull.

For each: no partial artifact visible under a tag (locally or in the registry), the local store
passes a full digest check, and a retry succeeds with byte-identical content.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stack.registry import Registry

from gpusnap.errors import GpusnapError
from gpusnap.packaging import api
from gpusnap.packaging.progress import NullProgress
from gpusnap.packaging.registry import RegistryClient, pull_artifact, push_artifact
from gpusnap.packaging.store import OciStore
from gpusnap.packaging.verify import verify_store

pytestmark = [pytest.mark.integration, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (tmpfs mounts)")]
DRIVER = Path(__file__).with_name("gs_rel_transfer.py")
MIB = 40


def _ck(path: Path, mib: int = MIB, seed: int = 7) -> Path:
    path.mkdir(parents=True)
    rnd = random.Random(seed)
    with (path / "pages-1.img").open("wb") as f:
        for _ in range(mib):
            f.write(rnd.randbytes(1 << 20))
    (path / "inventory.img").write_bytes(b"inventory %d" % seed)
    (path / "core-1.img").write_bytes(rnd.randbytes(4096))
    return path


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file() and p.name != "gpusnap.json"}


def _lost(src: Path, store: Path, ref: str, out: Path) -> int:
    """Files of ``src`` missing or different after materializing ``ref`` (the data-lost figure)."""
    got = _files(api.materialize_checkpoint(store, ref, out, form="criu-dir"))
    want = _files(src)
    return sum(1 for k, v in want.items() if got.get(k) != v)


def _run_and_kill(args: list[str], *, at_bytes: int | None = None, after_s: float | None = None, env: dict[str, str] | None = None) -> bool:
    """Run the driver; SIGKILL it once it reports ``at_bytes`` moved (or after ``after_s``).
    Returns True if it was killed before finishing."""
    proc = subprocess.Popen([sys.executable, str(DRIVER), *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    start = time.monotonic()
    killed = False
    for line in proc.stdout:
        line = line.strip()
        if line == "done":
            break
        if (at_bytes is not None and line.isdigit() and int(line) >= at_bytes) or (after_s is not None and time.monotonic() - start >= after_s):
            proc.send_signal(signal.SIGKILL)
            killed = True
            break
        if after_s is not None and line == "0":
            time.sleep(after_s)
            proc.send_signal(signal.SIGKILL)
            killed = True
            break
    rest = proc.stdout.read() if killed else ""
    proc.wait(120)
    # It may have finished between its last report and the signal: that is no fault injected.
    return killed and "done" not in rest and proc.returncode == -signal.SIGKILL


def _store_ok(store: Path) -> None:
    report = verify_store(OciStore(store))
    assert report.ok, report.summary()


# The uploads in two transfer processes (a host of 4 cores or more), which report progress
# 8 MiB at a time: kill points they pass before the end.
IN_PROCESSES = {"GS_REL_PUSH_PROCESSES": "2"}


@pytest.mark.parametrize("fraction, env", [(0.05, None), (0.35, None), (0.7, None), (0.97, None),
                                           (0.2, IN_PROCESSES), (0.6, IN_PROCESSES)],
                         ids=["5%", "35%", "70%", "97%", "20%-2-processes", "60%-2-processes"])
def test_kill9_push(tmp_path: Path, registry: Registry, ledger, fraction: float, env: dict[str, str] | None) -> None:  # type: ignore[no-untyped-def]
    src = _ck(tmp_path / "ck")
    store = tmp_path / "store"
    api.store_checkpoint(store, src, form="criu-dir", ref="gs-rel/ck:1")
    remote = f"{registry.host}/gs-rel/kill-push:1"
    killed = _run_and_kill(["push", str(store), "gs-rel/ck:1", remote], at_bytes=int(fraction * (MIB << 20)), env=env)
    assert killed, "the push finished before the kill point"
    assert not registry.has_tag("gs-rel/kill-push", "1"), "a killed push must not leave a tag"
    _store_ok(store)
    api.push(store, "gs-rel/ck:1", remote, insecure=True)
    fresh = tmp_path / "fresh"
    api.pull(fresh, remote, insecure=True)
    lost = _lost(src, fresh, remote, tmp_path / "out")
    ledger.record("fault", "kill -9 push", passed=int(lost == 0), lost=lost, detail="at 5/35/70/97% of bytes; at 20/60% with 2 transfer processes")
    assert lost == 0


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_kill9_pull(tmp_path: Path, registry: Registry, ledger, fraction: float) -> None:  # type: ignore[no-untyped-def]
    src = _ck(tmp_path / "ck")
    api.store_checkpoint(tmp_path / "origin", src, form="criu-dir", ref="gs-rel/ck:1")
    remote = f"{registry.host}/gs-rel/kill-pull:1"
    api.push(tmp_path / "origin", "gs-rel/ck:1", remote, insecure=True)
    store = tmp_path / "store"
    killed = _run_and_kill(["pull", str(store), remote], at_bytes=int(fraction * (MIB << 20)))
    assert killed
    s = OciStore(store)
    assert s.tags() == [], "a killed pull must not leave a tag"
    _store_ok(store)
    api.pull(store, remote, insecure=True)
    lost = _lost(src, store, remote, tmp_path / "out")
    api.gc(store)
    assert list(s.ingest_dir.iterdir()) == [], "gc clears what the killed pull left in ingest/"
    ledger.record("fault", "kill -9 pull", passed=int(lost == 0), lost=lost, detail="at 10/50/90% of bytes")
    assert lost == 0


@pytest.mark.parametrize("fraction, env", [(0.1, None), (0.6, None), (0.2, IN_PROCESSES), (0.6, IN_PROCESSES)],
                         ids=["10%", "60%", "20%-2-processes", "60%-2-processes"])
def test_kill9_pipelined_push(tmp_path: Path, registry: Registry, ledger, fraction: float, env: dict[str, str] | None) -> None:  # type: ignore[no-untyped-def]
    """checkpoint --push (store and upload at once) killed: no tag in the registry nor in the
    store, and a second run stores and pushes the same bytes."""
    src = _ck(tmp_path / "ck")
    store = tmp_path / "store"
    remote = f"{registry.host}/gs-rel/kill-pipe:1"
    killed = _run_and_kill(["pushpipe", str(store), str(src), remote, "gs-rel/pipe:1"], at_bytes=int(fraction * (MIB << 20)), env=env)
    assert killed, "the push finished before the kill point"
    assert not registry.has_tag("gs-rel/kill-pipe", "1"), "a killed push must not leave a tag"
    _store_ok(store)
    # The store may have finished (and tagged) before the uploads did: that local checkpoint is whole.
    lost = sum(_lost(src, store, t.ref, tmp_path / f"local-{i}") for i, t in enumerate(OciStore(store).tags()))
    subprocess.run([sys.executable, str(DRIVER), "pushpipe", str(store), str(src), remote, "gs-rel/pipe:1"], check=True, capture_output=True)
    fresh = tmp_path / "fresh"
    api.pull(fresh, remote, insecure=True)
    lost += _lost(src, fresh, remote, tmp_path / "out")
    ledger.record("fault", "kill -9 checkpoint --push (pipelined)", passed=int(lost == 0), lost=lost, detail="at 10/60% of bytes; at 20/60% with 2 transfer processes")
    assert lost == 0


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_kill9_direct_restore(tmp_path: Path, registry: Registry, ledger, fraction: float) -> None:  # type: ignore[no-untyped-def]
    """Restore from a registry killed mid-download: nothing at the destination but the partial
    directory in the dead process's work directory, which the next gpusnap run removes; the
    store has no record; a second run writes the same bytes."""
    from gpusnap.config import Settings
    from gpusnap.engines.orchestrate import work_dir

    src = _ck(tmp_path / "ck")
    api.store_checkpoint(tmp_path / "origin", src, form="criu-dir", ref="gs-rel/ck:1")
    remote = f"{registry.host}/gs-rel/kill-fetch:1"
    api.push(tmp_path / "origin", "gs-rel/ck:1", remote, insecure=True)
    settings = Settings(state_dir=tmp_path / "state", store_dir=tmp_path / "store")
    store = settings.store_dir
    work = settings.state_dir / "tmp"
    work.mkdir(parents=True)
    # The driver plays a gpusnap restore: its own work directory, named after its PID.
    proc_dest = work / "work-{pid}-x" / "checkpoint"
    driver = [sys.executable, "-c", (
        "import os, sys; sys.argv = ['gs_rel_transfer.py', 'fetch', sys.argv[1], sys.argv[2], sys.argv[3].format(pid=os.getpid())];"
        f"sys.path.insert(0, {str(DRIVER.parent)!r}); import gs_rel_transfer as t; sys.exit(t.main(sys.argv))"),
        str(store), remote, str(proc_dest)]
    proc = subprocess.Popen(driver, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    killed = False
    for line in proc.stdout:
        if line.strip().isdigit() and int(line) >= int(fraction * (MIB << 20)):
            proc.send_signal(signal.SIGKILL)
            killed = True
            break
    proc.wait(60)
    assert killed and proc.returncode == -signal.SIGKILL, "the restore finished before the kill point"
    left = list(work.iterdir())
    assert len(left) == 1 and not (left[0] / "checkpoint").exists(), "only the partial directory of the killed run"
    assert not (store / "restored.json").exists()
    if store.exists():
        _store_ok(store)
    fresh_work = work_dir(settings)  # the next run: removes the dead run's work directory
    assert list(work.iterdir()) == [fresh_work]
    out = api.fetch_into(store, api.open_remote(remote, insecure=True), fresh_work / "checkpoint")
    lost = sum(1 for k, v in _files(src).items() if _files(out.dest).get(k) != v)
    _store_ok(store)
    ledger.record("fault", "kill -9 restore from registry (direct)", passed=int(lost == 0), lost=lost, detail="at 10/50/90% of bytes")
    assert lost == 0


@pytest.mark.parametrize("after_s", [0.02, 0.15])
def test_kill9_store(tmp_path: Path, ledger, after_s: float) -> None:  # type: ignore[no-untyped-def]
    src = _ck(tmp_path / "ck", mib=256)
    store = tmp_path / "store"
    api.store_checkpoint(store, _ck(tmp_path / "older", mib=2, seed=1), form="criu-dir", ref="gs-rel/older:1")
    killed = _run_and_kill(["store", str(store), str(src), "gs-rel/ck:1"], after_s=after_s)
    assert killed
    assert [t.ref for t in OciStore(store).tags()] == ["gs-rel/older:1"], "no tag for the killed store; the older one intact"
    _store_ok(store)
    api.store_checkpoint(store, src, form="criu-dir", ref="gs-rel/ck:1")
    lost = _lost(src, store, "gs-rel/ck:1", tmp_path / "out") + _lost(tmp_path / "older", store, "gs-rel/older:1", tmp_path / "out2")
    ledger.record("fault", "kill -9 store (checkpoint packaging)", passed=int(lost == 0), lost=lost, detail="256 MiB, killed at 0.02/0.15 s")
    assert lost == 0


def _tmpfs(path: Path, size: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    return path


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.parametrize("op", ["pull", "store"])
def test_enospc(tmp_path: Path, registry: Registry, ledger, op: str) -> None:  # type: ignore[no-untyped-def]
    src = _ck(tmp_path / "ck")
    remote = f"{registry.host}/gs-rel/enospc:1"
    if op == "pull":
        api.store_checkpoint(tmp_path / "origin", src, form="criu-dir", ref="gs-rel/ck:1")
        api.push(tmp_path / "origin", "gs-rel/ck:1", remote, insecure=True)
    small = _tmpfs(tmp_path / "small", "16m")
    try:
        store = small / "store"
        with pytest.raises(GpusnapError) as err:
            if op == "pull":
                api.pull(store, remote, insecure=True)
            else:
                api.store_checkpoint(store, src, form="criu-dir", ref="gs-rel/ck:1")
        assert "\n" not in str(err.value) and "space" in str(err.value).lower(), str(err.value)
        assert OciStore(store).tags() == []
        _store_ok(store)
        subprocess.run(["mount", "-o", "remount,size=256m", str(small)], check=True)
        if op == "pull":
            api.pull(store, remote, insecure=True)
            ref = remote
        else:
            api.store_checkpoint(store, src, form="criu-dir", ref="gs-rel/ck:1")
            ref = "gs-rel/ck:1"
        _store_ok(store)
        lost = _lost(src, store, ref, tmp_path / "out")
    finally:
        _umount(small)
    ledger.record("fault", f"ENOSPC during {op}", passed=int(lost == 0), lost=lost, detail="16 MiB tmpfs, then grown")
    assert lost == 0


class _RestartAt(NullProgress):
    """Kills the registry (-9) once ``at`` bytes moved and starts it again ``pause`` s later."""

    def __init__(self, reg: Registry, at: int, pause: float = 1.0) -> None:
        self.reg, self.at, self.pause = reg, at, pause
        self.moved = 0
        self.fired = threading.Event()
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None

    def advance(self, n: int) -> None:
        with self.lock:
            self.moved += n
            if self.moved < self.at or self.fired.is_set():
                return
            self.fired.set()
        self.reg.kill()
        self.timer = threading.Timer(self.pause, self.reg.start)
        self.timer.start()


@pytest.mark.parametrize("op", ["push", "pull"])
def test_registry_restarted_mid_transfer(tmp_path: Path, registry: Registry, ledger, op: str) -> None:  # type: ignore[no-untyped-def]
    src = _ck(tmp_path / "ck", mib=64)
    store = OciStore(tmp_path / "store")
    api.store_checkpoint(store.root, src, form="criu-dir", ref="gs-rel/ck:1")
    remote = f"{registry.host}/gs-rel/restart-{op}:1"
    client = RegistryClient(registry.host, insecure=True, retries=8, backoff_s=0.3)
    killer = _RestartAt(registry, at=24 << 20)
    if op == "push":
        push_artifact(store, "gs-rel/ck:1", remote, progress=killer, client=client)
        target = OciStore(tmp_path / "fresh")
        pull_artifact(target, remote, client=RegistryClient(registry.host, insecure=True))
    else:
        api.push(store.root, "gs-rel/ck:1", remote, insecure=True)
        target = OciStore(tmp_path / "fresh")
        pull_artifact(target, remote, progress=killer, client=client)
    if killer.timer is not None:
        killer.timer.join()
    assert killer.fired.is_set(), "the registry was never killed: the test proves nothing"
    _store_ok(target.root)
    lost = _lost(src, target.root, remote, tmp_path / "out")
    ledger.record("fault", f"registry killed and restarted mid-{op}", passed=int(lost == 0), lost=lost, detail="retried and resumed in the same call")
    assert lost == 0


def _store_state(store: Path) -> dict[str, str]:
    """Every file of the store and its digest: a restore must not change any of it."""
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(store.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("op", ["materialize", "fetch"])
def test_enospc_restore(tmp_path: Path, registry: Registry, ledger, op: str) -> None:  # type: ignore[no-untyped-def]
    """The image directory of a restore (from the store, or straight from a registry) on a
    filesystem that fills up: a one-line error, no directory or partial file left beside the
    destination, the store as it was (no restored.json record); with room, the same call
    writes every byte."""
    src = _ck(tmp_path / "ck")
    store = tmp_path / "store"
    api.store_checkpoint(store, src, form="criu-dir", ref="gs-rel/ck:1")
    remote = f"{registry.host}/gs-rel/enospc-restore:1"
    fetch_store = tmp_path / "fetch-store"
    if op == "fetch":
        api.push(store, "gs-rel/ck:1", remote, insecure=True)

    def restore(dest: Path) -> Path:
        if op == "materialize":
            return api.materialize_checkpoint(store, "gs-rel/ck:1", dest, form="criu-dir")
        return api.fetch_into(fetch_store, api.open_remote(remote, insecure=True), dest).dest

    before = _store_state(store)
    small = _tmpfs(tmp_path / "small", "16m")
    try:
        with pytest.raises(GpusnapError) as err:
            restore(small / "work" / "checkpoint")
        assert "\n" not in str(err.value) and "space" in str(err.value).lower(), str(err.value)
        assert [p.name for p in (small / "work").iterdir()] == [], "nothing half-written beside the destination"
        assert _store_state(store) == before
        assert not (fetch_store / "restored.json").exists()
        subprocess.run(["mount", "-o", "remount,size=256m", str(small)], check=True)
        out = restore(small / "work" / "checkpoint")
        lost = sum(1 for k, v in _files(src).items() if _files(out).get(k) != v)
    finally:
        _umount(small)
    _store_ok(store)
    ledger.record("fault", f"ENOSPC during restore ({op})", passed=int(lost == 0), lost=lost, detail="image dir on a 16 MiB tmpfs, then grown")
    assert lost == 0


@pytest.mark.parametrize("after_s", [0.02, 0.12])
def test_kill9_materialize(tmp_path: Path, ledger, after_s: float) -> None:  # type: ignore[no-untyped-def]
    """A restore from the store killed while it unpacks: nothing at the destination (only the
    partial directory beside it, in the dead run's work dir), the store unchanged and intact."""
    src = _ck(tmp_path / "ck", mib=512)
    store = tmp_path / "store"
    api.store_checkpoint(store, src, form="criu-dir", ref="gs-rel/ck:1")
    before = _store_state(store)
    dest = tmp_path / "work" / "checkpoint"
    killed = _run_and_kill(["materialize", str(store), "gs-rel/ck:1", str(dest)], after_s=after_s)
    assert killed, "the materialize finished before the kill"
    assert not dest.exists()
    left = list((tmp_path / "work").iterdir()) if (tmp_path / "work").exists() else []
    assert all(p.name.startswith(".checkpoint.partial-") for p in left), left
    assert _store_state(store) == before
    _store_ok(store)
    lost = _lost(src, store, "gs-rel/ck:1", tmp_path / "out")
    ledger.record("fault", "kill -9 restore from the store (unpack)", passed=int(lost == 0), lost=lost, detail="512 MiB, killed 0.02/0.12 s into it")
    assert lost == 0
