"""What changed between two CRIU checkpoints, file by file and memory region by region.

    python -m gpusnap.packaging.ckdiff A B [--store DIR] [--json OUT] [--top N]

A and B are CRIU image directories, or references in a local store (materialized to a
temporary directory first). B is compared against A, as a second checkpoint against the first:

- every file: identical, differing (how many 4 KiB blocks, first differing offset), or only in
  one of them;
- every page CRIU dumped in B (pages-N.img, located by pagemap-*.img): ``same`` (A has the same
  content at the same address), ``moved`` (A has this content, but at another address: the
  allocator moved it, or the driver wrote its buffers in another order), ``changed`` (A had
  another content at this address, and this content nowhere), ``new`` (an address A did not
  dump, content A does not have); all-zero pages are counted as well;
- the same per mapping (the VMA list of mm-<pid>.img, named from files.img), and as regions
  (runs of consecutive pages of one kind), largest first;
- the most common address shifts of moved pages (pages are compared whole: content copied to
  an address that is not a whole number of pages away, as malloc places small objects, shares no
  page with its original and shows as changed or new, not moved);
- what would be sent: an ideal page-level dedup against A (distinct B pages A lacks, plus
  every differing non-page file), fixed-size pieces of the pages stream at several sizes
  (what any chunking that ignores CRIU's structure at best achieves), and the whole pages files.

Why the image files are parsed here: see gpusnap.criu.images (no CRIU reader is
installable; the images are length-prefixed protobuf messages); the pagemaps through
gpusnap.criu.pagemap. Fields used here, from CRIU's images/*.proto: mm_entry.vmas=14;
vma_entry start=1 end=2 pgoff=3 shmid=4 prot=5 flags=6 status=7; file_entry type=1 id=2 reg=3;
reg_file_entry name=6.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.criu.pagemap import parse_pagemap
from gpusnap.criu.images import IMG_COMMON_MAGIC, ImageFormatError, decode_message, read_entries

PAGE = 4096
MM_MAGIC = 0x57492820
FILES_MAGIC = 0x56303138
# vma_entry.status bits (criu/include/image.h)
VMA_STATUS = {1 << 1: "stack", 1 << 2: "vsyscall", 1 << 3: "vdso", 1 << 5: "heap", 1 << 6: "file-private",
              1 << 7: "file-shared", 1 << 8: "anon-shared", 1 << 9: "anon-private", 1 << 10: "sysvipc",
              1 << 11: "socket", 1 << 12: "vvar", 1 << 13: "aio", 1 << 14: "memfd"}
KINDS = ("same", "moved", "changed", "new")
ZERO_DIGEST = hashlib.blake2b(bytes(PAGE), digest_size=16).digest()
WINDOWS_KIB = (64, 1024, 4096, 16384)
READ_PAGES = 2048  # pages read from a pages file at once (8 MiB)
JSON_MAPPINGS = 500  # mappings in the JSON report, most non-same pages first (a GPU process has thousands)


@dataclass(frozen=True)
class PageRange:
    """One pagemap entry whose pages are in the pages file, at ``offset``."""

    vaddr: int
    pages: int
    offset: int


@dataclass
class PageMap:
    name: str  # pagemap-1.img, pagemap-shmem-7.img, ...
    space: str  # whose addresses: "pid 1", "shmem 7"
    pages_file: str
    ranges: list[PageRange]


@dataclass(frozen=True)
class Vma:
    start: int
    end: int
    prot: int
    status: int
    name: str

    def label(self) -> str:
        prot = "".join(c if self.prot & b else "-" for c, b in (("r", 1), ("w", 2), ("x", 4)))
        return f"{self.start:#x}-{self.end:#x} {prot} {self.name} ({_size(self.end - self.start)})"


@dataclass
class Tally:
    same: int = 0
    moved: int = 0
    changed: int = 0
    new: int = 0
    zero: int = 0

    def add(self, kind: str, zero: bool) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.zero += zero

    @property
    def total(self) -> int:
        return self.same + self.moved + self.changed + self.new

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass
class Region:
    space: str
    start: int
    pages: int
    kind: str
    vma: str


@dataclass
class FileDiff:
    name: str
    size_a: int | None
    size_b: int | None
    status: str  # identical | differs | only-a | only-b
    blocks_differing: int = 0
    first_difference: int | None = None


@dataclass
class Report:
    a: str
    b: str
    files: list[FileDiff]
    pages: Tally
    per_mapping: list[dict[str, Any]]
    regions: list[Region]
    shifts: list[tuple[int, int]]  # (B address - A address, pages), most common first
    send: dict[str, int]
    windows: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "files": [asdict(f) for f in self.files], "pages": self.pages.to_dict(),
            "per_mapping": self.per_mapping[:JSON_MAPPINGS], "mappings": len(self.per_mapping), "regions": [asdict(r) for r in self.regions],
            "shifts": [{"delta": d, "pages": n} for d, n in self.shifts], "send": self.send, "windows": self.windows,
        }


def _image(path: Path, magic: int) -> list[dict[int, list[Any]]]:
    data = path.read_bytes()
    if len(data) >= 8 and struct.unpack_from("<I", data, 0)[0] != IMG_COMMON_MAGIC:
        raise ImageFormatError(f"{path.name}: not a CRIU image")
    return [decode_message(e) for e in read_entries(data, magic)]


def read_pagemaps(images: Path) -> list[PageMap]:
    """Every pagemap*.img of ``images`` with the ranges its pages file holds, in file order
    (read by gpusnap.criu.pagemap, which the chunker uses too)."""
    out = []
    for path in sorted(images.glob("pagemap-*.img")):
        pages_id, ranges = parse_pagemap(path.read_bytes())
        stem = path.name[len("pagemap-"):-len(".img")]
        space = f"shmem {stem[len('shmem-'):]}" if stem.startswith("shmem-") else f"pid {stem}"
        out.append(PageMap(path.name, space, f"pages-{pages_id}.img", [PageRange(r.vaddr, r.nr_pages, r.file_offset) for r in ranges]))
    return out


def _file_names(images: Path) -> dict[int, str]:
    path = images / "files.img"
    names: dict[int, str] = {}
    if not path.exists():
        return names
    for e in _image(path, FILES_MAGIC):
        if e.get(1, [0])[0] == 1 and 3 in e:  # FD_TYPES__REG
            reg = decode_message(e[3][0])
            names[int(e[2][0])] = reg.get(6, [b"?"])[0].decode("utf-8", "replace")
    return names


def read_vmas(images: Path) -> dict[str, list[Vma]]:
    """``"pid N"`` → that process's mappings, from mm-N.img (file mappings named from files.img)."""
    names = _file_names(images)
    out: dict[str, list[Vma]] = {}
    for path in sorted(images.glob("mm-*.img")):
        entries = _image(path, MM_MAGIC)
        vmas = []
        for raw in entries[0].get(14, []) if entries else []:
            v = decode_message(raw)
            start, end, prot, status = (int(v.get(k, [0])[0]) for k in (1, 2, 5, 7))
            kinds = [n for bit, n in VMA_STATUS.items() if status & bit]
            if "file-private" in kinds or "file-shared" in kinds or "memfd" in kinds:
                name = names.get(int(v.get(4, [0])[0]), "file ?")
            elif kinds:
                name = "[" + ",".join(kinds) + "]"
            else:
                name = "[?]"
            vmas.append(Vma(start, end, prot, status, name))
        out[f"pid {path.name[3:-4]}"] = sorted(vmas, key=lambda x: x.start)
    return out


