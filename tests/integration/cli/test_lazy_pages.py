"""``gpusnap restore --lazy-pages``: CRIU (through runc and gpusnap-runtime) lets the restored
processes go with their private memory missing, and gpusnap's page server
(gpusnap.criu.lazy_pages) fills it. Two processes (a fork) holding 96 MiB they change and hash
every step, and memory that existed at the checkpoint freed while the server may still be
filling it: the restored container must print, step for step, what the container it was
checkpointed from prints (left running), and the server must be gone once the restore returns."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Gs, delete_all, unique

pytestmark = pytest.mark.integration

PYTHON = "/usr/bin/python3"
WORKLOAD = r"""
import hashlib, os, random, time
N = 96 << 20
keep = bytearray(random.Random(1).randbytes(N))
spare = [bytearray(random.Random(2 + k).randbytes(8 << 20)) for k in range(4)]
role = "child" if os.fork() == 0 else "parent"
if role == "child":
    keep[:4096] = b"c" * 4096
step = 0
while True:
    i = (step * 7919 * 4096) % N
    keep[i:i + 4096] = hashlib.sha256(keep[i:i + 4096]).digest() * 128
    if spare and step % 2:
        spare.pop()  # munmap of memory the checkpoint holds: the server must not bring it back
    print(f"{role} {step} {hashlib.sha256(keep).hexdigest()[:16]} {sum(len(s) for s in spare)}", flush=True)
    step += 1
    time.sleep(0.2)
"""


def lines(text: str) -> dict[tuple[str, int], str]:
    out = {}
    for ln in text.splitlines():
        p = ln.split()
        if len(p) == 4 and p[0] in ("parent", "child") and p[1].isdigit():
            out[(p[0], int(p[1]))] = f"{p[2]} {p[3]}"
    return out


def wait_lines(gs: Gs, name: str, pred, timeout: float = 90) -> dict[tuple[str, int], str]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = lines(gs("logs", name).stdout)
        if pred(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.3)


def servers() -> list[str]:
    p = subprocess.run(["pgrep", "-af", "gpusnap.criu.lazy_pages"], capture_output=True, text=True)
    return [ln for ln in p.stdout.splitlines() if "pgrep" not in ln]


@pytest.fixture
def lazy_gs(gs: Gs) -> Iterator[Gs]:
    yield gs
    delete_all(gs)


@pytest.mark.parametrize("pages", ["--lazy-pages", "--eager-pages", "default"])
def test_restore_continues_bit_for_bit(lazy_gs: Gs, pages: str) -> None:
    gs = lazy_gs
    name = unique("lazy")
    gs("run", name, "--rootfs-overlay", "/", "--", PYTHON, "-c", WORKLOAD)
    wait_lines(gs, name, lambda g: {("parent", 2), ("child", 2)} <= set(g))
    ref = json.loads(gs("checkpoint", name, "--leave-running", "--json").stdout)["ref"]
    out = gs("restore", ref, "--name", name + "-r", "--json", *([pages] if pages != "default" else []))
    timings = json.loads(out.stdout)["timings_s"]
    lazy_steps = {"restore: start the lazy-pages server", "restore: fill the memory (lazy pages)", "restore: lazy pages: copy_gbps"}
    if pages == "--eager-pages":
        assert not lazy_steps & set(timings), timings
    else:  # the default is lazy where the kernel can, as here
        assert lazy_steps <= set(timings), timings
        # CRIU went on once the pages it copies itself were in, not all of them (gpusnap.criu.landed).
        assert "restore: beside the runtime: wait for the pages CRIU copies itself" in timings, timings
    assert servers() == [], "the page server ends before the restore returns"
    after = wait_lines(gs, name + "-r", lambda g: sum(1 for k in g if k[0] == "parent") >= 6 and sum(1 for k in g if k[0] == "child") >= 6)
    first = min(k[1] for k in after if k[0] == "parent")
    original = wait_lines(gs, name, lambda g: all(k in g for k in after))
    assert len(after) >= 12 and all(original.get(k) == v for k, v in after.items()), (sorted(after.items())[:6], first)
    if pages == "--eager-pages":
        return
    log = (gs.root / "run" / "engine" / "containers" / (name + "-r") / "lazy-pages.log").read_text()
    assert "restore finished" in log and "done:" in log, log[-2000:]
    assert "every page is in the pages files" in log, log[-2000:]  # it followed the materialize
    # Two processes, each with its own userfaultfd and lazy memory.
    assert log.count("bytes lazy in") == 2, log[-2000:]


def test_lazy_pages_through_another_engine_is_refused(gs: Gs) -> None:
    p = gs("restore", "nothing.example/none:v1", "--engine", "podman", "--lazy-pages", check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


BIG = r"""
import hashlib, random, time
keep = bytearray(b"".join(random.Random(5 + k).randbytes(64 << 20) for k in range(16)))  # 1 GiB
step = 0
while True:
    keep[step * 4096:(step + 1) * 4096] = hashlib.sha256(str(step).encode()).digest() * 128
    print(f"parent {step} {hashlib.sha256(keep[:1 << 20]).hexdigest()[:16]} 0", flush=True)
    step += 1
    time.sleep(0.2)
