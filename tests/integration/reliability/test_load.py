"""Load: 100 parallel pushes to one registry, the local store under concurrent writers and gc,
and 10 containers checkpointed and pushed at once. No corruption, no deadlock (every wait has a
deadline), bounded memory."""

from __future__ import annotations

import hashlib
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stack.registry import Registry

from gpusnap.packaging import api
from gpusnap.packaging.store import OciStore
from gpusnap.packaging.verify import verify_store

pytestmark = [pytest.mark.integration, pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack")]


class PeakRss:
    """Samples this process's resident memory while a block runs (ru_maxrss is a lifetime peak,
    useless after earlier tests in the same process)."""

    def __init__(self) -> None:
        self.base = self.now()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> float:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / (1 << 20)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def grew(self) -> float:
        return self.peak - self.base


def _pages_digest(out: Path) -> str:
    return hashlib.sha256((out / "pages-1.img").read_bytes()).hexdigest()


def test_100_parallel_pushes_to_one_registry(tmp_path: Path, registry: Registry, ledger) -> None:  # type: ignore[no-untyped-def]
    n = 100
    store = tmp_path / "store"
    shared = random.Random(1).randbytes(1 << 20)
    want: dict[str, str] = {}
    for i in range(n):
        src = tmp_path / "src" / str(i)
        src.mkdir(parents=True)
        pages = shared + random.Random(1000 + i).randbytes(128 << 10)
        (src / "pages-1.img").write_bytes(pages)
        (src / "inventory.img").write_bytes(b"inv %d" % i)
        api.store_checkpoint(store, src, form="criu-dir", ref=f"gs-rel/p:{i}")
        want[f"{registry.host}/gs-rel/load:{i}"] = hashlib.sha256(pages).hexdigest()
    t0 = time.monotonic()
    with PeakRss() as rss, ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(api.push, store, f"gs-rel/p:{i}", f"{registry.host}/gs-rel/load:{i}", insecure=True) for i in range(n)]
        results = [f.result(timeout=600) for f in futures]  # a deadlock fails here, not hangs
    push_s = time.monotonic() - t0
    assert len({r.digest for r in results}) == n
    fresh = tmp_path / "fresh"
    with ThreadPoolExecutor(16) as pool:
        refs = list(pool.map(lambda r: api.pull(fresh, r, insecure=True), want, timeout=600))
    assert verify_store(OciStore(fresh)).ok
    lost = 0
    for ref in refs:
        out = api.materialize_checkpoint(fresh, ref, tmp_path / "out" / ref.rsplit(":", 1)[1], form="criu-dir")
        lost += int(_pages_digest(out) != want[ref])
    grew = rss.grew
    ledger.record("load", "100 parallel pushes to one registry", passed=int(lost == 0 and grew < 1024), lost=lost,
                  detail=f"{push_s:.1f} s, RSS +{grew:.0f} MiB peak")
    assert lost == 0
    assert grew < 1024, f"memory grew by {grew:.0f} MiB pushing 100 small checkpoints"


def test_store_under_concurrent_writers_and_gc(tmp_path: Path, ledger) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "store"
    here = Path(__file__).with_name("gs_rel_writer.py")
    writers = [subprocess.Popen([sys.executable, str(here), "write", str(store), str(tmp_path / "work"), "6", str(seed)],
                                stdout=subprocess.PIPE, text=True) for seed in range(6)]
    gc = subprocess.Popen([sys.executable, str(here), "gc", str(store), "15"], stdout=subprocess.PIPE, text=True)
    stored: dict[str, str] = {}
    removed: set[str] = set()
    for w in writers:
        out, _ = w.communicate(timeout=600)
        assert w.returncode == 0
        for line in out.splitlines():
            if line.startswith("removed "):
                removed.add(line.split()[1])
            else:
                ref, digest = line.split()
                stored[ref] = digest
    gc_out, _ = gc.communicate(timeout=600)
    assert gc.returncode == 0
    api.gc(store)
    report = verify_store(OciStore(store))
    assert report.ok, report.summary()
    live = {t.ref for t in OciStore(store).tags()}
    expect = set(stored) - removed
    lost = len(expect - live)
    for ref in sorted(expect & live):
        out = api.materialize_checkpoint(store, ref, tmp_path / "out" / ref.replace("/", "_"), form="criu-dir")
        lost += int(_pages_digest(out) != stored[ref])
    ledger.record("load", "store: 6 concurrent writers + gc loop", passed=int(lost == 0), lost=lost,
                  detail=f"{len(stored)} checkpoints, {gc_out.split()[-1]} gc runs")
    assert lost == 0


