"""gpusnap.criu.lazy_pages: the pending-range bookkeeping, the images it reads, and the server
against a real userfaultfd of this process, with this test in CRIU's place on the socket."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import pytest

from gpusnap.criu import lazy_pages as lp
from gpusnap.criu.pagemap import PE_LAZY, PE_PRESENT

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: criu_images
from criu_images import mm, pagemap  # noqa: E402

PAGE = 4096


def test_pending_take_splits_and_keeps_the_rest() -> None:
    p = lp.Pending([lp.Interval(0x1000, 0x9000, 100), lp.Interval(0x20000, 0x22000, 900)])
    got = p.take(0x3000, 0x21000)
    assert [(i.start, i.end, i.src) for i in got] == [(0x3000, 0x9000, 100 + 0x2000), (0x20000, 0x21000, 900)]
    assert [(i.start, i.end, i.src) for i in p.items] == [(0x1000, 0x3000, 100), (0x21000, 0x22000, 900 + 0x1000)]
    assert p.starts == [0x1000, 0x21000]
    assert p.find(0x21800) is p.items[1] and p.find(0x5000) is None


def test_pending_next_chunk_goes_on_from_the_cursor_and_wraps() -> None:
    p = lp.Pending([lp.Interval(0x0, 0x10000, 0), lp.Interval(0x40000, 0x48000, 0x10000)])
    a = p.next_chunk(0x41000, 0x2000)
    assert (a.start, a.end, a.src) == (0x41000, 0x43000, 0x11000)
    b = p.next_chunk(0x50000, 0x4000)  # past the last range: from the first
    assert (b.start, b.end) == (0x0, 0x4000)
    c = p.next_chunk(0x20000, 0x100000)  # in a gap: the next range, whole
    assert (c.start, c.end) == (0x40000, 0x41000)
    assert p.bytes() == 0xC000 + 0x5000


def test_pending_move_follows_mremap() -> None:
    p = lp.Pending([lp.Interval(0x10000, 0x14000, 7)])
    p.move(0x12000, 0x80000, 0x2000)
    assert [(i.start, i.end, i.src) for i in p.items] == [(0x10000, 0x12000, 7), (0x80000, 0x82000, 7 + 0x2000)]


def test_lazy_ranges_are_cut_at_mapping_ends_and_skip_eager_entries() -> None:
    pm = pagemap(3, [(0x10000, 4, PE_PRESENT, False), (0x20000, 6, PE_PRESENT | PE_LAZY, False), (0x40000, 2, PE_PRESENT | PE_LAZY, False)])
    pages_id, ranges = lp.lazy_ranges(pm, [(0x10000, 0x14000), (0x20000, 0x23000), (0x23000, 0x26000), (0x40000, 0x42000)])
    assert pages_id == 3
    assert ranges == [lp.LazyRange(0x20000, 4 * PAGE, 3 * PAGE), lp.LazyRange(0x23000, 7 * PAGE, 3 * PAGE), lp.LazyRange(0x40000, 10 * PAGE, 2 * PAGE)]


def test_lazy_pages_left_out_of_the_images_are_refused() -> None:
    pm = pagemap(1, [(0x10000, 4, PE_LAZY, False)])  # dumped with --lazy-pages: not in pages-1.img
    with pytest.raises(lp.LazyPagesError, match="cannot be served"):
        lp.lazy_ranges(pm, [(0x10000, 0x14000)])


def test_mapping_ends_reads_the_mm_image() -> None:
    assert lp.mapping_ends(mm([(0x5000, 0x6000), (0x1000, 0x3000)])) == [(0x1000, 0x3000), (0x5000, 0x6000)]


# -- a real userfaultfd of this process ------------------------------------------------------
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine)
UFFDIO_API, UFFDIO_REGISTER = 0xC018AA3F, 0xC020AA00
FEATURE_EVENT_REMAP, FEATURE_EVENT_REMOVE, FEATURE_EVENT_UNMAP = 1 << 2, 1 << 3, 1 << 6
USER_MODE_ONLY = 1


def open_uffd() -> int:
    if SYS_USERFAULTFD is None:
        pytest.skip("userfaultfd syscall number unknown on this machine")
    import fcntl

    fd = libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK | USER_MODE_ONLY)
    if fd < 0:
        pytest.skip(f"no userfaultfd here: {os.strerror(ctypes.get_errno())}")
    buf = bytearray(struct.pack("<QQQ", 0xAA, FEATURE_EVENT_REMAP | FEATURE_EVENT_REMOVE | FEATURE_EVENT_UNMAP, 0))
    fcntl.ioctl(fd, UFFDIO_API, buf, True)
    return fd


def register(fd: int, addr: int, length: int) -> None:
    import fcntl

    fcntl.ioctl(fd, UFFDIO_REGISTER, bytearray(struct.pack("<QQQQ", addr, length, 1, 0)), True)


def read_memory(addr: int, length: int) -> bytes:
    # ctypes.memmove releases the interpreter lock, so the server's threads run while this
    # thread waits in a page fault (ctypes.string_at would hold it: a deadlock).
    buf = ctypes.create_string_buffer(length)
    ctypes.memmove(buf, addr, length)
    return buf.raw


class FakeRestore:
    """This test in CRIU's place: a region of this process registered with a userfaultfd, its
    images written as CRIU would, and the socket protocol of ``criu restore --lazy-pages``."""

    def __init__(self, tmp: Path, npages: int, lazy: list[tuple[int, int]], hole: tuple[int, int], landed: Path | None = None) -> None:
        self.images, self.work = tmp / "images", tmp / "work"
        self.images.mkdir()
        self.work.mkdir()
        self.length = npages * PAGE
        addr = libc.mmap(None, self.length, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
        assert addr not in (None, ctypes.c_void_p(-1).value)
        self.addr = addr
        self.uffd = open_uffd()
        register(self.uffd, addr, self.length)
        self.data = os.urandom(self.length)
        entries, pages = [], b""
        for first, n in lazy:  # (first page, pages), in order, not touching ``hole``
            entries.append((addr + first * PAGE, n, PE_PRESENT | PE_LAZY, False))
            pages += self.data[first * PAGE:(first + n) * PAGE]
        self.hole = hole
        (self.images / "pagemap-7.img").write_bytes(pagemap(1, entries))
        (self.images / "mm-7.img").write_bytes(mm([(addr, addr + self.length)]))
        self.pages = pages
        # ``landed``: the pages file is still being written (all zeros until land() says)
        (self.images / "pages-1.img").write_bytes(pages if landed is None else bytes(len(pages)))
        self.server = lp.Server(self.images, self.work, threads=3, landed=landed)
        self.server.listen()
        self.summary: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(self.work / lp.SOCKET_NAME))

    def _serve(self) -> None:
        try:
            self.summary = self.server.run(accept_timeout=10)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.error = exc

    def send_task(self, pid: int = 7) -> None:
        self.sock.sendall(struct.pack("<i", pid))
        socket.send_fds(self.sock, [b"\0"], [self.uffd])

    def finish(self) -> None:
        self.sock.sendall(struct.pack("<I", lp.RESTORE_FINISHED))
        self.sock.close()

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not end"
        os.close(self.uffd)

    def expected(self) -> bytes:
        out = bytearray(self.length)
        h0, hn = self.hole
        for i in range(self.length // PAGE):
            if not h0 <= i < h0 + hn:
                out[i * PAGE:(i + 1) * PAGE] = self.data[i * PAGE:(i + 1) * PAGE]
        return bytes(out)


def test_server_fills_faults_before_and_everything_after_the_restore_finishes(tmp_path: Path) -> None:
    npages = 2048  # 8 MiB: two background chunks and more
    r = FakeRestore(tmp_path, npages, lazy=[(0, 1000), (1010, 1038)], hole=(1000, 10))
    r.send_task()
    # Before "restore finished" only faults are served: a read in the middle gets its pages.
    got = read_memory(r.addr + 1500 * PAGE, 3 * PAGE)
    assert got == r.data[1500 * PAGE:1503 * PAGE]
    hole = read_memory(r.addr + 1003 * PAGE, PAGE)  # in no lazy entry: never written before the dump
    assert hole == bytes(PAGE)
    r.finish()
    r.join()
    assert r.error is None, r.error
    assert read_memory(r.addr, r.length) == r.expected()
    s = r.summary
    assert s is not None and s["tasks"] == 1 and s["lazy_bytes"] == 2038 * PAGE
    assert s["copied_bytes"] == 2038 * PAGE and s["faults"] >= 2 and s["zero_pages"] >= 1 and s["fault_bytes"] > 0
    json.dumps(s)
    assert not (r.work / lp.SOCKET_NAME).exists()
    libc.munmap(r.addr, r.length)


def test_memory_the_process_drops_is_not_brought_back(tmp_path: Path) -> None:
    npages = 512
    r = FakeRestore(tmp_path, npages, lazy=[(0, 512)], hole=(0, 0))
    r.send_task()
    # MADV_DONTNEED on a registered range: a REMOVE event, read before the madvise goes on;
    # the server must not copy those pages afterwards, and the range is the kernel's again.
    done = threading.Event()

    def drop() -> None:
        assert libc.madvise(r.addr + 100 * PAGE, 50 * PAGE, 4) == 0  # MADV_DONTNEED
        done.set()

    t = threading.Thread(target=drop)
    t.start()
    assert done.wait(10), "madvise waited for an event nobody read"
    r.finish()
    r.join()
    assert r.error is None, r.error
    mem = read_memory(r.addr, r.length)
    assert mem[100 * PAGE:150 * PAGE] == bytes(50 * PAGE)
    assert mem[:100 * PAGE] == r.data[:100 * PAGE] and mem[150 * PAGE:] == r.data[150 * PAGE:]
    assert r.summary["dropped_bytes"] == 50 * PAGE and r.summary["events"].get("remove") == 1
    libc.munmap(r.addr, r.length)


def test_a_process_without_images_fails_the_server_with_its_reason(tmp_path: Path) -> None:
    r = FakeRestore(tmp_path, 16, lazy=[(0, 16)], hole=(0, 0))
    r.send_task(pid=99)  # no mm-99.img / pagemap-99.img
    r.sock.close()
    r.thread.join(30)
    assert isinstance(r.error, lp.LazyPagesError) and "process 99" in str(r.error)
    os.close(r.uffd)
    libc.munmap(r.addr, r.length)


def test_main_says_ready_then_reports_one_json_line(tmp_path: Path) -> None:
    import subprocess

    images, work = tmp_path / "images", tmp_path / "work"
    images.mkdir()
    work.mkdir()
    p = subprocess.Popen([sys.executable, "-m", "gpusnap.criu.lazy_pages", str(images), str(work), "--accept-timeout", "0.5"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline() == "ready\n"
    assert (work / lp.SOCKET_NAME).exists()
    line = p.stdout.readline()
    assert p.wait(10) == 1
    assert "no restore connected" in json.loads(line)["error"]
    time.sleep(0)  # nothing else to wait for


def test_faults_racing_the_background_copies_never_get_zero_pages(tmp_path: Path) -> None:
    """Readers fault all over the memory while the background copies run: a page being taken
    for a copy is never mistaken for one the images do not hold (which gets the zero page).
    A stress check: the race it guards (a range taken and not yet in flight) was met in real
    restores (bench/e2e.py on the VM), too narrow to force from here."""
    import random

    npages = 16384  # 64 MiB
    r = FakeRestore(tmp_path, npages, lazy=[(0, npages)], hole=(0, 0))
    r.send_task()
    r.finish()
    seen: list[bytes] = []

    def reader(seed: int) -> None:
        # Each read lands where the background goes on after the last fault (the end of the
        # fault's range): the range a worker has just taken, the narrowest race there is.
        rnd = random.Random(seed)
        step = lp.FAULT_CHUNK // PAGE
        for _ in range(40):
            p = rnd.randrange(npages)
            while p < npages:
                seen.append(read_memory(r.addr + p * PAGE, 8) + p.to_bytes(4, "little"))
                p += step

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    r.join()
    assert r.error is None, r.error
    for item in seen:
        p = int.from_bytes(item[8:], "little")
        assert item[:8] == r.data[p * PAGE:p * PAGE + 8]
    assert r.summary["zero_pages"] == 0 and r.summary["copied_bytes"] == npages * PAGE
    assert read_memory(r.addr, r.length) == r.data
    libc.munmap(r.addr, r.length)


def test_the_setting_is_auto_unless_said() -> None:
    from gpusnap.config import load_settings
    from gpusnap.errors import UsageError

    assert load_settings(env={}).lazy_pages is None
    assert load_settings(env={"GPUSNAP_LAZY_PAGES": "auto"}).lazy_pages is None
    assert load_settings(env={"GPUSNAP_LAZY_PAGES": "0"}).lazy_pages is False
    assert load_settings(env={"GPUSNAP_LAZY_PAGES": "true"}).lazy_pages is True
    with pytest.raises(UsageError, match="true or false or auto"):
        load_settings(env={"GPUSNAP_LAZY_PAGES": "sometimes"})


def test_host_support_names_what_is_missing() -> None:
    assert lp.host_support("sparc64") == (False, "no userfaultfd system call known for sparc64")


def test_who_decides_a_restore_is_lazy(tmp_path: Path) -> None:
    from gpusnap.config import load_settings
    from gpusnap.engines.orchestrate import _lazy_pages
    from gpusnap.errors import UsageError

    class Lazy:
        name, LAZY_PAGES = "runc-direct", True

    class Eager:
        name = "podman"

    said: list[str] = []
    auto = load_settings(env={})
    host_ok = lp.host_support()[0]
    assert _lazy_pages(auto, Lazy(), "ref", None, said.append) is host_ok  # auto: where the kernel can
    assert _lazy_pages(auto, Lazy(), "ref", False, said.append) is False  # --eager-pages
    assert _lazy_pages(auto, Eager(), "ref", None, said.append) is False  # auto, an engine that cannot
    with pytest.raises(UsageError, match="runc-direct engine only.*--eager-pages"):
        _lazy_pages(auto, Eager(), "ref", True, said.append)  # asked for, where it cannot be
    off = load_settings(env={"GPUSNAP_LAZY_PAGES": "false"})
    assert _lazy_pages(off, Lazy(), "ref", None, said.append) is False
    if host_ok:
        assert _lazy_pages(off, Lazy(), "ref", True, said.append) is True  # the command line wins


def _mapping_rss_kib(base: int) -> int:
    smaps = Path("/proc/self/smaps").read_text().split("\n")
    head = next(i for i, ln in enumerate(smaps) if ln.startswith(f"{base:x}-"))
    return next(int(ln.split()[1]) for ln in smaps[head + 1:head + 30] if ln.startswith("Rss:"))


def test_the_servers_view_of_copied_pages_is_dropped(tmp_path: Path) -> None:
    """Its resident size stays that of the copies in flight: a copied range's view of the mapped
    pages file is dropped (the file keeps the bytes, and a fork's second copy reads them again)."""
    data = os.urandom(16 << 20)
    (tmp_path / "pages-3.img").write_bytes(data)
    files = lp.PagesFiles(tmp_path)
    base, size = files.base(3)
    assert size == len(data) and read_memory(base, size) == data
    assert _mapping_rss_kib(base) >= 15 * 1024
    files.release(base, 8 << 20)
    assert _mapping_rss_kib(base) <= 8 * 1024 + 64
    assert read_memory(base, size) == data
    files.close()


def test_a_server_whose_restore_never_came_ends_with_its_starter(tmp_path: Path) -> None:
    """Without a timeout it waits as long as a pull may take, but not past the process that
    started it (a gpusnap restore killed before runc ran)."""
    import subprocess

    images, work, out = tmp_path / "images", tmp_path / "work", tmp_path / "out"
    images.mkdir()
    work.mkdir()
    starter = subprocess.run(["sh", "-c", f'"{sys.executable}" -m gpusnap.criu.lazy_pages "{images}" "{work}" > "{out}" 2>&1 & echo $!; sleep 0.5'],
                             capture_output=True, text=True, check=True)
    pid = int(starter.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    lines = out.read_text().splitlines()
    assert lines[0] == "ready" and "is gone" in json.loads(lines[-1])["error"]


def test_fill_incomplete_reads_the_marker_and_the_servers_life(tmp_path: Path) -> None:
    import subprocess

    marker = tmp_path / "lazy-fill.pending"
    assert not lp.fill_incomplete(marker)  # no marker: nothing was lazy, or it finished
    marker.write_text(f"{os.getpid()}\n")
    assert not lp.fill_incomplete(marker)  # its server still runs
    gone = subprocess.Popen(["true"])
    gone.wait()
    marker.write_text(f"{gone.pid}\n")
    assert lp.fill_incomplete(marker)
    marker.write_text("garbage")
    assert not lp.fill_incomplete(marker)


# -- pages files still being written (gpusnap.criu.landed) -----------------------------------
def land(r: FakeRestore, ledger: "LandedPages", lo: int, hi: int) -> None:  # noqa: F821 - imported below
    """The writer's part: bytes [lo, hi) of pages-1.img written, then reported."""
    with open(r.images / "pages-1.img", "r+b") as f:
        f.seek(lo)
        f.write(r.pages[lo:hi])
    ledger.add("pages-1.img", lo, hi - lo)


def test_pages_still_being_written_are_copied_as_they_land_and_faults_wait_for_theirs(tmp_path: Path) -> None:
    from gpusnap.criu.landed import LandedPages

    npages = 4096  # 16 MiB
    ledger = LandedPages(tmp_path / "landed.log")
    r = FakeRestore(tmp_path, npages, lazy=[(0, npages)], hole=(0, 0), landed=ledger.path)
    land(r, ledger, 0, 1000 * PAGE)
    r.send_task()
    r.finish()
    # A page already in is served at once; one not yet written waits until it lands.
    assert read_memory(r.addr + 10 * PAGE, PAGE) == r.data[10 * PAGE:11 * PAGE]
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(read_memory(r.addr + 3000 * PAGE, 2 * PAGE)), daemon=True)
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and not got, "a fault on a page not written yet was answered"
    assert ledger.wanted() == [("pages-1.img", 3000 * PAGE)]  # the writer is asked for it next
    # A piece that ends inside a page: that page is not whole yet, so it is not copied.
    land(r, ledger, 2900 * PAGE, 3000 * PAGE + 100)
    reader.join(0.3)
    assert reader.is_alive()
    land(r, ledger, 3000 * PAGE + 100, 3100 * PAGE)
    reader.join(10)
    assert got == [r.data[3000 * PAGE:3002 * PAGE]]
    # The rest lands out of order; then the writer says it is done.
    for lo, hi in [(3100, npages), (1000, 2900)]:
        land(r, ledger, lo * PAGE, hi * PAGE)
    ledger.complete()
    r.join()
    assert r.error is None, r.error
    assert read_memory(r.addr, r.length) == r.data
    s = r.summary
    assert s is not None and s["copied_bytes"] == npages * PAGE and s["deferred_faults"] >= 1
    ledger.close()
    libc.munmap(r.addr, r.length)


def test_a_writer_that_fails_fails_the_server_with_its_reason(tmp_path: Path) -> None:
    from gpusnap.criu.landed import LandedPages

    ledger = LandedPages(tmp_path / "landed.log")
    r = FakeRestore(tmp_path, 256, lazy=[(0, 256)], hole=(0, 0), landed=ledger.path)
    land(r, ledger, 0, 64 * PAGE)
    r.send_task()
    r.finish()
    ledger.fail("blob sha256:abc does not match its digest")
    r.thread.join(30)
    assert isinstance(r.error, lp.LazyPagesError)
    assert "could not be written: blob sha256:abc does not match its digest" in str(r.error)
    os.close(r.uffd)
    ledger.close()
    libc.munmap(r.addr, r.length)
