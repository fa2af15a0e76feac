"""Which bytes of a restore's pages files are in place, while a pull or a materialize still writes them.

A lazy restore (gpusnap.criu.lazy_pages) needs very little of the pages files before CRIU can
let the process go: only the ranges CRIU copies itself (those its pagemap images do not flag
PE_LAZY: stacks, the vDSO's neighbours, SysV shared memory), a few MB of a multi-GB image. The
rest is the page server's, which copies each range when it is asked for it or when its turn
comes. So the restore need not wait for the whole directory: the image writer reports every
range as soon as it is written and verified, the engine lets CRIU read the pages once the
ranges it copies itself are in (:meth:`LandedPages.wait_eager`), and the page server follows
the same reports through a ledger file and copies only ranges that are in, holding a fault on
any other page until its range lands.

The ledger is a text file the restore appends to (one writer: the gpusnap process; the page
server, another process, follows it). Lines: ``+ NAME OFFSET LENGTH`` (bytes of the file NAME,
relative to the image directory, written and verified), ``=`` (every byte of every file is in),
``! REASON`` (the writer failed: nothing more will come).

The other way, the page server appends ``NAME OFFSET`` to the ledger's ``.wanted`` file for
every fault on a page not yet written, and the writer fetches the blob holding it next
(:meth:`LandedPages.wanted`): what the process touches first comes first, not in file order.
"""

from __future__ import annotations

import bisect
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.criu.images import ImageFormatError
from gpusnap.criu.pagemap import PAGE_SIZE, PAGEMAP_NAME, PagemapReader

LEDGER_NAME = "pages-landed.log"
PAGES_NAME = re.compile(r"^pages-(\d+)\.img$")


class LandedFailed(Exception):
    """The image writer failed, or stopped: the pages will never all be in."""


