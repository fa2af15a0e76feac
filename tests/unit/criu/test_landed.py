"""gpusnap.criu.landed: what of the pages files a writer has put in place, told to the engine
(in this process) and to the page server (through the ledger file)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from gpusnap.criu.landed import Intervals, LandedFailed, LandedPages, LedgerFollower, eager_ranges
from gpusnap.criu.pagemap import PE_LAZY, PE_PRESENT

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: criu_images
from criu_images import pagemap  # noqa: E402

PAGE = 4096


def test_intervals_merge_touching_and_overlapping_ranges() -> None:
    iv = Intervals()
    for lo, hi in [(10, 20), (30, 40), (20, 25), (50, 60), (24, 31), (0, 0)]:
        iv.add(lo, hi)
    assert (iv.los, iv.his) == ([10, 50], [40, 60])
    assert iv.run_end(12, 100) == 40 and iv.run_end(45, 100) == 45 and iv.run_end(5, 100) == 5 and iv.run_end(55, 58) == 58
    assert iv.covers(10, 40) and not iv.covers(10, 41) and iv.covers(7, 7)
    assert iv.overlaps(39, 45) and not iv.overlaps(40, 50) and iv.overlaps(0, 11) and not iv.overlaps(60, 70)


def _images(tmp: Path) -> Path:
    d = tmp / "images"
    d.mkdir()
    # process 1: a lazy heap, then an eager stack (pages 4..6 of pages-1.img); process 2: all lazy.
    (d / "pagemap-1.img").write_bytes(pagemap(1, [(0x10000, 4, PE_PRESENT | PE_LAZY, False), (0x7FF000, 2, PE_PRESENT, False)]))
    (d / "pagemap-2.img").write_bytes(pagemap(2, [(0x10000, 8, PE_PRESENT | PE_LAZY, False)]))
    return d


def test_eager_ranges_are_the_pages_criu_copies_itself(tmp_path: Path) -> None:
    assert eager_ranges(_images(tmp_path)) == {"pages-1.img": [(4 * PAGE, 6 * PAGE)]}


def test_wait_eager_returns_once_crius_own_pages_are_in(tmp_path: Path) -> None:
    images = _images(tmp_path)
    landed = LandedPages(tmp_path / "ledger")
    landed.add("pages-1.img", 0, 4 * PAGE)  # lazy pages: not what CRIU waits for
    landed.add("pages-1.img", 4 * PAGE, PAGE + 10)
    done = threading.Event()
    t = threading.Thread(target=lambda: (landed.wait_eager(images), done.set()), daemon=True)
    t.start()
    assert not done.wait(0.2)
    landed.add("pages-1.img", 5 * PAGE + 10, PAGE - 10)
    assert done.wait(5)
    landed.add("rootfs-upper.tar", 0, 100)  # not a pages file: not in the ledger
    landed.complete()
    landed.close()
    f = LedgerFollower(landed.path)
    assert f.read() == [("+", "pages-1.img", 0, 4 * PAGE), ("+", "pages-1.img", 4 * PAGE, PAGE + 10),
                        ("+", "pages-1.img", 5 * PAGE + 10, PAGE - 10), ("=", "", 0, 0)]
    assert f.read() == []
    f.close()


def test_a_failed_writer_ends_the_wait_with_its_reason(tmp_path: Path) -> None:
    images = _images(tmp_path)
    landed = LandedPages(tmp_path / "ledger")
    threading.Timer(0.1, lambda: landed.fail("no space left on device\nwhile writing")).start()
    with pytest.raises(LandedFailed, match="no space left on device"):
        landed.wait_eager(images, timeout=10)
    landed.complete()  # after a failure: the failure stands
    assert LedgerFollower(landed.path).read() == [("!", "no space left on device while writing", 0, 0), ("=", "", 0, 0)]
    with pytest.raises(LandedFailed, match="no space"):
        landed.wait_eager(images, timeout=1)


def test_wait_eager_with_unreadable_pagemaps_waits_for_everything(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "pagemap-1.img").write_bytes(b"\x01\x02")
    landed = LandedPages(tmp_path / "ledger")
    with pytest.raises(LandedFailed, match="within 0.2 s"):
        landed.wait_eager(images, timeout=0.2)
    assert landed.first(images) == {}
    landed.complete()
    assert landed.wait_eager(images, timeout=1) >= 0


def test_the_follower_keeps_a_line_cut_in_two_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    path.write_bytes(b"+ pages-3.img 4096 81")
    f = LedgerFollower(path)
    assert f.read() == []
    with open(path, "ab") as w:
        w.write(b"92\n=\n")
    assert f.read() == [("+", "pages-3.img", 4096, 8192), ("=", "", 0, 0)]
    with open(path, "ab") as w:
        w.write(b"what\n")
    with pytest.raises(ValueError, match="bad ledger line"):
        f.read()
    f.close()
