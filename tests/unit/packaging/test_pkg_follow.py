"""The store that follows a dump (gpusnap.packaging.follow): packs pages files as they are
written, and makes the artifact a store of the finished directory makes.

The writer here plays CRIU's part the way CRIU writes (one process after the other: a pagemap
image through a 4 KiB buffer, its pages file appended run by run); the real CRIU writes the
directories of tests/integration/packaging/test_follow_dump.py.
"""

from __future__ import annotations

import hashlib
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from gpusnap.packaging import api
from gpusnap.packaging import pack as packing
from gpusnap.packaging.follow import PROVISIONAL, DumpFollower
from gpusnap.criu.pagemap import PAGE_SIZE, PagemapReader, parse_pagemap
from gpusnap.packaging.store import OciStore
from gpusnap.host.cores import usable_cores

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: criu_images
from criu_images import present_pagemap  # noqa: E402
from stored_artifacts import layers_and_config as _artifact  # noqa: E402

PAGE = PAGE_SIZE
PARAMS = packing.PackParams(window=256 << 10, pack_target=1 << 20)  # small windows and packs: many of each (abort test)


def _process(seed: int, runs: list[tuple[int, int]]) -> list[tuple[int, bytes]]:
    """(vaddr, bytes) per pagemap entry: random pages, some zero runs, some repeats."""
    rnd = random.Random(seed)
    out = []
    for va, n in runs:
        data = bytearray(rnd.randbytes(n * PAGE))
        if n > 40:
            data[8 * PAGE: 30 * PAGE] = bytes(22 * PAGE)  # a zero run inside
        out.append((va, bytes(data)))
    return out


def _entries(base: int, pages: int, split: int = 256) -> list[tuple[int, int]]:
    """One mapping of ``pages`` pages at ``base``, split into entries of at most ``split``
    pages the way CRIU's page pipes split it."""
    out, at = [], 0
    while at < pages:
        n = min(split, pages - at)
        out.append((base + at * PAGE, n))
        at += n
    return out


# (pid, pages id, entries). Entries of 16 pages (CRIU's are up to 256): the pagemap buffer is
# flushed every ~270 entries, so the big process's pagemap reaches the disk in a few flushes
# while its pages are written, as a GPU process's does with CRIU's larger entries.
PROCESSES = [
    (1, 1, _process(1, [(0x400000, 3), (0x600000, 1)])),  # a small init first, as in a container
    (7, 2, _process(2, _entries(0x7F0000000000, 9000, 16) + _entries(0x7F0004000000 + 5 * PAGE, 3011, 100) + [(0x7FFF0000, 9)])),
    (9, 3, _process(3, _entries(0x7E0000000000, 300))),
]


