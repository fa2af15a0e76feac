"""Fuzzed attacks on encrypted layers: every altered blob must fail authentication, none may decrypt."""

from __future__ import annotations

import hashlib
import io
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusnap.errors import GpusnapError, IntegrityError
from gpusnap.packaging import crypto

SEG = 64
MASTER = crypto.MasterKey(hashlib.sha256(b"gs-rel fuzz master").digest())
KEYS = crypto.DecryptionKeys(masters=(MASTER,))


def _seal(data: bytes) -> tuple[bytes, dict[str, str]]:
    cfg = crypto.EncryptionConfig(master=MASTER, segment_size=SEG)
    out = io.BytesIO()
    _, _, key = crypto.encrypt_stream(
        io.BytesIO(data), out, plaintext_digest="sha256:" + hashlib.sha256(data).hexdigest(), plaintext_size=len(data), config=cfg
    )
    return out.getvalue(), crypto.encryption_annotations(cfg, key)


def _attempt(blob: bytes, ann: dict[str, str]) -> bytes | GpusnapError:
    out = io.BytesIO()
    try:
        crypto.decrypt_stream(io.BytesIO(blob), out, annotations=ann, keys=KEYS)
    except GpusnapError as exc:
        return exc
    return out.getvalue()


class _Count:
    def __init__(self) -> None:
        self.tried = 0
        self.refused = 0


@pytest.fixture
def count(ledger, request):  # type: ignore[no-untyped-def]
    c = _Count()
    yield c
    ledger.record("crypto", request.node.name.removeprefix("test_"), tried=c.tried, refused=c.refused)
    assert c.tried > 0 and c.tried == c.refused


_data = st.binary(min_size=1, max_size=5 * SEG)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_data, pos=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_bit_flip_anywhere(count: _Count, data: bytes, pos: int, bit: int) -> None:
    blob, ann = _seal(data)
    pos %= len(blob)
    bad = bytearray(blob)
    bad[pos] ^= 1 << bit
    count.tried += 1
    result = _attempt(bytes(bad), ann)
    assert isinstance(result, IntegrityError), f"flip at {pos} accepted"
    assert "\n" not in str(result)
    count.refused += 1


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_data, cut=st.integers(min_value=0))
def test_truncation(count: _Count, data: bytes, cut: int) -> None:
    blob, ann = _seal(data)
    cut %= len(blob)
    count.tried += 1
    assert isinstance(_attempt(blob[:cut], ann), IntegrityError)
    count.refused += 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=2 * SEG + 1, max_size=6 * SEG), seed=st.randoms(use_true_random=False))
def test_segments_reordered_dropped_or_duplicated(count: _Count, data: bytes, seed) -> None:  # type: ignore[no-untyped-def]
    blob, ann = _seal(data)
    header, body = blob[: crypto.HEADER_SIZE], blob[crypto.HEADER_SIZE :]
    step = SEG + crypto.TAG_SIZE
    segs = [body[i : i + step] for i in range(0, len(body), step)]
    op = seed.choice(["swap", "drop-last", "dup", "drop-middle"])
    if op == "swap":
        i, j = seed.sample(range(len(segs) - 1), 2) if len(segs) > 2 else (0, 1)
        segs[i], segs[j] = segs[j], segs[i]
    elif op == "drop-last":
        segs = segs[:-1]
    elif op == "dup":
        i = seed.randrange(len(segs))
        segs.insert(i, segs[i])
    else:
        del segs[seed.randrange(len(segs) - 1)]
    count.tried += 1
    assert isinstance(_attempt(header + b"".join(segs), ann), IntegrityError), op
    count.refused += 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_data, size=st.integers(min_value=0, max_value=2**64 - 1), seg=st.integers(min_value=0, max_value=2**32 - 1))
def test_header_that_lies_about_sizes(count: _Count, data: bytes, size: int, seg: int) -> None:
    blob, ann = _seal(data)
    magic, version, oseg, osize, wrapped = struct.unpack(">8sBIQ40s", blob[: crypto.HEADER_SIZE])
    if (size, seg) == (osize, oseg):
        size += 1
    forged = struct.pack(">8sBIQ40s", magic, version, seg, size, wrapped) + blob[crypto.HEADER_SIZE :]
    count.tried += 1
    assert isinstance(_attempt(forged, ann), IntegrityError)
    count.refused += 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=_data, b=_data)
def test_splicing_two_blobs_under_the_same_key(count: _Count, a: bytes, b: bytes) -> None:
    if a == b:
        b = b + b"\x00"
    ba, ann = _seal(a)
    bb, _ = _seal(b)
    # A's header with B's segments (same master key): segments are bound to A's header.
    count.tried += 1
    assert isinstance(_attempt(ba[: crypto.HEADER_SIZE] + bb[crypto.HEADER_SIZE :], ann), IntegrityError)
    count.refused += 1


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_data, junk=st.binary(min_size=0, max_size=200))
def test_garbage_and_wrong_keys(count: _Count, data: bytes, junk: bytes) -> None:
    blob, ann = _seal(data)
    out = io.BytesIO()
    count.tried += 2
    with pytest.raises(IntegrityError):
        crypto.decrypt_stream(io.BytesIO(junk), out, annotations=ann, keys=KEYS)
    with pytest.raises(IntegrityError, match="wrong key"):
        crypto.decrypt_stream(io.BytesIO(blob), out, annotations=ann, keys=crypto.DecryptionKeys(masters=(crypto.MasterKey(os.urandom(32)),)))
    assert out.getvalue() == b""
    count.refused += 2