def page_digests(images: Path, pm: PageMap) -> Iterator[tuple[int, bytes]]:
    """(address, 16-byte BLAKE2b of the page) for every page of ``pm``, in pages-file order."""
    with open(images / pm.pages_file, "rb") as f:
        for r in pm.ranges:
            f.seek(r.offset)
            done = 0
            while done < r.pages:
                n = min(READ_PAGES, r.pages - done)
                buf = f.read(n * PAGE)
                if len(buf) != n * PAGE:
                    raise ImageFormatError(f"{pm.pages_file}: shorter than {pm.name} says")
                view = memoryview(buf)
                for k in range(n):
                    yield r.vaddr + (done + k) * PAGE, hashlib.blake2b(view[k * PAGE:(k + 1) * PAGE], digest_size=16).digest()
                done += n


def _vma_of(vmas: list[Vma], addr: int, hint: list[int]) -> Vma | None:
    # Pages come in address order within a range: try the last hit first, then bisect.
    i = hint[0]
    if i < len(vmas) and vmas[i].start <= addr < vmas[i].end:
        return vmas[i]
    lo, hi = 0, len(vmas)
    while lo < hi:
        mid = (lo + hi) // 2
        if vmas[mid].end <= addr:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(vmas) and vmas[lo].start <= addr:
        hint[0] = lo
        return vmas[lo]
    return None


