from __future__ import annotations

import struct

import pytest

from gpusnap.packaging.pstree import CORE_MAGIC, IMG_COMMON_MAGIC, PSTREE_MAGIC, ImageFormatError, process_tree


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_varint(num: int, v: int) -> bytes:
    return _varint(num << 3) + _varint(v)


def _field_bytes(num: int, data: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def _image(magic: int, entries: list[bytes]) -> bytes:
    return struct.pack("<II", IMG_COMMON_MAGIC, magic) + b"".join(struct.pack("<I", len(e)) + e for e in entries)


def test_process_tree_with_names() -> None:
    init = _field_varint(1, 1) + _field_varint(2, 0) + _field_varint(3, 1) + _field_varint(4, 1) + _field_varint(5, 1)
    child = _field_varint(1, 7) + _field_varint(2, 1) + _field_varint(3, 1) + _field_varint(4, 1) + _field_bytes(5, _varint(7) + _varint(8))
    core = _field_varint(1, 1) + _field_bytes(3, _field_varint(1, 1) + _field_bytes(6, b"python3"))
    procs = process_tree({"pstree.img": _image(PSTREE_MAGIC, [init, child]), "core-7.img": _image(CORE_MAGIC, [core])})
    assert [(p.pid, p.ppid, p.threads, p.comm) for p in procs] == [(1, 0, [1], ""), (7, 1, [7, 8], "python3")]


def test_wrong_magic_and_truncation() -> None:
    with pytest.raises(ImageFormatError):
        process_tree({"pstree.img": _image(CORE_MAGIC, [])})
    with pytest.raises(ImageFormatError):
        process_tree({"pstree.img": _image(PSTREE_MAGIC, [b"\x08"])[:-1] + b"\x08\x80"})
    assert process_tree({}) == []