class Intervals:
    """Sorted, disjoint, merged byte ranges [lo, hi)."""

    def __init__(self) -> None:
        self.los: list[int] = []
        self.his: list[int] = []

    def add(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        # Every range that touches or overlaps [lo, hi) merges into one.
        i = bisect.bisect_left(self.his, lo)
        j = bisect.bisect_right(self.los, hi)
        if i < j:
            lo, hi = min(lo, self.los[i]), max(hi, self.his[j - 1])
        self.los[i:j] = [lo]
        self.his[i:j] = [hi]

    def run_end(self, lo: int, hi: int) -> int:
        """How far from ``lo`` (at most ``hi``) the bytes are in; ``lo`` when byte ``lo`` is not."""
        k = bisect.bisect_right(self.los, lo) - 1
        if k < 0 or self.his[k] <= lo:
            return lo
        return min(hi, self.his[k])

    def overlaps(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right(self.his, lo)
        return i < len(self.los) and self.los[i] < hi

    def covers(self, lo: int, hi: int) -> bool:
        return hi <= lo or self.run_end(lo, hi) >= hi

    def __len__(self) -> int:
        return len(self.los)


def eager_ranges(images: Path) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges of each pages file that CRIU copies itself in a lazy restore: every
    range of every pagemap image not flagged PE_LAZY, by pages file name."""
    out: dict[str, list[tuple[int, int]]] = {}
    for path in sorted(images.iterdir()):
        if not PAGEMAP_NAME.match(path.name):
            continue
        reader = PagemapReader()
        reader.feed(path.read_bytes())
        if reader.pending or reader.pages_id is None:
            raise ImageFormatError(f"{path.name} is truncated")
        wanted = out.setdefault(f"pages-{reader.pages_id}.img", [])
        for r, lazy in zip(reader.ranges, reader.lazy, strict=True):
            if not lazy:
                wanted.append((r.file_offset, r.file_offset + r.nr_pages * PAGE_SIZE))
    return {k: v for k, v in out.items() if v}


class LineTail:
    """The whole lines appended to a file since the last call (a line cut in two by the
    writer waits for its end): how each side reads what the other appends."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._rest = b""
        self._mu = threading.Lock()

    def lines(self) -> list[str]:
        with self._mu:
            if self._fd < 0:
                return []
            chunks = [self._rest]
            while data := os.read(self._fd, 1 << 20):
                chunks.append(data)
            buf = b"".join(chunks)
            cut = buf.rfind(b"\n") + 1
            self._rest = buf[cut:]
        return buf[:cut].decode(errors="replace").splitlines()

    def close(self) -> None:
        with self._mu:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def wanted_path(ledger: Path) -> Path:
    """Where the page server asks for the pages its faults wait on."""
    return ledger.with_name(ledger.name + ".wanted")


@dataclass
class LandedPages:
    """The writer's side, in the restoring process: :meth:`add` as ranges are written and
    verified, then :meth:`complete` or :meth:`fail`. Thread-safe (the writer's pool reports
    from many threads)."""

    path: Path  # the ledger the page server follows
    _files: dict[str, Intervals] = field(default_factory=dict)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _fd: int = -1
    _asks: LineTail | None = None
    done: bool = False
    failure: str | None = None

    def __post_init__(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
        os.close(os.open(wanted_path(self.path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
        self._asks = LineTail(wanted_path(self.path))

    def wanted(self) -> list[tuple[str, int]]:
        """(file name, offset) of the pages the page server asked for since the last call."""
        assert self._asks is not None
        out = []
        for line in self._asks.lines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                out.append((parts[0], int(parts[1])))
        return out

    def _append(self, line: str) -> None:
        if self._fd >= 0:
            os.write(self._fd, line.encode())

    def add(self, name: str, offset: int, length: int) -> None:
        if length <= 0 or not PAGES_NAME.match(name):
            return  # only the pages files are followed
        with self._cv:
            self._files.setdefault(name, Intervals()).add(offset, offset + length)
            self._append(f"+ {name} {offset} {length}\n")
            self._cv.notify_all()

    def complete(self) -> None:
        with self._cv:
            self.done = True
            self._append("=\n")
            self._cv.notify_all()

    def fail(self, reason: str) -> None:
        with self._cv:
            if not self.done and self.failure is None:
                self.failure = reason or "the image writer failed"
                self._append(f"! {' '.join(self.failure.split())}\n")
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        if self._asks is not None:
            self._asks.close()

    def first(self, images: Path) -> dict[str, list[tuple[int, int]]]:
        """What the writer should write first: the ranges CRIU copies itself (none where the
        pagemap images cannot be read: then CRIU's own reading of them fails, not this)."""
        try:
            return eager_ranges(images)
        except (OSError, ImageFormatError):
            return {}

    def wait_eager(self, images: Path, timeout: float | None = None) -> float:
        """Until every range CRIU copies itself is in (or all is); the seconds it waited.
        Raises LandedFailed if the writer failed first or ``timeout`` passed."""
        try:
            wanted = eager_ranges(images)
        except (OSError, ImageFormatError):
            wanted = {"": [(0, 1)]}  # unreadable pagemaps: wait for every page (CRIU says what is wrong)
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        with self._cv:
            while True:
                if self.failure is not None:
                    raise LandedFailed(self.failure)
                if self.done or all(self._files.get(n, Intervals()).covers(lo, hi) for n, rs in wanted.items() for lo, hi in rs):
                    return time.monotonic() - started
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise LandedFailed(f"the pages CRIU reads itself were not in within {timeout:g} s")
                self._cv.wait(left if left is not None else 1.0)


class LedgerFollower:
    """The page server's side: reads what was appended to the ledger since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tail = LineTail(path)

    def read(self) -> list[tuple[str, str, int, int]]:
        """New entries: ("+", name, offset, length), ("=", "", 0, 0) or ("!", reason, 0, 0)."""
        out: list[tuple[str, str, int, int]] = []
        for raw in self._tail.lines():
            if raw.startswith("+ "):
                parts = raw.split()
                if len(parts) != 4:
                    raise ValueError(f"bad ledger line {raw!r}")
                out.append(("+", parts[1], int(parts[2]), int(parts[3])))
            elif raw == "=":
                out.append(("=", "", 0, 0))
            elif raw.startswith("!"):
                out.append(("!", raw[1:].strip(), 0, 0))
            elif raw:
                raise ValueError(f"bad ledger line {raw!r}")
        return out

    def close(self) -> None:
        self._tail.close()
