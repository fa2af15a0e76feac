"""A restore's image directory in two stages: every file but the pages files first, then the
pages files (artifact.write_directory_pieced with ``staged``), and a stop on request."""

from __future__ import annotations

import os
import random
import sys
import threading
from pathlib import Path

import pytest

from gpusnap.errors import IntegrityError
from gpusnap.packaging import api
from gpusnap.packaging import artifact as fmt
from gpusnap.packaging import layout as lay
from gpusnap.packaging.pack import PAGE
from gpusnap.criu.pagemap import PE_PRESENT
from gpusnap.packaging.store import OciStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: criu_images
from criu_images import pagemap as _pagemap  # noqa: E402


def _checkpoint(path: Path) -> Path:
    """pages-1.img of 6 MiB, a 3 MiB rootfs-upper.tar (chunked: LARGE_FILE is lowered), small files."""
    rng = random.Random(7)
    path.mkdir(parents=True)
    ranges = [(0x10000000, rng.randbytes(3 << 20)), (0x20000000, bytes(1 << 20)), (0x30000000, rng.randbytes(2 << 20))]
    (path / "pages-1.img").write_bytes(b"".join(d for _, d in ranges))
    (path / "pagemap-1.img").write_bytes(_pagemap(1, [(va, len(d) // PAGE, PE_PRESENT, False) for va, d in ranges]))
    (path / "rootfs-upper.tar").write_bytes(rng.randbytes(3 << 20))
    (path / "runc-direct.json").write_text('{"record": {}}')
    (path / "pstree.img").write_bytes(b"")
    (path / "core-1.img").write_bytes(b"core")
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setattr(fmt, "LARGE_FILE", 1 << 20)
    src = _checkpoint(tmp_path / "src")
    api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/staged")
    return src, tmp_path / "s"


def test_staged_puts_every_other_file_in_place_before_the_pages(stored: tuple[Path, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    src, store = stored
    want = _files(src)
    dest = tmp_path / "out"
    gate = threading.Event()
    seen: dict[str, bytes] = {}
    placed = lay.place_stream

    def slow_pages(plan: lay.BlobPlan, stream: object, fd_for: object, on_written: object = None) -> int:
        if all(p.path.startswith("pages-") for p in plan.placements):
            assert gate.wait(10), "the pages were placed before staged() was called"
        return placed(plan, stream, fd_for, on_written)  # type: ignore[arg-type]

    def staged() -> None:
        assert dest.is_dir()
        seen.update({k: v for k, v in _files(dest).items() if not k.startswith("pages-")})
        gate.set()

    monkeypatch.setattr(lay, "place_stream", slow_pages)
    out = api.materialize_checkpoint(store, "gs-pkg/staged", dest, form="criu-dir", staged=staged)
    assert gate.is_set()
    assert seen == {k: v for k, v in want.items() if not k.startswith("pages-")}
    assert "rootfs-upper.tar" in seen  # a chunked file, yet in the first stage
    assert _files(out) == want
    assert not list(tmp_path.glob(".out.partial-*"))


def test_a_pages_failure_after_staged_leaves_nothing(stored: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, store = stored
    placed = lay.place_stream

    def bad_pages(plan: lay.BlobPlan, stream: object, fd_for: object, on_written: object = None) -> int:
        if all(p.path.startswith("pages-") for p in plan.placements):
            raise IntegrityError("pages-1.img at 0: piece digest mismatch")
        return placed(plan, stream, fd_for, on_written)  # type: ignore[arg-type]

    monkeypatch.setattr(lay, "place_stream", bad_pages)
    calls: list[bool] = []
    cancel = threading.Event()
    with pytest.raises(IntegrityError, match="digest mismatch"):
        api.materialize_checkpoint(store, "gs-pkg/staged", tmp_path / "out", form="criu-dir", staged=lambda: calls.append(True),
                                   cancel=cancel)
    assert calls == [True]  # it was renamed into place, then removed again
    assert not cancel.is_set()  # the caller's stop is the caller's: a failure is told apart from a stop (ImageJob.failed)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_cancel_stops_the_writers_and_leaves_nothing(stored: tuple[Path, Path], tmp_path: Path) -> None:
    _, store = stored
    cancel = threading.Event()
    with pytest.raises(lay.Cancelled):
        api.materialize_checkpoint(store, "gs-pkg/staged", tmp_path / "out", form="criu-dir", staged=cancel.set, cancel=cancel)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_without_staged_the_directory_appears_whole(stored: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, store = stored
    placed = lay.place_stream
    dest = tmp_path / "out"

    def check(plan: lay.BlobPlan, stream: object, fd_for: object, on_written: object = None) -> int:
        assert not dest.exists()
        return placed(plan, stream, fd_for, on_written)  # type: ignore[arg-type]

    monkeypatch.setattr(lay, "place_stream", check)
    assert _files(api.materialize_checkpoint(store, "gs-pkg/staged", dest, form="criu-dir")) == _files(src)


def test_split_stages_keeps_mixed_packs_first() -> None:
    def pl(path: str) -> lay.Placement:
        return lay.Placement(path, 0, 0, 1, 1, False, None)

    from gpusnap.packaging.store import Descriptor

    d = Descriptor(lay.MEDIA_PACK, "sha256:" + "0" * 64, 1)
    mixed, pages, other = (lay.BlobPlan(d, [pl("pages-1.img"), pl("x.tar")]), lay.BlobPlan(d, [pl("pages-1.img")]),
                           lay.BlobPlan(d, [pl("x.tar")]))
    first, rest = lay.split_stages([pages, mixed, other], {"pages-1.img"})
    assert first == [mixed, other] and rest == [pages]
    assert lay.split_stages([pages, mixed], set()) == ([pages, mixed], [])


def _placements(pieces: list[tuple[str, int, bytes]]) -> tuple[lay.BlobPlan, bytes]:
    """A blob holding ``pieces`` (path, file offset, raw bytes) back to back, uncompressed."""
    import hashlib

    from gpusnap.packaging.store import Descriptor

    blob, pls, at = b"", [], 0
    for path, off, raw in pieces:
        pls.append(lay.Placement(path, off, at, len(raw), len(raw), False, hashlib.sha256(raw).digest()))
        blob += raw
        at += len(raw)
    return lay.BlobPlan(Descriptor(lay.MEDIA_PACK, "sha256:" + "0" * 64, len(blob)), pls), blob


def test_place_stream_writes_runs_of_pieces_with_one_call_and_verifies_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    rng = random.Random(3)
    a, b, c, d = (rng.randbytes(128 << 10) for _ in range(4))
    # a, b, c back to back in x (one run), then d elsewhere in x, then d again (a duplicate) in y
    plan, blob = _placements([("x", 0, a), ("x", len(a), b), ("x", len(a) + len(b), c), ("x", 1 << 20, d)])
    plan.placements.append(lay.Placement("y", 4096, plan.placements[-1].blob_offset, len(d), len(d), False,
                                         plan.placements[-1].digest))
    fds = {p: os.open(tmp_path / p, os.O_RDWR | os.O_CREAT, 0o600) for p in ("x", "y")}
    calls: list[tuple[int, int]] = []
    real = lay.pwrite_all
    monkeypatch.setattr(lay, "pwrite_all", lambda fd, data, off: (calls.append((off, len(data))), real(fd, data, off))[1])
    try:
        assert lay.place_stream(plan, io.BytesIO(blob), fds.__getitem__) == 5 * (128 << 10)
    finally:
        for fd in fds.values():
            os.close(fd)
    x = (tmp_path / "x").read_bytes()
    assert x[: 3 * len(a)] == a + b + c and x[1 << 20:] == d and (tmp_path / "y").read_bytes()[4096:] == d
    assert calls == [(0, 3 * (128 << 10)), (1 << 20, 128 << 10), (4096, 128 << 10)]

    # one byte changed in the middle piece of the run: refused before any of the run is written
    bad = bytearray(blob)
    bad[len(a) + 10] ^= 1
    (tmp_path / "x").unlink()
    calls.clear()
    fd = os.open(tmp_path / "x", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(IntegrityError, match="digest mismatch"):
            lay.place_stream(plan, io.BytesIO(bytes(bad)), lambda _p: fd)
    finally:
        os.close(fd)
    assert calls == [] and (tmp_path / "x").stat().st_size == 0


class Recorder:
    """A lazy restore's ledger (gpusnap.criu.landed.LandedPages) that checks what it is told:
    each range reported is already written, with the checkpoint's bytes."""

    def __init__(self, dest: Path, want: dict[str, bytes]) -> None:
        self.dest, self.want = dest, want
        self.spans: list[tuple[str, int, int]] = []
        self.asked_first = 0
        self.mu = threading.Lock()

    def add(self, name: str, offset: int, length: int) -> None:
        for _ in range(3):  # the first stage may be renamed into place between the look and the open
            partial = list(self.dest.parent.glob(f".{self.dest.name}.partial-*"))
            root = partial[0] if partial and not self.dest.exists() else self.dest
            try:
                with open(root / name, "rb") as f:
                    f.seek(offset)
                    data = f.read(length)
                break
            except FileNotFoundError:
                continue
        assert data == self.want[name][offset:offset + length], f"{name} at {offset} reported before it was written"
        with self.mu:
            self.spans.append((name, offset, length))

    def wanted(self) -> list[tuple[str, int]]:
        return []

    def first(self, images: Path) -> dict[str, list[tuple[int, int]]]:
        from gpusnap.criu.landed import eager_ranges

        self.asked_first += 1
        return eager_ranges(images)


def test_a_lazy_restore_is_told_every_range_of_the_pages_once_it_is_in(stored: tuple[Path, Path], tmp_path: Path) -> None:
    from gpusnap.criu.landed import Intervals

    src, store = stored
    want = _files(src)
    dest = tmp_path / "out"
    rec = Recorder(dest, want)
    api.materialize_checkpoint(store, "gs-pkg/staged", dest, form="criu-dir", staged=lambda: None, landed=rec)
    assert rec.asked_first == 1
    got = Intervals()
    for name, off, length in rec.spans:
        if name == "pages-1.img":  # LandedPages keeps only the pages files
            got.add(off, off + length)
    assert got.covers(0, len(want["pages-1.img"]))
    assert (3 << 20, 4 << 20) in [(o, o + n) for _, o, n in rec.spans]  # the zero MiB: a hole, told at once


def test_wanted_first_puts_the_blobs_crius_own_pages_are_in_first() -> None:
    from gpusnap.packaging.store import Descriptor

    def blob(i: int, *spans: tuple[str, int, int]) -> lay.BlobPlan:
        return lay.BlobPlan(Descriptor("x", f"sha256:{i:064x}", 1), [lay.Placement(path, off, 0, n, n, False, None) for path, off, n in spans])

    blobs = [blob(0, ("pages-1.img", 0, 100)), blob(1, ("pages-1.img", 100, 100)), blob(2, ("pages-2.img", 0, 50)), blob(3, ("pages-1.img", 200, 100))]
    order = lay.wanted_first(blobs, {"pages-1.img": [(150, 160), (290, 300)], "pages-3.img": [(0, 10)]})
    assert [b.descriptor.digest[-1] for b in order] == ["1", "3", "0", "2"]
    assert lay.wanted_first(blobs, {}) == blobs
    assert lay.written_spans(blob(9, ("b", 10, 5), ("a", 0, 4), ("a", 4, 4), ("a", 20, 1))) == [("a", 0, 8), ("a", 20, 1), ("b", 10, 5)]


def test_the_blob_queue_hands_out_first_what_the_restored_process_waits_for() -> None:
    from gpusnap.packaging.store import Descriptor

    def blob(i: int, off: int) -> lay.BlobPlan:
        return lay.BlobPlan(Descriptor("x", f"sha256:{i:064x}", 1), [lay.Placement("pages-1.img", off, 0, 100, 100, False, None)])

    blobs = [blob(i, i * 100) for i in range(6)]
    asks = [[], [("pages-1.img", 450), ("pages-1.img", 320), ("other.img", 5)], [("pages-1.img", 40)], []]
    q = lay.BlobQueue(blobs, lambda: asks.pop(0) if asks else [])
    got = [q.take()]  # 0: in order
    q.put_first({"pages-1.img": [(210, 220)]})  # CRIU's own pages: 2 next, then the rest in order
    got += [q.take() for _ in range(5)]  # asked: 4 then 3 (in the order asked); 0 is out already
    assert [b.placements[0].file_offset // 100 for b in got] == [0, 4, 3, 2, 1, 5]