def _compare_files(a: Path, b: Path) -> list[FileDiff]:
    out = []
    names = sorted({p.name for p in a.iterdir() if p.is_file()} | {p.name for p in b.iterdir() if p.is_file()})
    for name in names:
        pa, pb = a / name, b / name
        if not pa.exists() or not pb.exists():
            out.append(FileDiff(name, pa.stat().st_size if pa.exists() else None, pb.stat().st_size if pb.exists() else None,
                                "only-a" if pa.exists() else "only-b"))
            continue
        d = FileDiff(name, pa.stat().st_size, pb.stat().st_size, "identical")
        with open(pa, "rb") as fa, open(pb, "rb") as fb:
            offset = 0
            while True:
                x, y = fa.read(1 << 20), fb.read(1 << 20)
                if not x and not y:
                    break
                if x != y:
                    for k in range(0, max(len(x), len(y)), PAGE):
                        if x[k:k + PAGE] != y[k:k + PAGE]:
                            d.blocks_differing += 1
                            if d.first_difference is None:
                                d.first_difference = offset + k
                offset += max(len(x), len(y))
        if d.blocks_differing:
            d.status = "differs"
        out.append(d)
    return out


def diff(a: Path, b: Path, *, top: int = 15) -> Report:
    """Compare checkpoint image directory ``b`` against ``a``."""
    a, b = Path(a), Path(b)
    files = _compare_files(a, b)
    # A: address → digest per address space, and every digest with one address it was seen at.
    at_a: dict[str, dict[int, bytes]] = {}
    where_a: dict[bytes, tuple[str, int]] = {}
    for pm in read_pagemaps(a):
        space = at_a.setdefault(pm.space, {})
        for addr, dg in page_digests(a, pm):
            space[addr] = dg
            where_a.setdefault(dg, (pm.space, addr))
    vmas = read_vmas(b)
    total = Tally()
    per_vma: dict[tuple[str, Vma | None], Tally] = {}
    regions: list[Region] = []
    shifts: Counter[int] = Counter()
    sent: set[bytes] = set()
    windows = {kib: [0, 0] for kib in WINDOWS_KIB}  # window size → [windows with a page A lacks, windows]
    window_state = {kib: [0, False] for kib in WINDOWS_KIB}
    pages_bytes = 0
    for pm in read_pagemaps(b):
        space_a = at_a.get(pm.space, {})
        space_vmas = vmas.get(pm.space, [])
        hint = [0]
        run: Region | None = None
        for addr, dg in page_digests(b, pm):
            pages_bytes += PAGE
            prev = space_a.get(addr)
            if prev == dg:
                kind = "same"
            elif dg in where_a:
                kind = "moved"
                src_space, src = where_a[dg]
                if src_space == pm.space and dg != ZERO_DIGEST:
                    shifts[addr - src] += 1
            else:
                kind = "changed" if prev is not None else "new"
                sent.add(dg)
            zero = dg == ZERO_DIGEST
            total.add(kind, zero)
            vma = _vma_of(space_vmas, addr, hint) if space_vmas else None
            per_vma.setdefault((pm.space, vma), Tally()).add(kind, zero)
            for kib, st in window_state.items():
                st[0] += 1
                st[1] = st[1] or kind in ("changed", "new")
                if st[0] * PAGE >= kib * 1024:
                    windows[kib][0] += st[1]
                    windows[kib][1] += 1
                    st[0], st[1] = 0, False
            label = vma.label() if vma else pm.space
            if run is not None and run.kind == kind and run.start + run.pages * PAGE == addr and run.vma == label:
                run.pages += 1
            else:
                run = Region(pm.space, addr, 1, kind, label)
                regions.append(run)
    for kib, st in window_state.items():
        if st[0]:
            windows[kib][0] += st[1]
            windows[kib][1] += 1
    pages_files = {pm.pages_file for pm in read_pagemaps(b)}
    other = sum(f.size_b or 0 for f in files if f.status in ("differs", "only-b") and f.name not in pages_files)
    send = {
        "pages_bytes": pages_bytes,
        "ideal_page_dedup_bytes": len(sent) * PAGE + other,
        "changed_other_files_bytes": other,
        "whole_files_bytes": sum(f.size_b or 0 for f in files if f.status in ("differs", "only-b")),
    }
    for kib, (hit, n) in windows.items():
        send[f"fixed_{kib}k_pieces_bytes"] = min(hit * kib * 1024, pages_bytes) + other
    per_mapping = [
        {"space": space, "vma": vma.label() if vma else "(no mapping in mm image)", **t.to_dict()}
        for (space, vma), t in sorted(per_vma.items(), key=lambda kv: -(kv[1].total - kv[1].same))
    ]
    changed_regions = sorted((r for r in regions if r.kind != "same"), key=lambda r: -r.pages)[:top]
    return Report(str(a), str(b), files, total, per_mapping, changed_regions, shifts.most_common(top), send,
                  {f"{kib}k": hit for kib, (hit, _) in windows.items()} | {f"{kib}k_total": n for kib, (_, n) in windows.items()})


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _size(n: int) -> str:
    return f"{n >> 10} KiB" if n < 1 << 20 else _mib(n)