class FakeCriu:
    """Writes a CRIU-shaped image directory over time; ``hold`` pauses it, in the big
    process, after its pagemap's second flush, until released."""

    def __init__(self, root: Path, *, hold: threading.Event | None = None, pause_s: float = 0.0005) -> None:
        self.root, self.hold, self.pause_s = root, hold, pause_s
        self.thread = threading.Thread(target=self.run)
        self.error: BaseException | None = None
        self.halfway = threading.Event()

    def run(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for pid, pid_pages, entries in PROCESSES:
                self._process(pid, pid_pages, entries)
            (self.root / "core-1.img").write_bytes(b"core")
            (self.root / "inventory.img").write_bytes(b"inv")
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _process(self, pid: int, pages_id: int, entries: list[tuple[int, bytes]]) -> None:
        whole = present_pagemap(pages_id, [(va, len(d) // PAGE) for va, d in entries])
        head_end = _head_end(whole)
        with open(self.root / f"pagemap-{pid}.img", "wb", buffering=0) as pm, open(self.root / f"pages-{pages_id}.img", "wb", buffering=0) as pg:
            flushed = 0  # CRIU's bfd: the head and the entries wait in a 4 KiB buffer
            ends = _entry_ends(whole, head_end)
            flushes = 0
            for k, (_va, data) in enumerate(entries):
                if ends[k] - flushed >= 4096:
                    pm.write(whole[flushed:flushed + 4096])
                    flushed += 4096
                    flushes += 1
                    if self.hold is not None and pages_id == 2 and flushes == 2:
                        self.halfway.set()
                        assert self.hold.wait(20)
                for i in range(0, len(data), 64 * PAGE):
                    pg.write(data[i:i + 64 * PAGE])
                    if self.pause_s:
                        time.sleep(self.pause_s)
            pm.write(whole[flushed:])  # closing the image flushes the rest


def _head_end(image: bytes) -> int:
    ln = int.from_bytes(image[8:12], "little")
    return 12 + ln


def _entry_ends(image: bytes, pos: int) -> list[int]:
    out = []
    while pos < len(image):
        ln = int.from_bytes(image[pos:pos + 4], "little")
        pos += 4 + ln
        out.append(pos)
    return out


def _store_finished(tmp: Path, src: Path, name: str) -> tuple[list[dict], dict]:
    """What a store of the finished directory makes (a fresh store)."""
    return _artifact(tmp / name, api.store_checkpoint(tmp / name, src, form="criu-dir", ref=f"local/{name}:1").digest)


def _follow_store(store_dir: Path, src: Path, *, hold: threading.Event | None = None,
                  check: Callable[[FakeCriu, DumpFollower], None] | None = None) -> tuple[tuple[list[dict], dict], DumpFollower]:
    follower = DumpFollower(OciStore(store_dir), src, compress=False, params=None, poll_s=0.001)
    follower.start()
    criu = FakeCriu(src, hold=hold)
    criu.thread.start()
    if check is not None:
        check(criu, follower)
    criu.thread.join()
    assert criu.error is None
    stored = api.store_checkpoint(store_dir, src, form="criu-dir", ref="local/followed:1", follower=follower)
    return _artifact(store_dir, stored.digest), follower


def test_pagemap_reader_fed_byte_by_byte_reads_what_parse_reads() -> None:
    image = present_pagemap(4, _entries(0x10000, 1000, 7))
    reader = PagemapReader()
    for i in range(len(image)):
        reader.feed(image[i:i + 1])
    assert reader.pending == 0
    assert (reader.pages_id, reader.ranges) == parse_pagemap(image)


def test_artifact_of_a_followed_dump_is_that_of_the_finished_directory(tmp_path: Path) -> None:
    hold = threading.Event()
    seen: dict[str, int] = {}

    def midway(criu: FakeCriu, follower: DumpFollower) -> None:
        # CRIU is paused halfway through the big file: the follower must have packed part of it
        assert criu.halfway.wait(10)
        deadline = time.monotonic() + 10
        while follower.bytes_while_dumping == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["midway"] = follower.bytes_while_dumping
        hold.set()

    artifact, follower = _follow_store(tmp_path / "followed", tmp_path / "dump", hold=hold, check=midway)
    assert seen["midway"] > 0
    assert follower.bytes_while_dumping >= seen["midway"]
    assert artifact == _store_finished(tmp_path, tmp_path / "dump", "finished")
    # every blob published with the tag: nothing left waiting in ingest/
    store = OciStore(tmp_path / "followed")
    assert not list(store.ingest_dir.iterdir())
    assert all(store.has_blob(d["digest"]) and (store.blobs_dir / d["digest"].split(":")[1]).is_file() for d in artifact[0])
    out = tmp_path / "out"
    api.materialize_checkpoint(tmp_path / "followed", "local/followed:1", out, form="criu-dir")
    for f in (tmp_path / "dump").iterdir():
        assert hashlib.sha256((out / f.name).read_bytes()).digest() == hashlib.sha256(f.read_bytes()).digest(), f.name


def test_follower_started_after_the_dump_ended_stores_the_same(tmp_path: Path) -> None:
    FakeCriu(tmp_path / "dump", pause_s=0).run()
    follower = DumpFollower(OciStore(tmp_path / "s"), tmp_path / "dump", compress=False).start()
    digest = api.store_checkpoint(tmp_path / "s", tmp_path / "dump", form="criu-dir", ref="local/x:1", follower=follower).digest
    assert _artifact(tmp_path / "s", digest) == _store_finished(tmp_path, tmp_path / "dump", "finished")


def test_a_pagemap_that_changes_under_the_follower_falls_back_to_the_finished_files(tmp_path: Path) -> None:
    hold = threading.Event()

    def rewrite(criu: FakeCriu, follower: DumpFollower) -> None:
        assert criu.halfway.wait(10)
        deadline = time.monotonic() + 10
        while follower.bytes_while_dumping == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert follower.bytes_while_dumping > 0
        hold.set()
        criu.thread.join()
        # Not what CRIU does: its pagemap now says the pages lie at other addresses.
        old = parse_pagemap((tmp_path / "dump" / "pagemap-7.img").read_bytes())[1]
        (tmp_path / "dump" / "pagemap-7.img").write_bytes(present_pagemap(2, [(r.vaddr + 3 * PAGE, r.nr_pages) for r in old]))

    artifact, _ = _follow_store(tmp_path / "followed", tmp_path / "dump", hold=hold, check=rewrite)
    assert artifact == _store_finished(tmp_path, tmp_path / "dump", "finished")


def test_an_aborted_follower_leaves_no_blob_behind_a_gc(tmp_path: Path) -> None:
    store_dir = tmp_path / "s"
    hold = threading.Event()
    follower = DumpFollower(OciStore(store_dir), tmp_path / "dump", compress=False, params=PARAMS, poll_s=0.001).start()
    criu = FakeCriu(tmp_path / "dump", hold=hold)
    criu.thread.start()
    assert criu.halfway.wait(10)
    deadline = time.monotonic() + 10
    while follower.bytes_while_dumping == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    follower.abort()  # the dump failed
    follower.close()
    hold.set()
    criu.thread.join()
    store = OciStore(store_dir)
    store.gc()
    assert not [p for p in (store_dir / "blobs").rglob("*") if p.is_file()]
    assert not [p for p in store_dir.rglob("*") if p.is_file() and "ingest" in p.parts]


def test_follow_with_compression_and_small_packs(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    follower = DumpFollower(OciStore(tmp_path / "s"), dump, compress=True, poll_s=0.001).start()
    criu = FakeCriu(dump)
    criu.run()
    stored = api.store_checkpoint(tmp_path / "s", dump, form="criu-dir", ref="local/z:1", compress=True, follower=follower)
    out = tmp_path / "out"
    api.materialize_checkpoint(tmp_path / "s", "local/z:1", out, form="criu-dir")
    assert {f.name: f.read_bytes() for f in dump.iterdir()} == {f.name: f.read_bytes() for f in out.iterdir()}
    assert stored.digest


def test_renumber_files_moves_only_the_named_numbers() -> None:
    from gpusnap.packaging import layout as lay

    table = bytearray()
    for fi in (PROVISIONAL + 2, 0, PROVISIONAL + 1, 1):
        table += lay.RECORD.pack(0, 0, fi, lay.NO_LAYER, PAGE, 0, lay.FLAG_ZERO, 0, bytes(32))
    result = packing.PackResult(table, [], 0, 0)
    result.renumber_files({PROVISIONAL + 1: 0, PROVISIONAL + 2: 1, 0: 2, 1: 3})
    got = [lay.RECORD.unpack_from(table, i * lay.RECORD.size)[2] for i in range(4)]
    assert got == [1, 2, 0, 3]


def test_window_end_depends_on_no_cut_past_its_reach() -> None:
    rnd = random.Random(5)
    cuts = np.cumsum([0] + [rnd.randint(1, 32) for _ in range(400)]).astype(np.int64)
    per = 256
    for i in range(len(cuts) - 1):
        reach = int(np.searchsorted(cuts, cuts[i] + per, side="right"))  # the first cut past the reach
        if reach >= len(cuts):
            break
        known = cuts[: reach + 1]  # what a follower knows: up to one final cut past the reach
        assert packing.window_end(known, i, per) == packing.window_end(cuts, i, per)


def test_a_follower_packs_on_threads_that_give_way_to_the_dump(tmp_path: Path) -> None:
    from gpusnap.host.priority import thread_nice

    mine = thread_nice()
    seen: set[int] = set()
    follower = DumpFollower(OciStore(tmp_path / "s"), tmp_path / "dump", compress=False, poll_s=0.001, nice=mine + 6,
                            on_blob=lambda d: seen.add(thread_nice())).start()
    FakeCriu(tmp_path / "dump", pause_s=0).run()
    api.store_checkpoint(tmp_path / "s", tmp_path / "dump", form="criu-dir", ref="local/x:1", follower=follower,
                         on_blob=lambda d: None)
    assert seen == {min(mine + 6, 19)}  # packs are committed (and their uploads queued) on the writer's threads
    assert thread_nice() == mine


def test_store_reports_its_phases(tmp_path: Path) -> None:
    FakeCriu(tmp_path / "dump", pause_s=0).run()
    follower = DumpFollower(OciStore(tmp_path / "s"), tmp_path / "dump", compress=False).start()
    phases: dict[str, float] = {}
    api.store_checkpoint(tmp_path / "s", tmp_path / "dump", form="criu-dir", ref="local/x:1", follower=follower, timings=phases)
    assert list(phases) == list(api.STORE_PHASES) and all(v >= 0 for v in phases.values())
    plain: dict[str, float] = {}
    api.store_checkpoint(tmp_path / "s2", tmp_path / "dump", form="criu-dir", ref="local/x:1", timings=plain)
    assert list(plain) == list(api.STORE_PHASES[1:])  # nothing was followed


def _wait(cond: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _materialized(store_dir: Path, ref: str, out: Path) -> dict[str, bytes]:
    api.materialize_checkpoint(store_dir, ref, out, form="criu-dir")
    return {f.name: f.read_bytes() for f in out.iterdir()}


def _appear_whole(path: Path, data: bytes) -> None:
    """How engines.upper.pack_upper publishes its archive: a hidden name, then a rename."""
    hidden = path.with_name(f".{path.name}.partial")
    hidden.write_bytes(data)
    hidden.replace(path)


def test_the_follower_takes_the_rest_itself_once_criu_writes_stats_dump(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    follower = DumpFollower(OciStore(tmp_path / "s"), dump, compress=False, poll_s=0.001).start()
    FakeCriu(dump, pause_s=0).run()
    time.sleep(0.05)
    assert not follower.dump_over, "without stats-dump the last file may still grow"
    (dump / "stats-dump").write_bytes(b"stats")
    _wait(lambda: follower.dump_over, "the follower to finish the pages files on its own thread")
    assert all(t.done for t in follower.tracks.values())
    phases: dict[str, float] = {}
    digest = api.store_checkpoint(tmp_path / "s", dump, form="criu-dir", ref="local/x:1", follower=follower, timings=phases).digest
    assert _artifact(tmp_path / "s", digest) == _store_finished(tmp_path, dump, "finished")
    from gpusnap.packaging.follow import AFTER_DUMP

    assert list(phases) == [api.STORE_PHASES[0], api.BESIDE_RUNTIME + AFTER_DUMP[0], *api.STORE_PHASES[1:]]


def test_a_large_file_that_appears_whole_after_the_dump_is_packed_before_the_store(tmp_path: Path) -> None:
    from gpusnap.packaging.artifact import LARGE_FILE

    dump = tmp_path / "dump"
    follower = DumpFollower(OciStore(tmp_path / "s"), dump, compress=False, poll_s=0.001).start()
    FakeCriu(dump, pause_s=0).run()
    (dump / "stats-dump").write_bytes(b"stats")
    layer = random.Random(8).randbytes(LARGE_FILE + 12345)  # the writable layer's archive, packed after the dump
    _appear_whole(dump / "rootfs-upper.tar", layer)
    (dump / "gpusnap.json").write_bytes(b"{}")  # small files stay for the tar layers
    _wait(lambda: "rootfs-upper.tar" in follower.extras, "the follower to pack the archive")
    assert set(follower.extras) == {"rootfs-upper.tar"}
    phases: dict[str, float] = {}
    stored = api.store_checkpoint(tmp_path / "s", dump, form="criu-dir", ref="local/x:1", follower=follower, timings=phases)
    from gpusnap.packaging.follow import AFTER_DUMP

    assert phases[api.BESIDE_RUNTIME + AFTER_DUMP[1]] > 0
    layers, config = _artifact(tmp_path / "s", stored.digest)
    finished_layers, finished_config = _store_finished(tmp_path, dump, "finished")
    assert config == finished_config  # the same files, sizes and roles
    def tars(ls: list[dict]) -> list[str]:
        return sorted(d["digest"] for d in ls if d["mediaType"].endswith(".tar"))

    assert tars(layers) and tars(layers) == tars(finished_layers)  # the same tar layers (the packs are cut apart by the dump's end)
    assert _materialized(tmp_path / "s", "local/x:1", tmp_path / "out") == {f.name: f.read_bytes() for f in dump.iterdir()}


def test_a_large_file_changed_after_it_was_packed_is_stored_from_the_finished_files(tmp_path: Path) -> None:
    from gpusnap.packaging.artifact import LARGE_FILE

    dump = tmp_path / "dump"
    follower = DumpFollower(OciStore(tmp_path / "s"), dump, compress=False, poll_s=0.001).start()
    FakeCriu(dump, pause_s=0).run()
    (dump / "stats-dump").write_bytes(b"stats")
    (dump / "blob.bin").write_bytes(random.Random(9).randbytes(LARGE_FILE))  # written in place (not how gpusnap writes)
    _wait(lambda: "blob.bin" in follower.extras, "the follower to pack the file")
    with open(dump / "blob.bin", "r+b") as f:
        f.write(b"changed")
    stored = api.store_checkpoint(tmp_path / "s", dump, form="criu-dir", ref="local/x:1", follower=follower)
    assert stored.digest
    assert _materialized(tmp_path / "s", "local/x:1", tmp_path / "out") == {f.name: f.read_bytes() for f in dump.iterdir()}


def test_a_file_gone_between_the_listing_and_its_stat_hides_no_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os as os_module

    dump = tmp_path / "dump"
    FakeCriu(dump, pause_s=0).run()
    real = os_module.scandir

    class Gone:
        """A listing's entry for a file renamed away before its stat (pack_upper's partial file)."""

        name = "zz-renamed.bin"

        def stat(self, follow_symlinks: bool = True) -> os_module.stat_result:
            raise FileNotFoundError(self.name)

    class Listing(list):  # type: ignore[type-arg]
        def __enter__(self) -> "Listing":
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    seen: list[int] = []

    def scandir(path: object = ".") -> Listing:
        entries = Listing(real(path))  # type: ignore[arg-type]
        if Path(str(path)) == dump and (dump / "stats-dump").exists():
            entries.append(Gone())
            seen.append(1)
        return entries

    from gpusnap.packaging.artifact import LARGE_FILE

    monkeypatch.setattr(os_module, "scandir", scandir)
    follower = DumpFollower(OciStore(tmp_path / "s"), dump, compress=False, poll_s=0.001).start()
    (dump / "stats-dump").write_bytes(b"stats")
    _appear_whole(dump / "rootfs-upper.tar", random.Random(3).randbytes(LARGE_FILE))
    _wait(lambda: "rootfs-upper.tar" in follower.extras, "the follower to pack the archive beside the vanished entry")
    monkeypatch.setattr(os_module, "scandir", real)
    assert seen
    stored = api.store_checkpoint(tmp_path / "s", dump, form="criu-dir", ref="local/x:1", follower=follower)
    assert _materialized(tmp_path / "s", "local/x:1", tmp_path / "out") == {f.name: f.read_bytes() for f in dump.iterdir()}
    assert stored.digest


def test_follow_checkpoint_sizes_its_writer_by_the_workers_asked_for(tmp_path: Path) -> None:
    """`store_workers` (GPUSNAP_STORE_WORKERS) reaches the follower's pack writer: its read,
    hash and seal pools have that many threads."""
    follower = api.follow_checkpoint(tmp_path / "s", tmp_path / "dump", workers=3)
    try:
        deadline = time.monotonic() + 10
        while follower.writer is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert follower.writer is not None and follower.writer.workers == 3
        assert follower.writer.pool._max_workers == 3 and follower.writer.sealers._max_workers == 3
    finally:
        follower.abort()
        follower.close()


@pytest.mark.parametrize(("cores", "want"), [(1, 1), (2, 2), (4, 2), (16, 2), (128, 2)])
def test_a_follower_reads_on_two_threads_while_the_dump_runs(tmp_path: Path, cores: int, want: int) -> None:
    from gpusnap.packaging.follow import beside_dump_workers

    assert beside_dump_workers(cores) == want
    # no count asked for: this host's, then every core once the dump has ended
    f = DumpFollower(OciStore(tmp_path / "s"), tmp_path / "dump", compress=False)
    assert f.workers == beside_dump_workers() and f.workers_after == usable_cores()
    # a count asked for holds after the dump too
    assert DumpFollower(OciStore(tmp_path / "s"), tmp_path / "dump", compress=False, workers=3).workers_after == 3


def test_the_follower_widens_its_writer_to_every_core_once_the_dump_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Few threads beside CRIU, then all of them for the pages left once stats-dump appears."""
    from gpusnap.packaging import follow as follow_mod

    monkeypatch.setattr(follow_mod, "usable_cores", lambda: 5)
    dump = tmp_path / "dump"
    dump.mkdir()
    follower = DumpFollower(OciStore(tmp_path / "s"), dump, compress=False, poll_s=0.001).start()
    try:
        _wait(lambda: follower.writer is not None, "the follower's writer")
        assert follower.writer.workers == 2
        (dump / "stats-dump").write_bytes(b"stats")
        _wait(lambda: follower.dump_over, "the follower to see the dump end")
        assert follower.writer.workers == 5 and follower.writer.pool._max_workers == 5
    finally:
        follower.abort()
        follower.close()