"""


def checkpointed_big(gs: Gs, kind: str) -> tuple[str, str, Path]:
    """A 1 GiB container checkpointed into the store and deleted: (its name, the reference, where
    the page server of its restore as NAME-r logs)."""
    name = unique(kind)
    gs("run", name, "--rootfs-overlay", "/", "--", PYTHON, "-c", BIG)
    assert ("parent", 1) in wait_lines(gs, name, lambda g: ("parent", 1) in g, timeout=120), gs("logs", name).stdout[-2000:]
    ref = json.loads(gs("checkpoint", name, "--json").stdout)["ref"]
    gs("delete", name)
    return name, ref, gs.root / "run" / "engine" / "containers" / (name + "-r") / "lazy-pages.log"


FORKER = r"""
import hashlib, os, random, time
keep = bytearray(b"".join(random.Random(9 + k).randbytes(64 << 20) for k in range(8)))  # 512 MiB
step = 0
while True:
    keep[step * 4096:(step + 1) * 4096] = hashlib.sha256(str(step).encode()).digest() * 128
    pid = os.fork()
    if pid == 0:  # reads a byte of every page: in a child forked mid-fill, through its own userfaultfd
        print(f"child {step} {hashlib.sha256(keep[::4096]).hexdigest()[:16]} 0", flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    print(f"parent {step} {hashlib.sha256(keep[::4096]).hexdigest()[:16]} 0", flush=True)
    step += 1
    time.sleep(0.05)
"""


def test_processes_forked_while_the_server_fills_see_the_whole_memory(lazy_gs: Gs) -> None:
    """A fork while pages are missing: the child's are missing too, and the server fills them
    through the userfaultfd the fork event hands it; every child's and parent's hash of the
    memory after the restore equals the original's at the same step."""
    gs = lazy_gs
    name = unique("lazyf")
    gs("run", name, "--rootfs-overlay", "/", "--", PYTHON, "-c", FORKER)
    assert ("child", 2) in wait_lines(gs, name, lambda g: ("child", 2) in g, timeout=120), gs("logs", name).stdout[-2000:]
    ref = json.loads(gs("checkpoint", name, "--leave-running", "--json").stdout)["ref"]
    gs("restore", ref, "--name", name + "-r", "--lazy-pages")
    after = wait_lines(gs, name + "-r", lambda g: sum(1 for k in g if k[0] == "child") >= 10)
    original = wait_lines(gs, name, lambda g: all(k in g for k in after))
    assert sum(1 for k in after if k[0] == "child") >= 10
    assert all(original.get(k) == v for k, v in after.items()), sorted(after.items())[:6]
    log = (gs.root / "run" / "engine" / "containers" / (name + "-r") / "lazy-pages.log").read_text()
    assert "done:" in log, log[-2000:]
    print(log.splitlines()[-1])  # whether a fork came while it filled (timing: not asserted)
