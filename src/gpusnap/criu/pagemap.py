"""Which virtual-memory ranges a CRIU ``pages-N.img`` holds, read from the ``pagemap-*.img`` images.

A pages file is nothing but pages, back to back, in the order of the entries of the pagemap
image whose head names it (``pagemap_head.pages_id`` = N). Entries whose pages are not in this
file (in the parent image of an incremental dump, or lazily restored and not dumped) take no
room in it. Knowing the ranges lets the chunker cut where one mapping ends and an unrelated one
begins, instead of guessing from the bytes.

Wire format (criu/images/pagemap.proto): pagemap_head {pages_id = 1}, then pagemap_entry
{vaddr = 1 (uint64), nr_pages = 2, in_parent = 3 (bool, images before flags existed),
flags = 4, and since CRIU 4.2 the page count as uint64 in field 5 (field 2 then holds 0)}. Flags (criu/include/pagemap.h): PE_PARENT 1, PE_LAZY 2, PE_PRESENT 4; pages are in
the file iff PE_PRESENT. An entry without flags is present unless in_parent. Read with the small
protobuf reader in :mod:`gpusnap.criu.images` (why hand-written: see there).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

from gpusnap.criu.images import ImageFormatError, decode_message, read_entries

PAGEMAP_MAGIC = 0x56084025
PE_PARENT = 1
PE_LAZY = 2
PE_PRESENT = 4
PAGE_SIZE = 4096  # CRIU images of x86_64/arm64-4k; a size mismatch makes the caller ignore the ranges
PAGEMAP_NAME = re.compile(r"^pagemap-.*\.img$")


@dataclass(frozen=True)
class PageRange:
    vaddr: int  # virtual address of the first page
    file_offset: int  # byte offset in the pages file
    nr_pages: int


def parse_pagemap(data: bytes) -> tuple[int, list[PageRange]]:
    """(pages_id, ranges present in pages-<pages_id>.img, in file order)."""
    reader = PagemapReader()
    reader.feed(data)
    if reader.pending:
        read_entries(data, PAGEMAP_MAGIC)  # says how it is truncated
    if reader.pages_id is None:
        raise ImageFormatError("pagemap image has no head")
    return reader.pages_id, reader.ranges


def head_pages_id(data: bytes) -> int:
    """The pages id a pagemap image's head names (the file its entries' pages are in)."""
    read_entries(bytes(data[:8]), PAGEMAP_MAGIC)  # checks the magic
    if len(data) < 12:
        raise ImageFormatError("pagemap image has no head")
    (ln,) = struct.unpack_from("<I", data, 8)
    if 12 + ln > len(data):
        raise ImageFormatError("pagemap head is truncated")
    return _head_id(bytes(data[12:12 + ln]))


def _head_id(message: bytes) -> int:
    """pagemap_head.pages_id of a head message."""
    return int(decode_message(message).get(1, [0])[0])


class PagemapReader:
    """A pagemap image read as CRIU writes it: ``feed`` the bytes that were added to the file
    since the last call; ``ranges`` holds every range of the complete entries so far (an entry
    cut off at the end of what was fed waits for the rest)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pages_id: int | None = None
        self.ranges: list[PageRange] = []
        self.lazy: list[bool] = []  # per range: flagged PE_LAZY (CRIU's lazy restore may leave it to a page server)
        self.lazy_not_present = 0  # lazy entries whose pages are not in the file (dumped with --lazy-pages)
        self._offset = 0  # bytes of the pages file the ranges so far take
        self._magic = False

    @property
    def pending(self) -> int:
        """Bytes fed that do not make a complete entry (or the magic) yet."""
        return len(self.buf)

    def feed(self, data: bytes) -> list[PageRange]:
        """Take more bytes; returns the ranges they completed."""
        self.buf += data
        new: list[PageRange] = []
        pos = 0
        if not self._magic:
            if len(self.buf) < 8:
                return new
            read_entries(bytes(self.buf[:8]), PAGEMAP_MAGIC)  # checks the magic
            self._magic, pos = True, 8
        buf = self.buf
        end = len(buf)
        while pos + 4 <= end:
            (ln,) = struct.unpack_from("<I", buf, pos)
            if pos + 4 + ln > end:
                break
            start, pos = pos + 4, pos + 4 + ln
            if self.pages_id is None:
                self.pages_id = _head_id(bytes(buf[start:pos]))
                continue
            e = _entry_fields(buf, start, pos)
            if e is None:  # a field this reader does not expect: the general decoder
                e = _entry_of(decode_message(bytes(buf[start:pos])))
            r = self._range(*e)
            if r is not None:
                new.append(r)
        del self.buf[:pos]
        self.ranges.extend(new)
        return new

    def _range(self, vaddr: int, nr: int, in_parent: int, flags: int | None) -> PageRange | None:
        if flags is not None:
            present = bool(flags & PE_PRESENT)
        else:
            flags, present = 0, not in_parent
        if not (present and nr):
            if flags & PE_LAZY and not flags & PE_PARENT and nr:
                self.lazy_not_present += 1
            return None
        self.lazy.append(bool(flags & PE_LAZY))
        r = PageRange(vaddr, self._offset, nr)
        self._offset += nr * PAGE_SIZE
        return r


