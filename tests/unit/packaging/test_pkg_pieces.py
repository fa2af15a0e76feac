"""Format v2: pagemap parsing, page-granular cutting, packed pieces, dedup, verification, v1 compat."""

from __future__ import annotations

import sys

import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from gpusnap.errors import IntegrityError
from gpusnap.packaging import api
from gpusnap.packaging import artifact as fmt
from gpusnap.packaging import layout as lay
from gpusnap.packaging.pack import PAGE, PackParams, PageCutter, page_features
from gpusnap.criu.pagemap import PE_LAZY, PE_PARENT, PE_PRESENT, boundaries, merge_contiguous, parse_pagemap
from gpusnap.packaging.store import OciStore

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: criu_images
from criu_images import pagemap as _pagemap  # noqa: E402








def _checkpoint(path: Path, ranges: list[tuple[int, bytes]]) -> Path:
    """A CRIU-like directory whose pages-1.img holds ``ranges`` (vaddr, bytes) in that order."""
    path.mkdir(parents=True)
    (path / "pages-1.img").write_bytes(b"".join(data for _, data in ranges))
    (path / "pagemap-1.img").write_bytes(_pagemap(1, [(va, len(d) // PAGE, PE_PRESENT, False) for va, d in ranges]))
    (path / "pstree.img").write_bytes(b"")
    (path / "core-1.img").write_bytes(b"core")
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# ---- pagemap ------------------------------------------------------------------------------------
def test_pagemap_of_a_real_criu_dump() -> None:
    # Written by `criu dump --leave-running` (CRIU 4.1.1) of a python3 process on this host;
    # its pages-1.img was 13332480 bytes.
    data = (DATA / "pagemap-criu-4.1.1.img").read_bytes()
    pages_id, ranges = parse_pagemap(data)
    assert pages_id == 1 and len(ranges) == 80
    assert sum(r.nr_pages for r in ranges) * PAGE == 13332480
    assert [r.file_offset for r in ranges] == sorted(r.file_offset for r in ranges) and ranges[0].file_offset == 0
    merged = merge_contiguous(ranges)
    assert 0 < len(merged) < len(ranges)  # CRIU's 256-page splits of one mapping are joined
    assert all(m.vaddr + m.nr_pages * PAGE != n.vaddr for m, n in zip(merged, merged[1:]))
    starts = boundaries({"pagemap-1.img": data}, "pages-1.img", 13332480)
    assert starts is not None and starts[0] == 0 and len(starts) == len(merged)
    assert boundaries({"pagemap-1.img": data}, "pages-1.img", 13332480 + PAGE) is None  # does not add up: ignored
    assert boundaries({"pagemap-1.img": data}, "pages-2.img", 13332480) is None


def test_pagemap_of_a_real_criu_4_2_gpu_dump() -> None:
    # pagemap-1.img of a GPU inference server (GPT-2 large under gpusnap run, H100, CRIU 4.2.1,
    # from the issue-12 diagnosis): 10839 entries PE_LAZY|PE_PRESENT, 423 PE_PRESENT, page
    # counts in field 5. Its pages-8.img held 1257942 pages.
    data = (DATA / "pagemap-criu-4.2-gpu.img").read_bytes()
    pages_id, ranges = parse_pagemap(data)
    assert pages_id == 8 and sum(r.nr_pages for r in ranges) == 1257942
    assert len(ranges) > 11000 and all(r.nr_pages > 0 for r in ranges)
    merged = merge_contiguous(ranges)
    assert len(merged) < 0.6 * len(ranges)
    assert boundaries({"pagemap-1.img": data}, "pages-8.img", 1257942 * PAGE) == [r.file_offset // PAGE for r in merged]


def test_pagemap_keeps_only_entries_whose_pages_are_in_the_file() -> None:
    img = _pagemap(3, [
        (0x1000, 2, PE_PRESENT, False),
        (0x10000, 5, PE_PARENT, False),  # in the parent image: no room in this file
        (0x20000, 7, PE_LAZY, False),  # lazy, not dumped
        (0x30000, 3, PE_LAZY | PE_PRESENT, False),
        (0x40000, 4, None, True),  # image from before flags: in_parent
        (0x50000, 6, None, False),  # image from before flags: present
    ])
    pages_id, ranges = parse_pagemap(img)
    assert pages_id == 3
    assert [(r.vaddr, r.file_offset // PAGE, r.nr_pages) for r in ranges] == [(0x1000, 0, 2), (0x30000, 2, 3), (0x50000, 5, 6)]


def test_pagemap_entries_read_in_place_equal_the_general_decoder() -> None:
    """The pagemap reader's in-place loop (pagemap._entry_fields) against decode_message on
    random entries: every field order, flags or not, in_parent, CRIU 4.2's count, repeated and
    unknown fields (varint, fixed and length-delimited: those go to the general decoder)."""
    from criu_images import field_bytes, field_varint
    from gpusnap.criu import pagemap as pm
    from gpusnap.criu.images import decode_message

    rng = random.Random(11)
    for _ in range(3000):
        fields = [field_varint(1, rng.choice([0, 0x1000, 0x7F0000000000 + rng.randrange(1 << 30) * PAGE, (1 << 64) - PAGE]))]
        if rng.random() < 0.9:
            fields.append(field_varint(2, rng.choice([0, 1, 127, 128, 300000, (1 << 32) - 1])))
        if rng.random() < 0.2:
            fields.append(field_varint(3, rng.choice([0, 1])))
        if rng.random() < 0.7:
            fields.append(field_varint(4, rng.choice([PE_PRESENT, PE_LAZY, PE_PARENT, PE_LAZY | PE_PRESENT, 0])))
        if rng.random() < 0.2:
            fields.append(field_varint(5, rng.choice([0, 5, 1 << 40])))
        if rng.random() < 0.1:
            fields.append(rng.choice([field_varint(1, 0x2000), field_varint(9, 3), field_varint(20, 1), field_bytes(6, b"xy"),
                                      b"\x31" + bytes(8), b"\x35" + bytes(4)]))
        rng.shuffle(fields)
        msg = b"".join(fields)
        fast = pm._entry_fields(bytearray(msg), 0, len(msg))
        try:
            slow = pm._entry_of(decode_message(msg))
        except Exception as exc:  # noqa: BLE001 - the general decoder's verdict, the fast one must defer to it
            assert fast is None, (msg, exc)
            continue
        assert fast is None or fast == slow, (msg, fast, slow)


def test_ranges_of_reads_only_the_pagemap_that_names_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint of several processes has a pagemap each; a pages file's ranges parse its own
    pagemap only (each pages file used to parse every pagemap before its own)."""
    from gpusnap.criu import pagemap as pm

    pagemaps = {f"pagemap-{i}.img": _pagemap(i, [(0x7F0000000000 + k * 8 * PAGE, 4, PE_PRESENT, False) for k in range(50 * i)])
                for i in (1, 2, 3)}
    parsed: list[int] = []
    real = pm.parse_pagemap
    monkeypatch.setattr(pm, "parse_pagemap", lambda data: parsed.append(len(data)) or real(data))
    for i in (3, 2, 1):
        assert sum(r.nr_pages for r in pm.ranges_of(pagemaps, f"pages-{i}.img", 200 * i * PAGE)) == 200 * i
    assert parsed == [len(pagemaps[f"pagemap-{i}.img"]) for i in (3, 2, 1)]


def test_pagemap_of_criu_4_2_reads_the_64_bit_page_count() -> None:
    img = _pagemap(8, [(0x7F0000000000, 300000, PE_LAZY | PE_PRESENT, False), (0x7F1000000000, 2, PE_PRESENT, False)], criu42=True)
    pages_id, ranges = parse_pagemap(img)
    assert pages_id == 8 and [r.nr_pages for r in ranges] == [300000, 2] and ranges[1].file_offset == 300000 * PAGE


def test_aligned_pieces_end_at_address_multiples_whatever_the_window() -> None:
    from gpusnap.packaging.pack import AlignedCutter
    from gpusnap.criu.pagemap import PageRange

    p = PackParams()
    ranges = [PageRange(0x10003000, 0, 100), PageRange(0x20000000, 100 * PAGE, 70), PageRange(0x30001000, 170 * PAGE, 40)]
    data = bytearray(_rand(210 * PAGE, 4))
    data[110 * PAGE:170 * PAGE] = bytes(60 * PAGE)  # zero pages in the second range
    def cut(window: int) -> list[tuple[int, int, bool]]:
        c, out = AlignedCutter(ranges, p.piece_pages), []
        for s0 in range(0, 210, window):
            e = min(210, s0 + window)
            z, k = page_features(memoryview(data)[s0 * PAGE:e * PAGE], e - s0, p.divisor)
            out += c.feed(z, k)
        return out + c.finish()
    pieces = cut(210)
    assert pieces == cut(1) == cut(33)
    vaddr = {0: 0x10003000, 100: 0x20000000, 170: 0x30001000}
    def va(page: int) -> int:
        base = max(b for b in vaddr if b <= page)
        return vaddr[base] + (page - base) * PAGE
    for a, b, zero in pieces:
        assert b in (100, 170, 210) or va(b) % (p.piece_pages * PAGE) == 0
        assert zero == (not any(data[a * PAGE:b * PAGE]))
    assert (132, 170, True) in pieces  # aligned zero pieces merged up to the range end


def test_aligned_cuts_are_each_range_start_and_every_aligned_address_inside_it() -> None:
    """aligned_cuts (whole arrays) against the rule, range by range, on ranges of every shape:
    shorter than a piece, starting on and off an aligned address, adjacent and apart."""
    from gpusnap.criu.pagemap import PageRange
    from gpusnap.packaging.pack import aligned_cuts

    rng = random.Random(5)
    for _ in range(200):
        ranges, va, off = [], 0x7F0000000000 + rng.randrange(1 << 16) * PAGE, 0
        for _ in range(rng.randrange(1, 40)):
            n = rng.choice([1, 31, 32, 33, 64, rng.randrange(1, 3000)])
            ranges.append(PageRange(va, off * PAGE, n))
            va += (n + rng.choice([0, 1, rng.randrange(1, 500)])) * PAGE
            off += n
        for piece in (1, 7, 32):
            want = {off}
            for r in ranges:
                s0, v = r.file_offset // PAGE, r.vaddr // PAGE
                want |= {s0} | {s0 + k for k in range(1, r.nr_pages) if (v + k) % piece == 0}
            got = aligned_cuts(ranges, piece)
            assert got.dtype == np.int64 and got.tolist() == sorted(want)


# ---- cutting ------------------------------------------------------------------------------------
def _cut(data: bytes, forced: list[int], window: int, p: PackParams = PackParams()) -> list[tuple[int, int, bool]]:
    n = len(data) // PAGE
    c = PageCutter(p, forced)
    out = []
    for s in range(0, n, window):
        e = min(n, s + window)
        z, cut = page_features(memoryview(data)[s * PAGE:e * PAGE], e - s, p.divisor)
        out += c.feed(z, cut)
    return out + c.finish()


def test_cuts_tile_the_file_and_do_not_depend_on_the_read_window() -> None:
    p = PackParams()
    data = bytearray(_rand(3000 * PAGE, 1))
    for a, b in [(100, 140), (1000, 1005), (2000, 2600), (2990, 3000)]:
        data[a * PAGE:b * PAGE] = bytes((b - a) * PAGE)
    forced = [0, 500, 777, 2300]
    pieces = _cut(bytes(data), forced, 3000)
    assert pieces == _cut(bytes(data), forced, 7) == _cut(bytes(data), forced, 1024)
    pos = 0
    for a, b, zero in pieces:
        assert a == pos
        pos = b
        assert zero == (not any(data[a * PAGE:b * PAGE])) or not zero
        if zero:
            assert b - a >= p.zero_min_pages and not any(data[a * PAGE:b * PAGE])
        else:
            assert b - a <= p.max_pages
    assert pos == 3000
    assert {a for a, _, _ in pieces} >= set(forced)  # a new range always starts a piece
    assert [(a, b) for a, b, z in pieces if z] == [(100, 140), (2000, 2300), (2300, 2600)]  # 5 zero pages stay in data
    sizes = [b - a for a, b, z in pieces if not z]
    assert 16 <= sum(sizes) / len(sizes) <= 64


def test_the_same_pages_at_another_place_give_the_same_pieces() -> None:
    body = _rand(600 * PAGE, 2)
    a = _cut(body, [0], 64)
    b = _cut(_rand(37 * PAGE, 3) + body, [0], 64)  # shifted by 37 pages, no range boundary to help
    pa = {hashlib.sha256(body[x * PAGE:y * PAGE]).digest() for x, y, _ in a}
    shifted = _rand(37 * PAGE, 3) + body
    pb = {hashlib.sha256(shifted[x * PAGE:y * PAGE]).digest() for x, y, _ in b}
    assert len(pa & pb) >= len(pa) - 2  # all but the piece(s) where the shift begins


# ---- storing and materializing -------------------------------------------------------------------
def test_reordered_ranges_and_ranges_at_other_aligned_addresses_are_not_stored_again(tmp_path: Path) -> None:
    r1, r2, r3 = _rand(4 << 20, 11), _rand(4 << 20, 12), _rand(4 << 20, 13)
    a = _checkpoint(tmp_path / "a", [(0x10000000, r1), (0x20000000, r2), (0x30000000, r3)])
    # CRIU writes them in another order, two at other addresses (128 KiB multiples), and one
    # range split into two entries at a page that is no multiple of the piece size
    b = _checkpoint(tmp_path / "b", [(0x70000000, r3), (0x50020000, r1[: 5 * PAGE]), (0x50020000 + 5 * PAGE, r1[5 * PAGE:]), (0x20000000, r2)])
    s1 = api.store_checkpoint(tmp_path / "s", a, form="criu-dir", ref="gs-pkg/a")
    s2 = api.store_checkpoint(tmp_path / "s", b, form="criu-dir", ref="gs-pkg/b", parent="gs-pkg/a")
    assert s1.new_bytes >= 12 << 20
    assert s2.new_bytes == 0, (s1.new_bytes, s2.new_bytes)
    out = api.materialize_checkpoint(tmp_path / "s", "gs-pkg/b", tmp_path / "out", form="criu-dir")
    assert _files(out) == _files(b)


def test_changed_pages_cost_their_pieces_only(tmp_path: Path) -> None:
    body = bytearray(_rand(16 << 20, 15))
    a = _checkpoint(tmp_path / "a", [(0x10000000, bytes(body))])
    for page in (7, 1000, 3001):  # three scattered pages change
        body[page * PAGE] ^= 0xFF
    b = _checkpoint(tmp_path / "b", [(0x10000000, bytes(body))])
    api.store_checkpoint(tmp_path / "s", a, form="criu-dir", ref="gs-pkg/a")
    s2 = api.store_checkpoint(tmp_path / "s", b, form="criu-dir", ref="gs-pkg/b")
    assert s2.new_bytes == 3 * PackParams().piece_pages * PAGE


def test_cdc_mode_follows_buffers_that_moved_by_any_number_of_pages(tmp_path: Path) -> None:
    r1, r2 = _rand(4 << 20, 16), _rand(4 << 20, 17)
    a = _checkpoint(tmp_path / "a", [(0x10000000, r1), (0x20000000, r2)])
    b = _checkpoint(tmp_path / "b", [(0x20000000, r2), (0x50000000 + 3 * PAGE, _rand(3 * PAGE, 18) + r1)])
    store = OciStore(tmp_path / "s")
    params = PackParams(cut="cdc")
    sizes = []
    for src in (a, b):
        with store.writing():
            built = fmt.build_artifact(store, fmt.iter_directory(src), form="criu-dir", metadata=None, compress=False,
                                       parent=None, pack_params=params)
            store.tag(f"gs-pkg/{src.name}", fmt.Descriptor(fmt.MEDIA_OCI_MANIFEST, built.manifest_digest, built.manifest_size))
        sizes.append(built.new_bytes)
    assert sizes[0] >= 8 << 20
    assert sizes[1] <= 4 * params.max_pages * PAGE, sizes  # only the pieces where r1 grew
    out = api.materialize_checkpoint(tmp_path / "s", "gs-pkg/b", tmp_path / "out", form="criu-dir")
    assert _files(out) == _files(b)


def test_a_second_store_references_pieces_where_they_lie_and_survives_gc(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "a", [(0x10000000, _rand(6 << 20, 21))])
    s1 = api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/a")
    s2 = api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/b")
    assert s2.new_bytes == 0
    store = OciStore(tmp_path / "s")
    packs = lambda ref: {d["digest"] for d in store.manifest(store.resolve(ref).digest)["layers"] if d["mediaType"] == lay.MEDIA_PACK}  # noqa: E731
    assert packs("gs-pkg/b") == packs("gs-pkg/a") and packs("gs-pkg/a")
    api.remove(tmp_path / "s", "gs-pkg/a")
    api.gc(tmp_path / "s")
    out = api.materialize_checkpoint(tmp_path / "s", "gs-pkg/b", tmp_path / "out", form="criu-dir")
    assert _files(out) == _files(src)
    assert s1.new_bytes >= 6 << 20


def test_zero_runs_cost_nothing_and_come_back_as_holes(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "a", [(0x10000000, bytes(64 << 20) + _rand(1 << 20, 31) + bytes(8 << 20))])
    s = api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/z")
    assert s.new_bytes <= (1 << 20) + 2 * PackParams().piece_pages * PAGE
    out = api.materialize_checkpoint(tmp_path / "s", "gs-pkg/z", tmp_path / "out", form="criu-dir")
    assert _files(out) == _files(src)
    st = (out / "pages-1.img").stat()
    assert st.st_blocks * 512 < 16 << 20  # the 72 MiB of zeros were never written


def test_compression_is_kept_only_where_it_pays(tmp_path: Path) -> None:
    text = (b"GPU checkpoint " * 300)[:PAGE] * 512  # 2 MiB that compresses
    src = _checkpoint(tmp_path / "a", [(0x10000000, text), (0x20000000, _rand(2 << 20, 41))])
    api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/c", compress=True)
    store = OciStore(tmp_path / "s")
    art = fmt.load(store, store.resolve("gs-pkg/c").digest)
    placements = [p for b in lay.layout_of(store, art).blobs for p in b.placements]
    assert any(p.compressed for p in placements) and any(not p.compressed for p in placements)
    assert all(p.stored_length < p.raw_length for p in placements if p.compressed)
    out = api.materialize_checkpoint(tmp_path / "s", "gs-pkg/c", tmp_path / "out", form="criu-dir")
    assert _files(out) == _files(src)


def _flip_a_byte_of_its_first_pack(store: OciStore, ref: str, where: float, bits: int) -> None:
    m = store.manifest(store.resolve(ref).digest)
    pack = next(d for d in m["layers"] if d["mediaType"] == lay.MEDIA_PACK)
    path = store.blob_path(pack["digest"])
    os.chmod(path, 0o600)
    at = int(pack["size"] * where)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ bits]))


def test_a_corrupted_piece_is_detected_and_nothing_is_left(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "a", [(0x10000000, _rand(4 << 20, 51))])
    api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/x")
    _flip_a_byte_of_its_first_pack(OciStore(tmp_path / "s"), "gs-pkg/x", 1 / 2, 0x40)
    with pytest.raises(IntegrityError, match="digest mismatch"):
        api.materialize_checkpoint(tmp_path / "s", "gs-pkg/x", tmp_path / "out", form="criu-dir")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_on_blob_reports_every_new_blob_once_complete(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "a", [(0x10000000, _rand(40 << 20, 61))])
    store = OciStore(tmp_path / "s")
    seen: list[str] = []

    def on_blob(desc: object) -> None:
        with store.open_blob(desc.digest) as f:  # type: ignore[attr-defined]
            assert "sha256:" + hashlib.sha256(f.read()).hexdigest() == desc.digest  # type: ignore[attr-defined]
        seen.append(desc.digest)  # type: ignore[attr-defined]

    stored = api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/o", on_blob=on_blob)
    m = store.manifest(stored.digest)
    assert sorted(seen) == sorted({d["digest"] for d in m["layers"]} | {m["config"]["digest"]})
    assert sum(d["mediaType"] == lay.MEDIA_PACK for d in m["layers"]) >= 2  # 40 MiB: more than one pack


def test_the_packs_depend_on_the_checkpoint_only_not_on_the_number_of_workers(tmp_path: Path) -> None:
    # Packs are filled several at once on their own threads; which piece goes where is still
    # decided in file order, so two hosts with different core counts make the same blobs (a
    # registry that has them from one does not get them again from the other).
    data = _rand(3 << 20, 81) + bytes(1 << 20) + _rand(2 << 20, 82)
    src = _checkpoint(tmp_path / "a", [(0x10000000, data), (0x50000000, data[: 1 << 20])])
    layers = []
    for workers in (1, 4):
        store = OciStore(tmp_path / f"s{workers}")
        with store.writing():
            built = fmt.build_artifact(store, fmt.iter_directory(src), form="criu-dir", metadata=None, compress=False, parent=None,
                                       pack_params=PackParams(window=16 * PAGE, pack_target=96 * PAGE), workers=workers)
        layers.append([(d.media_type, d.digest) for d in built.layers])
    assert layers[0] == layers[1]
    assert sum(t == lay.MEDIA_PACK for t, _ in layers[0]) > 4


def test_adjacent_new_pieces_reach_the_pack_writer_as_one_view_each_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The lanes hash each view they write in one call; runs of new pieces that lie side by side
    # in the read window (and in the pack) must arrive as one view, and whatever breaks a run (a
    # piece stored before, a compressed one, a zero one, a full pack) must still give the exact
    # bytes in the exact places.
    from gpusnap.packaging import store as store_mod

    calls: list[list[int]] = []
    real = store_mod.PlacedBlobWriter.pwrite

    def spy(self: object, views: list[object], offset: int) -> int:
        calls.append([memoryview(v).nbytes for v in views])  # type: ignore[arg-type]
        return real(self, views, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(store_mod.PlacedBlobWriter, "pwrite", spy)
    piece = PackParams().piece_pages * PAGE
    plain = _rand(16 << 20, 91)
    api.store_checkpoint(tmp_path / "s", _checkpoint(tmp_path / "a", [(0x10000000, plain)]), form="criu-dir", ref="gs-pkg/r")
    window_pieces = PackParams().window // piece
    assert sum(len(c) for c in calls) <= (16 << 20) // PackParams().window + (16 << 20) // PackParams().pack_target
    assert max(max(c) for c in calls) >= window_pieces * piece

    calls.clear()
    text = (b"pieces that compress " * 400)[:piece]
    mixed = b"".join(
        plain[:piece] if k % 7 == 3 else text if k % 5 == 1 else bytes(piece) if k % 11 == 4 else _rand(piece, 100 + k)
        for k in range(96))
    src = _checkpoint(tmp_path / "b", [(0x20000000, mixed)])
    api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/m", compress=True)
    assert any(len(c) > 1 for c in calls) and any(n > piece for c in calls for n in c)
    out = api.materialize_checkpoint(tmp_path / "s", "gs-pkg/m", tmp_path / "out", form="criu-dir")
    assert _files(out) == _files(src)
    store = OciStore(tmp_path / "s")
    for d in store.manifest(store.resolve("gs-pkg/m").digest)["layers"]:
        with store.open_blob(d["digest"]) as f:
            assert "sha256:" + hashlib.sha256(f.read()).hexdigest() == d["digest"]


def test_every_pack_is_made_durable_before_it_becomes_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Packs are not fdatasynced one by one as sealed (a flush per 32 MiB held a disk below its
    # speed); the store's publish syncs them all before any is renamed into blobs/.
    from gpusnap.packaging import store as store_mod

    events: list[tuple[str, str]] = []
    real_sync, real_replace = store_mod.OciStore._fdatasync_path, store_mod.os.replace

    def sync(self: object, path: Path) -> None:
        events.append(("sync", path.name.split(".", 1)[0]))
        real_sync(self, path)  # type: ignore[arg-type]

    def replace(a: object, b: object) -> None:
        if Path(str(b)).parent.name == "sha256":
            events.append(("visible", Path(str(b)).name))
        real_replace(a, b)  # type: ignore[arg-type]

    monkeypatch.setattr(store_mod.OciStore, "_fdatasync_path", sync)
    monkeypatch.setattr(store_mod.os, "replace", replace)
    monkeypatch.setattr(store_mod, "_syncfs", lambda path: pytest.fail("a checkpoint's few packs take no syncfs"))
    src = _checkpoint(tmp_path / "a", [(0x10000000, _rand(40 << 20, 95))])
    stored = api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/d")
    store = OciStore(tmp_path / "s")
    packs = [d["digest"].split(":")[1] for d in store.manifest(stored.digest)["layers"] if d["mediaType"] == lay.MEDIA_PACK]
    assert len(packs) >= 2
    for hex_ in packs:
        synced = events.index(("sync", hex_))
        assert synced < events.index(("visible", hex_))
        assert all(e[0] == "sync" for e in events[:synced])  # nothing visible before every sync of the publish


@pytest.mark.parametrize("fail_at", [1, 5])
def test_a_failure_while_packs_are_written_leaves_no_blob_and_nothing_in_ingest(tmp_path: Path, fail_at: int) -> None:
    # Small packs: when the failure comes, other packs are being written, hashed and flushed on
    # their pools; all of them must be gone afterwards (files in ingest/, pending blobs).
    src = _checkpoint(tmp_path / "a", [(0x10000000, _rand(6 << 20, 71))])
    store = OciStore(tmp_path / "s")
    calls: list[object] = []

    def on_blob(desc: object) -> None:
        calls.append(desc)
        if len(calls) == fail_at:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError), store.writing():
        try:
            fmt.build_artifact(store, fmt.iter_directory(src), form="criu-dir", metadata=None, compress=False, parent=None,
                               pack_params=PackParams(window=16 * PAGE, pack_target=64 * PAGE), on_blob=on_blob, workers=3)
        except BaseException:
            store.discard_pending()
            raise
    assert store.tags() == [] and list(store.ingest_dir.iterdir()) == [] and list(store.blobs_dir.iterdir()) == []


def test_layout_places_every_blob_into_files_without_the_store_api(tmp_path: Path) -> None:
    r = bytes(8 << 20) + _rand(3 << 20, 71)
    src = _checkpoint(tmp_path / "a", [(0x10000000, r), (0x90000000, r[: 1 << 20])])  # duplicate content too
    api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/l")
    store = OciStore(tmp_path / "s")
    desc = store.resolve("gs-pkg/l")
    manifest = store.manifest(desc.digest)
    config = json.loads(store.read_bytes(manifest["config"]["digest"]))
    layout = lay.layout_from_parts(manifest, config, lambda d: store.read_bytes(d.digest))
    assert layout.version == 2 and [f.path for f in layout.files] == ["pages-1.img"]
    out = tmp_path / "direct"
    out.mkdir()
    fd = os.open(out / "pages-1.img", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, layout.files[0].size)
    for plan in layout.blobs:
        with store.open_blob(plan.descriptor.digest) as f:
            lay.place_stream(plan, f, lambda _p: fd)
    os.close(fd)
    assert (out / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()
    assert sum(n for _, _, n in layout.zeros) >= 8 << 20


def test_v1_artifacts_still_materialize(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "a", [(0x10000000, _rand(5 << 20, 81))])
    store = OciStore(tmp_path / "s")
    with store.writing():
        built = fmt.build_artifact(store, fmt.iter_directory(src), form="criu-dir", metadata=None, compress=True, parent=None, version=1)
        store.tag("gs-pkg/v1", fmt.Descriptor(fmt.MEDIA_OCI_MANIFEST, built.manifest_digest, built.manifest_size, artifact_type=fmt.ARTIFACT_TYPE))
    assert built.config["schemaVersion"] == 1
    assert any(fmt.is_chunk_media(d.media_type) for d in built.layers)
    out = api.materialize_checkpoint(tmp_path / "s", "gs-pkg/v1", tmp_path / "out", form="criu-dir")
    assert _files(out) == _files(src)
    art = fmt.load(store, built.manifest_digest)
    layout = lay.layout_of(store, art)
    assert layout.version == 1 and all(len(b.placements) == 1 and b.placements[0].digest is None for b in layout.blobs)
    assert sum(b.placements[0].raw_length for b in layout.blobs) == 5 << 20
    # a v2 checkpoint of the same memory stored next to it still works (no piece index from v1)
    s2 = api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/v2")
    assert s2.new_bytes >= 5 << 20
    assert _files(api.materialize_checkpoint(tmp_path / "s", "gs-pkg/v2", tmp_path / "out2", form="criu-dir")) == _files(src)


def _piece_table(store: OciStore, ref: str) -> tuple[str, list[lay.Record]]:
    manifest = store.manifest(store.resolve(ref).digest)
    algorithm, records = lay.read_table(store.read_bytes(next(d["digest"] for d in manifest["layers"] if d["mediaType"] == lay.MEDIA_PIECES)))
    return algorithm, list(records)


def test_new_pieces_carry_their_blake3_and_the_table_says_so(tmp_path: Path) -> None:
    data = _rand(3 << 20, 85)
    src = _checkpoint(tmp_path / "a", [(0x10000000, data)])
    s = api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/b3")
    store = OciStore(tmp_path / "s")
    algorithm, records = _piece_table(store, "gs-pkg/b3")
    assert algorithm == lay.DIGEST_BLAKE3 == lay.PIECE_DIGEST
    import blake3

    for fo, _bo, _fi, _li, raw, _stored, flags, digest in records:
        assert not flags & lay.FLAG_ZERO and digest == blake3.blake3(data[fo:fo + raw]).digest()
    manifest = store.manifest(store.resolve("gs-pkg/b3").digest)
    assert s.new_bytes >= 3 << 20
    assert json.loads(store.read_bytes(manifest["config"]["digest"]))["chunking"]["digest"] == "blake3(raw piece)"


def test_sha256_tables_of_earlier_versions_still_restore_verified_and_are_not_deduped_against(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _rand(4 << 20, 87)
    src = _checkpoint(tmp_path / "a", [(0x10000000, data)])
    # What gpusnap wrote before BLAKE3: the same records, SHA-256 digests, magic GSPIECE2.
    monkeypatch.setattr(lay, "PIECE_DIGEST", lay.DIGEST_SHA256)
    api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/old")
    monkeypatch.undo()
    store = OciStore(tmp_path / "s")
    algorithm, records = _piece_table(store, "gs-pkg/old")
    assert algorithm == lay.DIGEST_SHA256
    assert all(d == hashlib.sha256(data[fo:fo + raw]).digest() for fo, _b, _f, _l, raw, _s, _fl, d in records)
    assert _files(api.materialize_checkpoint(tmp_path / "s", "gs-pkg/old", tmp_path / "out", form="criu-dir")) == _files(src)

    # Its pieces are not in the index the next store dedups against (their keys are SHA-256):
    # the same memory is stored again, BLAKE3-keyed, and from then on dedups.
    from gpusnap.packaging.pack import known_pieces

    assert len(known_pieces(store)) == 0
    assert api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/new").new_bytes >= 4 << 20
    assert api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/new2").new_bytes == 0

    # A changed byte in an old pack is still caught by its SHA-256.
    _flip_a_byte_of_its_first_pack(store, "gs-pkg/old", 1 / 3, 1)
    with pytest.raises(IntegrityError, match="digest mismatch"):
        api.materialize_checkpoint(tmp_path / "s", "gs-pkg/old", tmp_path / "out2", form="criu-dir")


def test_a_piece_table_of_an_unknown_digest_is_refused_with_a_way_out() -> None:
    import struct

    import zstandard

    table = zstandard.ZstdCompressor().compress(struct.pack("<8sII", b"GSPIECE9", 0, lay.RECORD.size))
    with pytest.raises(IntegrityError, match="upgrade gpusnap"):
        lay.read_table(table)
    with pytest.raises(IntegrityError, match="upgrade gpusnap"):
        lay.digest_algorithm("md5")


def test_a_blob_plan_keeps_its_pieces_digest_algorithm_over_the_wire() -> None:
    raw = _rand(8192, 89)
    plan = lay.BlobPlan(fmt.Descriptor(lay.MEDIA_PACK, "sha256:" + "0" * 64, len(raw)), [
        lay.Placement("pages-1.img", 0, 0, 4096, 4096, False, lay.piece_hash(lay.DIGEST_BLAKE3, raw[:4096]), lay.DIGEST_BLAKE3),
        lay.Placement("pages-1.img", 4096, 4096, 4096, 4096, False, hashlib.sha256(raw[4096:]).digest(), lay.DIGEST_SHA256)])
    back = lay.BlobPlan.from_wire(json.loads(json.dumps(plan.to_wire())))
    assert back == plan and [p.algorithm for p in back.placements] == [lay.DIGEST_BLAKE3, lay.DIGEST_SHA256]
    assert back.placements[0].algorithm is lay.DIGEST_BLAKE3  # the interned constant, not a str per piece
    assert back.placements[0].matches(raw[:4096]) and back.placements[1].matches(raw[4096:])
    assert not back.placements[0].matches(raw[4096:])


def test_a_tampered_piece_table_is_rejected(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "a", [(0x10000000, _rand(1 << 20, 91))])
    api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/t")
    store = OciStore(tmp_path / "s")
    manifest = store.manifest(store.resolve("gs-pkg/t").digest)
    config = json.loads(store.read_bytes(manifest["config"]["digest"]))
    table = store.read_bytes(next(d["digest"] for d in manifest["layers"] if d["mediaType"] == lay.MEDIA_PIECES))
    records = lay.decode_table(table)
    short = lay.encode_table(records[:-1])  # a piece missing: the file is not covered
    with pytest.raises(IntegrityError, match="cover"):
        lay.layout_from_parts(manifest, config, lambda d: short)
    far = lay.encode_table([records[0][:1] + (10 << 30,) + records[0][2:]] + records[1:])  # outside its pack
    with pytest.raises(IntegrityError, match="outside"):
        lay.layout_from_parts(manifest, config, lambda d: far)


def test_page_features_flag_zero_pages_exactly() -> None:
    data = bytearray(_rand(8 * PAGE, 5))
    data[PAGE:2 * PAGE] = bytes(PAGE)
    data[3 * PAGE:4 * PAGE] = bytes(PAGE)
    data[3 * PAGE + 100] = 1  # zero everywhere the hash samples, but not a zero page
    zero, cut = page_features(memoryview(data), 8, 32)
    assert zero.tolist() == [False, True, False, False, False, False, False, False]
    assert not cut[1] and not cut[3]
    assert isinstance(zero, np.ndarray)


def test_page_zero_agrees_with_a_byte_by_byte_check() -> None:
    """page_zero's OR-reductions (which let other threads run) flag exactly the all-zero pages:
    pages zero except one word at a sampled or an unsampled place, all-zero runs of every length,
    and a window that is all zero."""
    from gpusnap.packaging.pack import page_zero

    rng = np.random.default_rng(7)
    pages = 300
    data = bytearray(_rand(pages * PAGE, 9))
    for i in range(pages):
        kind = rng.integers(0, 4)
        if kind:  # zero the page, then maybe put one word back
            data[i * PAGE:(i + 1) * PAGE] = bytes(PAGE)
            if kind == 2:
                data[i * PAGE + 256 * int(rng.integers(0, 16))] = 1  # a sampled word
            elif kind == 3 and rng.integers(0, 2):
                data[i * PAGE + 8 + 256 * int(rng.integers(0, 16))] = 1  # an unsampled word
    expect = [not any(data[i * PAGE:(i + 1) * PAGE]) for i in range(pages)]
    assert page_zero(memoryview(data), pages).tolist() == expect
    assert page_zero(memoryview(bytes(64 * PAGE)), 64).all()


@pytest.mark.parametrize("workers", [1, 3])
def test_tiny_windows_and_packs_exercise_recycling_and_early_seals(tmp_path: Path, workers: int) -> None:
    # windows of 16 pages and packs of 64 pages: many packs, buffers recycled hundreds of
    # times, part of the data known from the first checkpoint, part new, part zero
    params = PackParams(window=16 * PAGE, pack_target=64 * PAGE)
    base = _rand(6 << 20, 101)
    a = _checkpoint(tmp_path / "a", [(0x10000000, base)])
    changed = bytearray(base)
    for page in range(0, len(base) // PAGE, 7):
        changed[page * PAGE + 1] ^= 1  # every 7th page changes
    changed[(2 << 20):(3 << 20)] = bytes(1 << 20)
    b = _checkpoint(tmp_path / "b", [(0x10000000, bytes(changed)), (0x40000000, base[: 1 << 20])])
    store = OciStore(tmp_path / "s")
    for src in (a, b):
        with store.writing():
            built = fmt.build_artifact(store, fmt.iter_directory(src), form="criu-dir", metadata=None, compress=False,
                                       parent=None, pack_params=params, workers=workers)
            store.tag(f"gs-pkg/{src.name}", fmt.Descriptor(fmt.MEDIA_OCI_MANIFEST, built.manifest_digest, built.manifest_size))
    assert sum(d.media_type == lay.MEDIA_PACK for d in built.layers) > 10
    assert built.config["pieces"]["deduped_pieces"] >= 8  # the 1 MiB copy of the first checkpoint's pages
    assert built.config["pieces"]["zero_bytes"] >= 1 << 20
    for name, src in (("a", a), ("b", b)):
        out = api.materialize_checkpoint(tmp_path / "s", f"gs-pkg/{name}", tmp_path / f"out-{name}", form="criu-dir")
        assert _files(out) == _files(src)


def test_a_podman_archive_with_its_pagemap_is_cut_by_address_from_the_stream(tmp_path: Path) -> None:
    import io
    import tarfile

    pages = bytes(1 << 20) + _rand(3 << 20, 111)
    files = {
        "config.dump": b'{"id": "abc", "name": "web"}',
        "spec.dump": b"{}",
        "checkpoint/inventory.img": b"inv",
        "checkpoint/pagemap-1.img": _pagemap(1, [(0x7F0000001000, len(pages) // PAGE, PE_PRESENT, False)]),
        "checkpoint/pages-1.img": pages,
    }
    with tarfile.open(tmp_path / "export.tar", "w") as tar:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o600
            tar.addfile(ti, io.BytesIO(data))
    api.store_checkpoint(tmp_path / "s", tmp_path / "export.tar", form="podman-archive", ref="gs-pkg/p")
    store = OciStore(tmp_path / "s")
    art = fmt.load(store, store.resolve("gs-pkg/p").digest)
    layout = lay.layout_of(store, art)
    va0 = 0x7F0000001000
    for plan in layout.blobs:
        for p in plan.placements:  # every piece ends at a 128 KiB address or the range end
            end = va0 + p.file_offset + p.raw_length
            assert end % (PackParams().piece_pages * PAGE) == 0 or p.file_offset + p.raw_length == len(pages)
    assert sum(n for _, _, n in layout.zeros) >= (1 << 20) - PackParams().piece_pages * PAGE
    out = api.materialize_checkpoint(tmp_path / "s", "gs-pkg/p", tmp_path / "out", form="criu-dir")
    assert (out / "pages-1.img").read_bytes() == pages


def test_seal_open_commits_the_packs_being_filled_before_the_finish(tmp_path: Path) -> None:
    """What the follower does at the dump's end: every pack being filled is committed (on_blob
    told) then, not at the finish; what comes later goes to new packs."""
    import io
    import threading
    import time

    from gpusnap.packaging.pack import PackWriter

    store = OciStore(tmp_path / "s")
    committed: list[int] = []
    lock = threading.Lock()

    def on_blob(desc: object) -> None:
        with lock:
            committed.append(desc.size)  # type: ignore[attr-defined]

    first, second = _rand(9 << 20, 71), _rand(5 << 20, 72)  # less than a pack each (32 MiB)
    with store.writing():
        writer = PackWriter(store, compress=False, on_blob=on_blob, workers=2)
        writer.add_cdc(0, io.BytesIO(first), len(first))
        writer.seal_open()
        deadline = time.monotonic() + 30
        while sum(committed) < len(first) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(committed) == len(first), "the open packs were not committed at seal_open"
        before = len(committed)
        writer.add_cdc(1, io.BytesIO(second), len(second))
        result = writer.finish()
    assert len(committed) > before and sum(committed) == len(first) + len(second) == result.new_bytes
    assert len(result.packs) == len(committed)
    store.discard_pending()


def test_a_writer_widened_midway_makes_the_same_packs_on_more_threads(tmp_path: Path) -> None:
    """What a follower does when the dump ends: the rest is read and hashed on more threads
    (a new pool beside the old one, which finishes its windows); the packs do not change, and
    the old pool is shut down with the rest."""
    import io

    from gpusnap.packaging.pack import PackWriter

    first, second = _rand(6 << 20, 91), _rand(7 << 20, 92)
    params = PackParams(window=64 * PAGE, pack_target=256 * PAGE)
    packs = []
    for widen in (False, True):
        store = OciStore(tmp_path / f"s{widen}")
        with store.writing():
            writer = PackWriter(store, compress=False, params=params, workers=1 if widen else 4)
            writer.add_cdc(0, io.BytesIO(first), len(first))
            if widen:
                old = writer.pool
                writer.widen(4)
                writer.widen(2)  # never fewer
                assert writer.workers == 4 and writer.pool is not old and writer.pool._max_workers == 4
                assert writer.nbuf == 4 + 2 + 4 + 2
            writer.add_cdc(1, io.BytesIO(second), len(second))
            result = writer.finish()
            packs.append([d.digest for d in result.packs])
            store.discard_pending()
        if widen:
            assert old._shutdown  # type: ignore[attr-defined]
    assert packs[0] == packs[1] and len(packs[0]) > 4
