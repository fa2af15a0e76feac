"""CRIU image files written by hand, for tests and benchmarks that need a checkpoint directory
without running CRIU: its image framing (two magics, then length-prefixed protobuf messages) and
the few protobuf wire-format pieces the pagemap, pstree, core, mm and files images use.

One home for what tests/unit/packaging and bench/{store_scale,restore_path}.py write; the
product only reads these images (gpusnap.criu.pagemap, .pstree, .ckdiff).
"""

from __future__ import annotations

import struct

IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025
PE_PRESENT = 4


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field_varint(num: int, value: int) -> bytes:
    """Field ``num`` with a varint value (wire type 0)."""
    return varint(num << 3) + varint(value)


def field_bytes(num: int, data: bytes) -> bytes:
    """Field ``num`` with a length-delimited value (wire type 2)."""
    return varint(num << 3 | 2) + varint(len(data)) + data


def image(magic: int, entries: list[bytes]) -> bytes:
    """A CRIU image file: the common magic, the image's own, then each message with its length."""
    return struct.pack("<II", IMG_COMMON_MAGIC, magic) + b"".join(struct.pack("<I", len(e)) + e for e in entries)


def pagemap(pages_id: int, entries: list[tuple[int, int, int | None, bool]], *, criu42: bool = False) -> bytes:
    """A pagemap image: its head (``pages_id``), then one entry per (vaddr, nr_pages, flags or None
    for a pre-flags image, in_parent). ``criu42``: the count as CRIU 4.2 writes it (uint64 field
    5, field 2 zero)."""
    msgs = [field_varint(1, pages_id)]
    for vaddr, nr, flags, in_parent in entries:
        m = field_varint(1, vaddr) + (field_varint(2, 0) + field_varint(5, nr) if criu42 else field_varint(2, nr))
        if in_parent:
            m += field_varint(3, 1)
        if flags is not None:
            m += field_varint(4, flags)
        msgs.append(m)
    return image(PAGEMAP_MAGIC, msgs)


def present_pagemap(pages_id: int, entries: list[tuple[int, int]]) -> bytes:
    """A pagemap image whose (vaddr, nr_pages) entries are all present in its pages file."""
    return pagemap(pages_id, [(va, nr, PE_PRESENT, False) for va, nr in entries])


MM_MAGIC = 0x57492820


def mm(vmas: list[tuple[int, int]]) -> bytes:
    """An mm image with only its mappings' (start, end) (MmEntry.vmas = 14; VmaEntry start 1, end 2)."""
    body = b"".join(field_bytes(14, field_varint(1, start) + field_varint(2, end)) for start, end in vmas)
    return image(MM_MAGIC, [body])