Entry = tuple[int, int, int, "int | None"]  # vaddr, page count, in_parent, flags (None: absent)


def _entry_of(f: dict[int, list[Any]]) -> Entry:
    """A pagemap entry's values from its decoded fields."""
    if 1 not in f:
        raise ImageFormatError("pagemap entry without vaddr")
    nr = int(f.get(2, [0])[0])
    if 5 in f and int(f[5][0]):
        nr = int(f[5][0])  # CRIU 4.2 moved the count to a uint64 (field 5) and writes 0 in field 2
    return int(f[1][0]), nr, int(f.get(3, [0])[0]), int(f[4][0]) if 4 in f else None


def _entry_fields(buf: bytearray, p: int, end: int) -> Entry | None:
    """A pagemap entry's values as _entry_of gives them, or None if it holds anything but
    varint fields 1-5, each once (then the general decoder reads it).

    Why not decode_message: a GPU process's pagemap holds tens of thousands of entries, and the
    store reads it before its first page (0.35 s on an H100 host's real server image,
    bench/results/gpu-h100-e2e-2026-11-27-thirteenth-server); this loop takes each one-byte key
    and varint in place, without a copy of the entry, a dict or a call per field."""
    vals = [None, None, None, None, None, None]
    while p < end:
        key = buf[p]
        num = key >> 3
        if key & 7 or not 1 <= num <= 5 or vals[num] is not None:
            return None
        p += 1
        val = shift = 0
        while True:
            if p >= end or shift > 63:
                return None  # truncated or too long: the general decoder says which
            b = buf[p]
            p += 1
            val |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
        vals[num] = val
    if vals[1] is None:
        return None
    nr = vals[5] or vals[2] or 0
    return vals[1], nr, vals[3] or 0, vals[4]


def merge_contiguous(ranges: list[PageRange]) -> list[PageRange]:
    """Join entries that continue each other in memory and in the file.

    CRIU splits one mapping into several entries for its own reasons (its page pipes hold a
    bounded number of pages); those splits say nothing about the content, and a buffer that
    moved would straddle them differently, so they must not force cuts.
    """
    out: list[PageRange] = []
    for r in ranges:
        if out:
            last = out[-1]
            if last.vaddr + last.nr_pages * PAGE_SIZE == r.vaddr and last.file_offset + last.nr_pages * PAGE_SIZE == r.file_offset:
                out[-1] = PageRange(last.vaddr, last.file_offset, last.nr_pages + r.nr_pages)
                continue
        out.append(r)
    return out


def ranges_of(pagemaps: dict[str, bytes], pages_name: str, size: int) -> list[PageRange] | None:
    """The merged memory ranges ``pages_name`` holds, in file order, or None when unknown
    (no pagemap names this file, it cannot be parsed, or it does not add up to ``size``)."""
    m = re.match(r"^pages-(\d+)\.img$", pages_name)
    if not m:
        return None
    want = int(m.group(1))
    for data in pagemaps.values():
        try:
            # The head first: a checkpoint of several processes has a pagemap per process, and
            # each pages file would otherwise parse every larger pagemap before its own.
            if head_pages_id(data) != want:
                continue
            pages_id, ranges = parse_pagemap(data)
        except ImageFormatError:
            continue
        merged = merge_contiguous(ranges)
        if sum(r.nr_pages for r in merged) * PAGE_SIZE != size:
            return None
        return merged
    return None


def boundaries(pagemaps: dict[str, bytes], pages_name: str, size: int) -> list[int] | None:
    """Page indexes (in ``pages_name``) where a new memory range starts, or None when unknown."""
    merged = ranges_of(pagemaps, pages_name, size)
    return None if merged is None else [r.file_offset // PAGE_SIZE for r in merged]
