"""packaging.fetch without a registry: the plan of where each blob's bytes go, and the writer
that puts received bytes there (pieces, zstd, holes, digests). The download itself runs
against the real registry in tests/integration/packaging/test_packaging_pipeline.py."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import zstandard

from gpusnap.errors import IntegrityError
from gpusnap.packaging import artifact as fmt
from gpusnap.packaging import layout as lay
from gpusnap.packaging.fetch import BlobPlan, FileMaps, Placement, _BlobRouter, _create_sparse, _MappedRouter, make_router, plan
from gpusnap.packaging.store import Descriptor


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _chunk(data: bytes, file: str, offset: int, length: int, zstd: bool = False) -> dict[str, object]:
    media = fmt.MEDIA_PAGES + (fmt.ZSTD_SUFFIX if zstd else "")
    return Descriptor(media, _digest(data), len(data), {fmt.A_FILE: file, fmt.A_OFFSET: str(offset), fmt.A_LENGTH: str(length)}).to_dict()


def _file(path: str, size: int) -> dict[str, object]:
    return {"path": path, "size": size, "mode": 0o600, "uid": 0, "gid": 0, "mtime": 0, "role": "pages"}


def test_plan_groups_a_repeated_blob_and_checks_coverage() -> None:
    a, b = b"a" * 100, b"b" * 50
    manifest = {"layers": [
        Descriptor(fmt.MEDIA_CRIU, _digest(b"tar"), 3, {fmt.A_TITLE: "criu.tar"}).to_dict(),
        _chunk(a, "pages-1.img", 0, 100), _chunk(b, "pages-1.img", 100, 50), _chunk(a, "pages-1.img", 150, 100),
    ]}
    p = plan(manifest, {"files": [_file("pages-1.img", 250)]})
    assert [d.annotations[fmt.A_TITLE] for d in p.tar_layers] == ["criu.tar"]
    by = {bp.descriptor.digest: sorted(pl.file_offset for pl in bp.placements) for bp in p.blobs}
    assert by == {_digest(a): [0, 150], _digest(b): [100]}  # the repeated blob is fetched once, written twice


@pytest.mark.parametrize("layers, size, what", [
    ([(0, 100), (150, 50)], 150, "gap"),  # the lengths add up, the offsets do not tile
    ([(0, 100), (50, 50)], 150, "overlap"),
    ([(0, 100)], 120, "add up"),
])
def test_plan_refuses_pieces_that_do_not_tile_the_file(layers: list[tuple[int, int]], size: int, what: str) -> None:
    manifest = {"layers": [_chunk(bytes([i]) * n, "pages-1.img", off, n) for i, (off, n) in enumerate(layers)]}
    with pytest.raises(IntegrityError, match=what):
        plan(manifest, {"files": [_file("pages-1.img", size)]})


@pytest.mark.parametrize("files, chunk_file", [
    ([_file("pages-1.img", 4)], "pages-2.img"),  # a chunk of a file the config does not list
    ([_file("../escape.img", 4)], "../escape.img"),  # a path out of the directory
    ([_file("pages-1.img", 4), _file("pages-1.img", 4)], "pages-1.img"),  # listed twice
])
def test_plan_refuses_bad_file_lists(files: list[dict[str, object]], chunk_file: str) -> None:
    with pytest.raises(IntegrityError):
        plan({"layers": [_chunk(b"abcd", chunk_file, 0, 4)]}, {"files": files})


def _route(tmp_path: Path, blob: bytes, placements: list[Placement], size: int, step: int = 7777) -> Path:
    fds = {"f": _create_sparse(tmp_path, "f", size)}
    router = _BlobRouter(BlobPlan(Descriptor(fmt.MEDIA_PAGES, _digest(blob), len(blob)), placements), fds)
    buf = bytearray(step)
    try:
        for i in range(0, len(blob), step):
            part = blob[i:i + step]
            buf[:len(part)] = part
            router.take(buf, len(part))
        router.finish()
    finally:
        os.close(fds["f"])
    return tmp_path / "f"


def test_router_writes_raw_and_zstd_pieces_at_their_offsets_with_zero_runs_as_holes(tmp_path: Path) -> None:
    raw1 = os.urandom(100_000)
    raw2 = bytes(1 << 20) + os.urandom(5000)  # a zero run: not written
    z2 = zstandard.ZstdCompressor().compress(raw2)
    blob = raw1 + z2
    pls = [Placement("f", len(raw2), 0, len(raw1), len(raw1), False, hashlib.sha256(raw1).digest()),
           Placement("f", 0, len(raw1), len(z2), len(raw2), True, hashlib.sha256(raw2).digest())]
    out = _route(tmp_path, blob, pls, len(raw1) + len(raw2))
    assert out.read_bytes() == raw2 + raw1
    assert out.stat().st_blocks * 512 < 512 << 10  # the megabyte of zeros stayed a hole


def test_router_refuses_a_blob_with_another_digest(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    fds = {"f": _create_sparse(tmp_path, "f", len(data))}
    router = _BlobRouter(BlobPlan(Descriptor(fmt.MEDIA_PAGES, _digest(b"other"), len(data)),
                                  [Placement("f", 0, 0, len(data), len(data), False, None)]), fds)
    router.take(bytearray(data), len(data))
    with pytest.raises(IntegrityError, match="does not match its digest"):
        router.finish()
    os.close(fds["f"])


def test_router_refuses_a_piece_with_another_digest(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    with pytest.raises(IntegrityError, match="piece at byte 0"):
        _route(tmp_path, data, [Placement("f", 0, 0, len(data), len(data), False, hashlib.sha256(b"x").digest())], len(data))


def test_router_refuses_a_zstd_piece_longer_than_announced(tmp_path: Path) -> None:
    raw = os.urandom(10_000)
    z = zstandard.ZstdCompressor().compress(raw)
    with pytest.raises(IntegrityError, match="more than"):
        _route(tmp_path, z, [Placement("f", 0, 0, len(z), 5000, True, None)], 5000)


def test_router_refuses_garbage_where_a_zstd_frame_should_be(tmp_path: Path) -> None:
    junk = os.urandom(10_000)
    with pytest.raises(IntegrityError, match="decompress|holds"):
        _route(tmp_path, junk, [Placement("f", 0, 0, len(junk), 20_000, True, None)], 20_000)


def test_a_blob_whose_pieces_carry_digests_is_received_only_over_their_span(tmp_path: Path) -> None:
    from gpusnap.packaging.fetch import blob_span

    unused, piece, tail = os.urandom(30_000), os.urandom(20_000), os.urandom(10_000)
    blob = unused + piece + tail  # a pack shared with an older checkpoint: only `piece` is needed
    pl = Placement("f", 0, len(unused), len(piece), len(piece), False, hashlib.sha256(piece).digest())
    bp = BlobPlan(Descriptor(fmt.MEDIA_PAGES, _digest(blob), len(blob)), [pl])
    assert blob_span(bp) == (len(unused), len(unused) + len(piece))
    v1 = BlobPlan(bp.descriptor, [Placement("f", 0, len(unused), len(piece), len(piece), False, None)])
    assert blob_span(v1) == (0, len(blob))  # the blob digest verifies it: all of it is needed
    fds = {"f": _create_sparse(tmp_path, "f", len(piece))}
    router = _BlobRouter(bp, fds)
    span = bytearray(piece)
    router.take(span, len(span))
    router.finish()
    os.close(fds["f"])
    assert (tmp_path / "f").read_bytes() == piece


# ---- receiving straight into the files' mappings (fetch._MappedRouter) ----------------------
def _receive_mapped(tmp_path: Path, blob: bytes, placements: list[Placement], sizes: dict[str, int],
                    step: int = 5000) -> tuple[dict[str, bytes], _MappedRouter]:
    """Feed ``blob`` to a mapped router the way fetch._Fetch.stream does (reads of at most
    ``step`` bytes into whatever ``target`` hands out), return the files and the router."""
    fds = {name: _create_sparse(tmp_path, name, size) for name, size in sizes.items()}
    maps = FileMaps(fds)
    router = make_router(BlobPlan(Descriptor(fmt.MEDIA_PAGES, _digest(blob), len(blob)), placements), fds, maps)
    assert isinstance(router, _MappedRouter)
    scratch = bytearray(3000)
    try:
        pos = router.start
        while pos < len(blob):
            dst = router.target(memoryview(scratch))
            n = min(len(dst), step, len(blob) - pos)
            assert n > 0
            dst[:n] = blob[pos:pos + n]
            router.landed(scratch, n)
            pos += n
        router.finish()
    finally:
        for fd in fds.values():
            os.close(fd)
    return {name: (tmp_path / name).read_bytes() for name in sizes}, router


def _raw(path: str, file_offset: int, blob_offset: int, data: bytes) -> Placement:
    return Placement(path, file_offset, blob_offset, len(data), len(data), False, hashlib.sha256(data).digest())


def test_mapped_router_lands_raw_runs_in_place_and_the_rest_through_the_buffer(tmp_path: Path) -> None:
    a1, a2, a3 = os.urandom(20_000), os.urandom(12_288), os.urandom(7_000)  # consecutive in blob and file: one run
    other = os.urandom(9_000)  # another checkpoint's piece in a shared pack: received, not written
    raw_z = os.urandom(4000) * 4
    z = zstandard.ZstdCompressor().compress(raw_z)
    twice = os.urandom(6_000)  # one stored range feeding two places
    g = os.urandom(11_000)  # a piece of another file
    blob = a1 + a2 + a3 + other + z + twice + g
    o = len(a1 + a2 + a3 + other)
    pls = [_raw("f", 0, 0, a1), _raw("f", len(a1), len(a1), a2), _raw("f", len(a1 + a2), len(a1 + a2), a3),
           Placement("f", 39_288, o, len(z), len(raw_z), True, hashlib.sha256(raw_z).digest()),
           _raw("f", 39_288 + len(raw_z), o + len(z), twice), _raw("f", 39_288 + len(raw_z) + len(twice), o + len(z), twice),
           _raw("g", 0, o + len(z) + len(twice), g)]
    size_f = 39_288 + len(raw_z) + 2 * len(twice)
    for step in (5000, 1 << 20, 4096):
        out, router = _receive_mapped(tmp_path / str(step), blob, pls, {"f": size_f, "g": len(g)}, step)
        assert out["f"] == a1 + a2 + a3 + raw_z + twice + twice
        assert out["g"] == g
        assert [(r.b0, r.b1, r.path) for r in router.runs] == [(0, len(a1 + a2 + a3), "f"), (len(blob) - len(g), len(blob), "g")]
        assert len(router.direct) == 4  # the zstd piece and the shared range went through the buffer


def test_mapped_router_refuses_a_raw_piece_with_another_digest(tmp_path: Path) -> None:
    good, bad = os.urandom(8000), os.urandom(8000)
    pls = [_raw("f", 0, 0, good), Placement("f", 8000, 8000, 8000, 8000, False, hashlib.sha256(b"not it").digest())]
    with pytest.raises(IntegrityError, match="piece at byte 8000 of f does not match"):
        _receive_mapped(tmp_path, good + bad, pls, {"f": 16_000})


def test_mapped_router_receives_only_the_span_of_a_shared_pack(tmp_path: Path) -> None:
    unused, piece = os.urandom(30_000), os.urandom(20_000)
    out, router = _receive_mapped(tmp_path, unused + piece, [_raw("f", 0, len(unused), piece)], {"f": len(piece)})
    assert router.start == len(unused) and out["f"] == piece


def _one_piece_router(tmp_path: Path, piece: bytes) -> tuple[_MappedRouter, dict[str, int]]:
    """A mapped router for a blob that is one raw piece, the whole of file ``f``."""
    fds = {"f": _create_sparse(tmp_path, "f", len(piece))}
    router = make_router(BlobPlan(Descriptor(fmt.MEDIA_PAGES, _digest(piece), len(piece)), [_raw("f", 0, 0, piece)]), fds, FileMaps(fds))
    assert isinstance(router, _MappedRouter)
    return router, fds


def test_mapped_router_refuses_a_blob_that_ends_early(tmp_path: Path) -> None:
    piece = os.urandom(20_000)
    router, fds = _one_piece_router(tmp_path, piece)
    dst = router.target(memoryview(bytearray(100)))
    dst[:5000] = piece[:5000]
    router.landed(bytearray(), 5000)
    with pytest.raises(IntegrityError, match="ended after 5000"):
        router.finish()
    os.close(fds["f"])


def test_mapped_router_hands_out_the_buffer_past_the_end_so_an_oversized_blob_is_seen(tmp_path: Path) -> None:
    piece = os.urandom(10_000)
    router, fds = _one_piece_router(tmp_path, piece)
    dst = router.target(memoryview(bytearray(100)))
    assert len(dst) == len(piece)  # no more than the piece: the mapping is never written past it
    dst[:] = piece
    router.landed(bytearray(), len(piece))
    scratch = bytearray(64)
    assert router.target(memoryview(scratch)).obj is scratch and len(router.target(memoryview(scratch))) == 64
    router.finish()
    os.close(fds["f"])


def test_v1_blobs_and_plain_fetches_use_the_buffered_router(tmp_path: Path) -> None:
    data = os.urandom(1000)
    fds = {"f": _create_sparse(tmp_path, "f", len(data))}
    maps = FileMaps(fds)
    v1 = BlobPlan(Descriptor(fmt.MEDIA_PAGES, _digest(data), len(data)), [Placement("f", 0, 0, len(data), len(data), False, None)])
    assert type(make_router(v1, fds, maps)) is _BlobRouter  # the blob digest verifies it: read in full, through the buffer
    v2 = BlobPlan(v1.descriptor, [_raw("f", 0, 0, data)])
    assert type(make_router(v2, fds, None)) is _BlobRouter
    os.close(fds["f"])


def test_mapped_router_keeps_no_mapping_once_a_blob_is_done(tmp_path: Path) -> None:
    """A transfer process maps one run at a time and unmaps it once checked: what it holds
    resident is its own memory, not the image's (a 34 GB pull must not show as 34 GB of RSS)."""
    pieces = [os.urandom(64 << 10) for _ in range(8)]
    blob = b"".join(pieces)
    pls = [_raw("f", i * (64 << 10), i * (64 << 10), piece) for i, piece in enumerate(pieces)]
    out, _ = _receive_mapped(tmp_path, blob, pls, {"f": len(blob)}, step=50_000)
    assert out["f"] == blob
    assert str(tmp_path / "f") not in Path("/proc/self/maps").read_text()


