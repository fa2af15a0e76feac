"""Process state that CRIU and gpusnap's pagemap cutting meet less often, through
``checkpoint --push``, delete, and ``restore REMOTE`` with an empty store: sparse and
transparent-huge-page mappings, thousands of small mappings, pages that hold only zeros, a
memfd, a deleted file still open, a file in the container's /dev/shm, many threads.

The workload checks its own state at every tick (each mapping's pattern, the files' digests,
every thread alive and counting) and prints ``tick N ok``; the restored process must go on from
the tick after the last one printed before the checkpoint, its state intact.
"""

from __future__ import annotations

import json
import uuid

import pytest

from .conftest import Gs, delete_all, wait_parsed

pytestmark = pytest.mark.integration

PYTHON = "/usr/bin/python3"
WORKLOAD = r"""
import hashlib, mmap, os, sys, threading, time
mode = sys.argv[1]
MIB = 1 << 20
checks = []

def pattern(mm, seed, step):
    for off in range(0, len(mm), step):
        mm[off:off + 8] = ((seed * 1000003 + off) % (1 << 64)).to_bytes(8, "little")
    checks.append(lambda: all(mm[off:off + 8] == ((seed * 1000003 + off) % (1 << 64)).to_bytes(8, "little")
                              for off in range(0, len(mm), step)))

if mode == "mappings":
    # sparse: 1 GiB reserved, one page in 256 touched
    pattern(mmap.mmap(-1, 1 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), 7, MIB)
    # 3000 small mappings that cannot merge (each its own content)
    for i in range(3000):
        pattern(mmap.mmap(-1, 8192, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), i, 1024)
    # transparent huge pages, every 4 KiB page written
    thp = mmap.mmap(-1, 128 * MIB)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        thp.madvise(mmap.MADV_HUGEPAGE)
    pattern(thp, 5, 4096)
    # pages written with zeros (real pages, not the zero page), a marker every 16 MiB
    zeros = mmap.mmap(-1, 256 * MIB)
    for off in range(0, len(zeros), MIB):
        zeros[off:off + MIB] = bytes(MIB)
    for off in range(0, len(zeros), 16 * MIB):
        zeros[off:off + 8] = b"MARKER!!"
    checks.append(lambda: all(zeros[off:off + 8] == b"MARKER!!" for off in range(0, len(zeros), 16 * MIB))
                  and zeros[8:MIB] == bytes(MIB - 8))
elif mode == "files":
    fd = os.memfd_create("gs-memfd")
    os.ftruncate(fd, 16 * MIB)
    pattern(mmap.mmap(fd, 16 * MIB), 11, 4096)
    gone = open("/tmp/gs-deleted-" + str(os.getpid()), "w+b")
    body = os.urandom(MIB)
    gone.write(body); gone.flush()
    os.unlink(gone.name)
    want = hashlib.sha256(body).digest()
    def deleted_ok():
        gone.seek(0)
        return hashlib.sha256(gone.read()).digest() == want
    checks.append(deleted_ok)
    shm = open("/dev/shm/gs-shm", "w+b")
    shm.truncate(8 * MIB)
    pattern(mmap.mmap(shm.fileno(), 8 * MIB), 13, 4096)
    # a private copy-on-write mapping of a file, changed after mapping: CRIU keeps the changed pages
    with open("/tmp/gs-cow", "wb") as f:
        f.write(b"\x01" * (4 * MIB))
    cow = open("/tmp/gs-cow", "rb")
    pattern(mmap.mmap(cow.fileno(), 4 * MIB, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE), 17, 8192)
elif mode == "threads":
    counters = [0] * 32
    def count(i):
        while True:
            counters[i] += 1
            time.sleep(0.005)
    for i in range(32):
        threading.Thread(target=count, args=(i,), daemon=True).start()
    seen = [0] * 32
    def all_counting():
        now = list(counters)
        ok = all(b > a for a, b in zip(seen, now))
        seen[:] = now
        return ok
    time.sleep(0.1)
    checks.append(all_counting)
    pattern(mmap.mmap(-1, 64 * MIB), 3, 4096)
n = 0
while True:
    ok = all(c() for c in checks)
    print(f"tick {n} {'ok' if ok else 'BROKEN'}", flush=True)
    n += 1
    time.sleep(0.3)
"""


def ticks(text: str) -> dict[int, str]:
    out = {}
    for line in text.splitlines():
        p = line.split()
        if len(p) == 3 and p[0] == "tick":
            out[int(p[1])] = p[2]
    return out


def wait_ticks(gs: Gs, name: str, at_least: int, timeout: float = 90) -> dict[int, str]:
    return wait_parsed(lambda: gs("logs", name).stdout, ticks, at_least, timeout, 0.3)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["mappings", "files", "threads"])
def test_unusual_state_through_a_registry(gs: Gs, registry: str, mode: str) -> None:
    name = f"gs-odd-{mode}-{uuid.uuid4().hex[:6]}"
    remote = f"{registry}/odd/{mode}:1"
    try:
        gs("run", name, "--rootfs-overlay", "/", "--", PYTHON, "-c", WORKLOAD, mode)
        before = wait_ticks(gs, name, 2)
        assert len(before) >= 2 and set(before.values()) == {"ok"}, before
        out = json.loads(gs("checkpoint", name, "--push", remote, "--insecure", "--json").stdout)
        stopped = max(ticks(gs("logs", name).stdout))
        gs("delete", name)
        gs("rm", out["ref"])  # nothing in the store: the restore takes every byte from the registry
        gs("gc")
        gs("restore", remote, "--name", name, "--insecure")
        after = wait_ticks(gs, name, 3)
        assert min(after) == stopped + 1, (stopped, sorted(after)[:3])
        assert set(after.values()) == {"ok"}, after
    finally:
        delete_all(gs)