def format_report(r: Report, top: int = 15) -> str:
    lines = [f"A: {r.a}", f"B: {r.b}", "", "files (B against A):"]
    for f in r.files:
        if f.status == "identical":
            continue
        extra = f", {f.blocks_differing} 4 KiB blocks differ, first at {f.first_difference}" if f.status == "differs" else ""
        lines.append(f"  {f.name:<32} {f.status:<9} A {f.size_a} B {f.size_b}{extra}")
    same = sum(1 for f in r.files if f.status == "identical")
    lines.append(f"  ({same} files identical)")
    t = r.pages
    n = max(t.total, 1)
    lines += ["", f"pages of B: {t.total} ({_mib(t.total * PAGE)}); " + ", ".join(
        f"{k} {getattr(t, k)} ({getattr(t, k) / n:.1%})" for k in KINDS) + f"; all-zero {t.zero} ({t.zero / n:.1%})"]
    lines += ["", f"mappings, most non-same pages first (top {top}):",
              f"  {'same':>8} {'moved':>8} {'changed':>8} {'new':>8} {'zero':>8}  mapping"]
    for m in r.per_mapping[:top]:
        lines.append(f"  {m['same']:>8} {m['moved']:>8} {m['changed']:>8} {m['new']:>8} {m['zero']:>8}  {m['space']} {m['vma']}")
    lines += ["", f"largest regions that are not 'same' (top {top}):"]
    for g in r.regions:
        lines.append(f"  {g.kind:<8} {g.space} {g.start:#x} +{_size(g.pages * PAGE)} in {g.vma}")
    if r.shifts:
        lines += ["", "moved pages, most common address shift (B - A):"]
        lines += [f"  {d:+#x}: {k} pages" for d, k in r.shifts]
    s = r.send
    lines += ["", "what a second push would send:",
              f"  whole differing files       {_mib(s['whole_files_bytes'])}",
              *(f"  fixed {kib} KiB pieces{' ' * (9 - len(str(kib)))}{_mib(s[f'fixed_{kib}k_pieces_bytes'])}" for kib in WINDOWS_KIB),
              f"  ideal page-level dedup      {_mib(s['ideal_page_dedup_bytes'])} "
              f"({s['ideal_page_dedup_bytes'] / max(s['pages_bytes'], 1):.2%} of the {_mib(s['pages_bytes'])} of pages)"]
    return "\n".join(lines)


def _materialize(arg: str, store: Path | None, tmp: Path) -> Path:
    path = Path(arg)
    if path.is_dir():
        return path
    from gpusnap.config import load_settings
    from gpusnap.packaging.api import materialize_checkpoint

    store_dir = store or load_settings().store_dir
    dest = tmp / hashlib.sha256(arg.encode()).hexdigest()[:12]
    return materialize_checkpoint(store_dir, arg, dest, form="criu-dir")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpusnap.packaging.ckdiff", description=__doc__.splitlines()[0])
    ap.add_argument("a", help="first checkpoint: CRIU image directory or stored reference")
    ap.add_argument("b", help="second checkpoint, compared against the first")
    ap.add_argument("--store", type=Path, help="local store for references (default: GPUSNAP_STORE / settings)")
    ap.add_argument("--tmp", type=Path, help="where references are materialized (default: a temporary directory)")
    ap.add_argument("--json", type=Path, help="also write the whole report here as JSON")
    ap.add_argument("--top", type=int, default=15, help="rows of mappings, regions and shifts to show")
    args = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="gpusnap-ckdiff-", dir=args.tmp) as tmp:
            a = _materialize(args.a, args.store, Path(tmp))
            b = _materialize(args.b, args.store, Path(tmp))
            report = diff(a, b, top=args.top)
    except (ImageFormatError, OSError) as exc:
        print(f"ckdiff: {exc}", file=sys.stderr)
        return 2
    print(format_report(report, args.top))
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
