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
protobuf reader in :mod:`gpusnap.packaging.pstree` (why hand-written: see there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpusnap.packaging.pstree import ImageFormatError, decode_message, read_entries

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
    entries = read_entries(data, PAGEMAP_MAGIC)
    if not entries:
        raise ImageFormatError("pagemap image has no head")
    head = decode_message(entries[0])
    pages_id = int(head.get(1, [0])[0])
    ranges: list[PageRange] = []
    offset = 0
    for raw in entries[1:]:
        f = decode_message(raw)
        if 1 not in f:
            raise ImageFormatError("pagemap entry without vaddr")
        vaddr, nr = int(f[1][0]), int(f.get(2, [0])[0])
        if 5 in f and int(f[5][0]):
            nr = int(f[5][0])  # CRIU 4.2 moved the count to a uint64 (field 5) and writes 0 in field 2
        if 4 in f:
            present = bool(int(f[4][0]) & PE_PRESENT)
        else:
            present = not int(f.get(3, [0])[0])
        if present and nr:
            ranges.append(PageRange(vaddr, offset, nr))
            offset += nr * PAGE_SIZE
    return pages_id, ranges


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
            pages_id, ranges = parse_pagemap(data)
        except ImageFormatError:
            continue
        if pages_id != want:
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