def test_router_tells_pieces_checked_by_their_own_digest_as_they_are_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lazy restore follows the pull (gpusnap.criu.landed): each v2 piece is told once it is
    written and verified, runs of them merged (up to REPORT_RUN), not at the blob's end; a v1
    blob (verified only by its whole digest) tells nothing before it ends."""
    import gpusnap.packaging.fetch as fetch_mod

    monkeypatch.setattr(fetch_mod, "REPORT_RUN", 250_000)
    pieces = [os.urandom(100_000) for _ in range(4)]
    blob = b"".join(pieces)
    # File order: pieces 0, 1, 2 back to back, piece 3 apart (at the end, after a gap).
    where = [0, 100_000, 200_000, 400_000]
    pls = [Placement("f", where[i], i * 100_000, 100_000, 100_000, False, hashlib.sha256(p).digest()) for i, p in enumerate(pieces)]
    fds = {"f": _create_sparse(tmp_path, "f", 500_000)}
    told: list[tuple[str, int, int, bytes]] = []

    def tell(path: str, off: int, n: int) -> None:
        told.append((path, off, n, os.pread(fds["f"], n, off)))

    router = _BlobRouter(BlobPlan(Descriptor(fmt.MEDIA_PAGES, _digest(blob), len(blob)), pls), fds, on_piece=tell)
    try:
        router.take(bytearray(blob[:150_000]), 150_000)
        assert told == []  # piece 0 is written, the run may grow
        router.take(bytearray(blob[150_000:]), len(blob) - 150_000)
        router.finish()
        router.tell()
    finally:
        os.close(fds["f"])
    assert [(p, o, n) for p, o, n, _ in told] == [("f", 0, 300_000), ("f", 400_000, 100_000)]
    assert told[0][3] == b"".join(pieces[:3]) and told[1][3] == pieces[3]  # written when told
    v1 = _BlobRouter(BlobPlan(Descriptor(fmt.MEDIA_PAGES, _digest(blob), len(blob)),
                              [Placement("f", 0, 0, len(blob), len(blob), False, None)]), {}, on_piece=tell)
    assert v1.on_piece is None


@pytest.mark.parametrize("algorithm", [lay.DIGEST_BLAKE3, lay.DIGEST_SHA256])
def test_both_routers_check_each_piece_by_its_tables_digest(tmp_path: Path, algorithm: str) -> None:
    a, b = os.urandom(20_000), os.urandom(30_000)
    z = zstandard.ZstdCompressor().compress(b)  # streamed through the decompressor, hashed in parts
    pls = [Placement("f", 0, 0, len(a), len(a), False, lay.piece_hash(algorithm, a), algorithm),
           Placement("f", len(a), len(a), len(z), len(b), True, lay.piece_hash(algorithm, b), algorithm)]
    assert _route(tmp_path / "buffered", a + z, pls, len(a + b), step=3000).read_bytes() == a + b
    out, _ = _receive_mapped(tmp_path / "mapped", a + z, pls, {"f": len(a + b)}, 3000)
    assert out["f"] == a + b
    # The other algorithm's digest of the same bytes is not theirs: refused on either path.
    other = lay.DIGEST_SHA256 if algorithm == lay.DIGEST_BLAKE3 else lay.DIGEST_BLAKE3
    wrong = [Placement("f", 0, 0, len(a), len(a), False, lay.piece_hash(other, a), algorithm), pls[1]]
    with pytest.raises(IntegrityError, match="piece at byte 0"):
        _route(tmp_path / "b2", a + z, wrong, len(a + b))
    with pytest.raises(IntegrityError, match="piece at byte 0 of f does not match"):
        _receive_mapped(tmp_path / "m2", a + z, wrong, {"f": len(a + b)})