def test_10_containers_checkpointed_and_pushed_at_once(tmp_path: Path, registry: Registry, ledger) -> None:  # type: ignore[no-untyped-def]
    if not shutil.which("runc"):
        pytest.skip("needs runc")
    from test_faults_runtime import RelContainer

    from gpu_harness import standin_stack

    stack = standin_stack(tmp_path)
    containers = [RelContainer(stack, gb=0.05, sleep=0.01) for _ in range(10)]
    try:
        for c in containers:
            c.start()
        store = tmp_path / "store"
        before = {c.id: c.last_step() for c in containers}
        errors: list[str] = []

        def one(c: RelContainer) -> str:
            img = tmp_path / "img" / c.id
            run = c.checkpoint(img)
            if run.rc != 0:
                raise AssertionError(f"{c.id}: {run.stderr[-400:]}")
            api.store_checkpoint(store, img, form="criu-dir", ref=f"gs-rel/{c.id}:1")
            remote = f"{registry.host}/gs-rel/{c.id}:1"
            api.push(store, f"gs-rel/{c.id}:1", remote, insecure=True)
            return remote

        t0 = time.monotonic()
        with ThreadPoolExecutor(10) as pool:
            remotes = list(pool.map(one, containers, timeout=900))
        seconds = time.monotonic() - t0
        # Bring every one back from the registry (fresh store) and check it runs on.
        fresh = tmp_path / "fresh"
        lost = 0
        for c, remote in zip(containers, remotes):
            api.pull(fresh, remote, insecure=True)
            img = api.materialize_checkpoint(fresh, remote, tmp_path / "restore" / c.id, form="criu-dir")
            c.delete()
            run = c.restore(img)
            if run.rc != 0:
                errors.append(f"{c.id}: {run.stderr[-300:]}")
                lost += 1
                continue
            try:
                c.wait_step(before[c.id] + 20, timeout=120)
            except AssertionError as exc:
                errors.append(str(exc)[:300])
                lost += 1
        assert verify_store(OciStore(fresh)).ok and verify_store(OciStore(store)).ok
        ledger.record("load", "10 containers checkpointed + pushed at once", passed=int(lost == 0), lost=lost,
                      detail=f"{seconds:.1f} s, all restored from the registry")
        assert lost == 0, errors
    finally:
        for c in containers:
            c.cleanup()


def test_encrypting_a_large_layer_streams_in_bounded_memory(tmp_path: Path, ledger) -> None:  # type: ignore[no-untyped-def]
    from gpusnap.packaging import crypto

    size = 256 << 20
    src = tmp_path / "layer"
    with src.open("wb") as f:
        for i in range(size >> 20):
            f.write(random.Random(i).randbytes(1 << 20))
    key = crypto.EncryptionConfig(master=crypto.MasterKey(os.urandom(32)))
    with PeakRss() as rss:
        enc = crypto.encrypt_file(src, tmp_path / "enc", media_type="application/x", config=key)
        digest, n = crypto.decrypt_file(tmp_path / "enc", tmp_path / "dec", annotations=enc.annotations,
                                        keys=crypto.DecryptionKeys(masters=(key.master,)))
    lost = int(digest != enc.plaintext_digest or n != size)
    held = lost == 0 and rss.grew < 64
    ledger.record("load", "encrypt + decrypt a 256 MiB layer", passed=int(held), lost=lost, detail=f"RSS +{rss.grew:.0f} MiB peak")
    assert lost == 0
    assert rss.grew < 64, f"encryption is supposed to stream; memory grew by {rss.grew:.0f} MiB"
