from __future__ import annotations

import hashlib
import io
import random

from gpusnap.packaging.chunker import ChunkParams, chunks

SMALL = ChunkParams(avg_size=64 << 10, min_size=16 << 10, max_size=256 << 10)


def _digests(data: bytes, params: ChunkParams = SMALL) -> list[str]:
    return [hashlib.sha256(c).hexdigest() for c in chunks(io.BytesIO(data), params)]


def _pieces(data: bytes, params: ChunkParams = SMALL) -> list[bytes]:
    return [bytes(c) for c in chunks(io.BytesIO(data), params)]


def test_chunks_reassemble_to_the_input_and_respect_bounds() -> None:
    data = random.Random(1).randbytes(5 << 20)
    pieces = _pieces(data)
    assert b"".join(pieces) == data
    assert all(SMALL.min_size <= len(p) <= SMALL.max_size for p in pieces[:-1])
    assert len(pieces) > 20


def test_same_input_gives_same_chunks() -> None:
    data = random.Random(2).randbytes(3 << 20)
    assert _digests(data) == _digests(bytes(data))


def test_a_local_change_keeps_most_chunks() -> None:
    data = bytearray(random.Random(3).randbytes(8 << 20))
    before = _digests(bytes(data))
    # Insert 100 bytes in the middle: fixed-size blocks would all shift, CDC chunks resync.
    changed = bytes(data[: 4 << 20]) + b"x" * 100 + bytes(data[4 << 20:])
    after = _digests(changed)
    shared = len(set(before) & set(after))
    assert shared >= len(before) - 3


def test_size_limit_reads_only_that_many_bytes() -> None:
    data = random.Random(4).randbytes(1 << 20)
    stream = io.BytesIO(data + b"trailing")
    out = b"".join(bytes(c) for c in chunks(stream, SMALL, size=len(data)))
    assert out == data
    assert stream.read() == b"trailing"


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TINY = ChunkParams(avg_size=256, min_size=64, max_size=1024)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=20000), st.binary(min_size=1, max_size=50))
def test_property_reassembly_and_prefix_stability(data: bytes, suffix: bytes) -> None:
    pieces = _pieces(data, TINY)
    assert b"".join(pieces) == data
    # Appending bytes never changes chunks that end well before the old end (cut points are local).
    longer = _pieces(data + suffix, TINY)
    stable, end = [], 0
    for p in pieces[:-1]:
        end += len(p)
        if end + TINY.max_size > len(data):
            break
        stable.append(p)
    assert longer[: len(stable)] == stable


def test_groups_are_content_defined_and_bounded() -> None:
    from gpusnap.packaging.chunker import groups

    params = ChunkParams(avg_size=64 << 10, min_size=16 << 10, max_size=256 << 10, group_every=2, group_max=512 << 10)
    data = random.Random(6).randbytes(16 << 20)

    def digests(d: bytes) -> list[str]:
        return [hashlib.sha256(g).hexdigest() for g in groups(chunks(io.BytesIO(d), params), params)]

    before = digests(data)
    whole = b"".join(bytes(g) for g in groups(chunks(io.BytesIO(data), params), params))
    assert whole == data
    assert all(len(g) <= params.group_max for g in groups(chunks(io.BytesIO(data), params), params))
    after = digests(data[: 8 << 20] + b"y" * 10 + data[8 << 20:])
    assert len(set(before) & set(after)) >= len(before) - 3
    assert len(before) < len(_digests(data, params))  # fewer blobs than chunks
