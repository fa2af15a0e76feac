"""ckdiff on image directories written here in CRIU's format (tests/integration/packaging has
the same on images CRIU dumped)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpusnap.packaging import ckdiff
from gpusnap.packaging.ckdiff import FILES_MAGIC, MM_MAGIC, PAGE
from gpusnap.criu.pagemap import PAGEMAP_MAGIC, PE_LAZY, PE_PARENT, PE_PRESENT

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: criu_images
from criu_images import field_bytes as _b  # noqa: E402
from criu_images import field_varint as _v  # noqa: E402
from criu_images import image as _image  # noqa: E402

BASE = 0x7F0000000000
HEAP = 0x1000000










def page(tag: int) -> bytes:
    return bytes(PAGE) if tag == 0 else tag.to_bytes(4, "little") * (PAGE // 4)


def write_images(d: Path, ranges: list[tuple[int, list[int], int]], *, extra: dict[str, bytes] | None = None, criu42: bool = False) -> Path:
    """A checkpoint of pid 1: ``ranges`` of (address, page tags, pagemap flags); tag 0 is a zero page.
    Its mappings: one anonymous VMA at BASE (16 MiB), the heap, and a file mapping of /usr/lib/libx.so.
    ``criu42``: page counts the way CRIU 4.2 writes them (field 5, field 2 zero)."""
    d.mkdir(parents=True)
    entries = [_v(1, 1)]  # pagemap_head: pages_id 1
    data = bytearray()
    for addr, tags, flags in ranges:
        count = _v(2, 0) + _v(5, len(tags)) if criu42 else _v(2, len(tags))
        entries.append(_v(1, addr) + count + _v(4, flags))
        if flags & PE_PRESENT and not flags & PE_PARENT:
            data += b"".join(page(t) for t in tags)
    (d / "pagemap-1.img").write_bytes(_image(PAGEMAP_MAGIC, entries))
    (d / "pages-1.img").write_bytes(bytes(data))
    vmas = [
        _v(1, HEAP) + _v(2, HEAP + (1 << 20)) + _v(5, 3) + _v(7, 1 | 1 << 5 | 1 << 9),
        _v(1, 0x2000000) + _v(2, 0x2010000) + _v(4, 9) + _v(5, 1) + _v(7, 1 | 1 << 6),
        _v(1, BASE) + _v(2, BASE + (16 << 20)) + _v(5, 3) + _v(7, 1 | 1 << 9),
    ]
    (d / "mm-1.img").write_bytes(_image(MM_MAGIC, [_v(1, 0x400000) + b"".join(_b(14, v) for v in vmas)]))
    reg = _v(1, 9) + _v(2, 0) + _b(6, b"/usr/lib/libx.so")
    (d / "files.img").write_bytes(_image(FILES_MAGIC, [_v(1, 1) + _v(2, 9) + _b(3, reg)]))
    for name, content in (extra or {}).items():
        (d / name).write_bytes(content)
    return d


def test_pages_are_classified_by_address_and_content(tmp_path: Path) -> None:
    # A: 8 pages at BASE (tags 1..8) and 2 heap pages.
    a = write_images(tmp_path / "a", [(BASE, [1, 2, 3, 4, 5, 6, 7, 8], PE_PRESENT), (HEAP, [50, 51], PE_PRESENT | PE_LAZY)],
                     extra={"core-1.img": b"core A", "same.img": b"x" * 5000})
    # B: pages 1-4 unchanged, 5-6 rewritten, 7-8 moved 1 MiB up (and their old place zeroed),
    # two new pages after them, the heap unchanged.
    b = write_images(tmp_path / "b", [(BASE, [1, 2, 3, 4, 60, 61, 0, 0], PE_PRESENT),
                                      (BASE + (1 << 20), [7, 8, 70, 70], PE_PRESENT | PE_LAZY), (HEAP, [50, 51], PE_PRESENT)],
                     extra={"core-1.img": b"core B", "same.img": b"x" * 5000})
    r = ckdiff.diff(a, b)
    assert r.pages.to_dict() == {"same": 6, "moved": 2, "changed": 4, "new": 2, "zero": 2, "total": 14}
    # Distinct contents A lacks: 60, 61, zero, 70 (twice, sent once); plus the differing core
    # image and pagemap.
    assert r.send["ideal_page_dedup_bytes"] == 4 * PAGE + len(b"core B") + (b / "pagemap-1.img").stat().st_size
    assert r.send["pages_bytes"] == 14 * PAGE
    assert r.shifts == [((1 << 20) - 6 * PAGE, 2)]  # A had them at pages 6 and 7
    by_vma = {m["vma"].split(" ", 2)[2]: m for m in r.per_mapping}
    anon = by_vma["[anon-private] (16.0 MiB)"]
    assert (anon["same"], anon["moved"], anon["changed"], anon["new"]) == (4, 2, 4, 2)
    assert by_vma["[heap,anon-private] (1.0 MiB)"]["same"] == 2
    kinds = {(g.kind, g.start, g.pages) for g in r.regions}
    assert kinds == {("changed", BASE + 4 * PAGE, 4), ("moved", BASE + (1 << 20), 2), ("new", BASE + (1 << 20) + 2 * PAGE, 2)}
    files = {f.name: f for f in r.files}
    assert files["same.img"].status == "identical"
    assert files["core-1.img"].status == "differs" and files["core-1.img"].first_difference == 0
    # At the same offsets only the first 4 pages of the pages file match: a byte-wise view sees
    # 10 of 14 blocks differ where page by page only 6 contents are new to A.
    assert files["pages-1.img"].blocks_differing == 10
    text = ckdiff.format_report(r)
    assert "same 6 (42.9%), moved 2 (14.3%), changed 4 (28.6%), new 2 (14.3%)" in text
    assert "ideal page-level dedup" in text


@pytest.mark.parametrize("criu42", [False, True])
def test_parent_pages_are_not_in_the_pages_file_and_file_mappings_are_named(tmp_path: Path, criu42: bool) -> None:
    a = write_images(tmp_path / "a", [(0x2000000, [5, 6], PE_PRESENT), (BASE, [1, 2], PE_PARENT)], criu42=criu42)
    b = write_images(tmp_path / "b", [(BASE, [9, 9, 9], PE_PARENT), (0x2000000, [5, 7], PE_PRESENT)], criu42=criu42)
    (pm,) = ckdiff.read_pagemaps(b)
    assert [(x.vaddr, x.pages, x.offset) for x in pm.ranges] == [(0x2000000, 2, 0)]
    r = ckdiff.diff(a, b)
    assert r.pages.to_dict()["total"] == 2
    assert r.per_mapping[0]["vma"].endswith("r-- /usr/lib/libx.so (64 KiB)")
    assert (r.per_mapping[0]["same"], r.per_mapping[0]["changed"]) == (1, 1)


def test_fixed_pieces_count_every_window_with_a_page_a_lacks(tmp_path: Path) -> None:
    tags = list(range(1, 33))  # 32 pages = 128 KiB: two 64 KiB windows
    a = write_images(tmp_path / "a", [(BASE, tags, PE_PRESENT)])
    b = write_images(tmp_path / "b", [(BASE, tags[:20] + [99] + tags[21:], PE_PRESENT)])
    r = ckdiff.diff(a, b)
    assert r.windows["64k"] == 1 and r.windows["64k_total"] == 2
    assert r.send["fixed_64k_pieces_bytes"] == 64 * 1024
    assert r.send["fixed_1024k_pieces_bytes"] == 32 * PAGE  # one window, shorter than 1 MiB: the whole stream


def test_only_in_one_and_truncated_pages_file(tmp_path: Path) -> None:
    a = write_images(tmp_path / "a", [(BASE, [1], PE_PRESENT)], extra={"old.img": b"o"})
    b = write_images(tmp_path / "b", [(BASE, [1], PE_PRESENT)], extra={"new.img": b"nn"})
    r = ckdiff.diff(a, b)
    st = {f.name: (f.status, f.size_a, f.size_b) for f in r.files}
    assert st["old.img"] == ("only-a", 1, None) and st["new.img"] == ("only-b", None, 2)
    (b / "pages-1.img").write_bytes(b"")
    with pytest.raises(ckdiff.ImageFormatError, match="shorter"):
        ckdiff.diff(a, b)


def test_main_writes_json_and_refuses_what_is_not_an_image(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_images(tmp_path / "a", [(BASE, [1, 2], PE_PRESENT)])
    b = write_images(tmp_path / "b", [(BASE, [1, 3], PE_PRESENT)])
    out = tmp_path / "r.json"
    assert ckdiff.main([str(a), str(b), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["pages"] == {"same": 1, "moved": 0, "changed": 1, "new": 0, "zero": 0, "total": 2}
    assert "pages of B: 2" in capsys.readouterr().out
    (b / "mm-1.img").write_bytes(b"not an image at all")
    assert ckdiff.main([str(a), str(b)]) == 2
    assert "mm-1.img: not a CRIU image" in capsys.readouterr().err
