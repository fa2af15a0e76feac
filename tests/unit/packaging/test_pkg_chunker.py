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
