"""ckdiff on two checkpoints CRIU dumped of one process: memory kept, rewritten and moved
between them is reported as such."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap.packaging import ckdiff

MIB = 1 << 20
# Page-aligned buffers (mmap), as a GPU driver's are: a copy shifted by less than a page would
# have no page in common with the original (ckdiff's docstring).
HOLDER = r"""
import hashlib, mmap, os, random, sys, time
d = sys.argv[1]

def filled(seed, size):
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m[:] = random.Random(seed).randbytes(size)
    return m

keep = filled(1, 16 << 20)     # the same in both checkpoints
rewrite = filled(2, 4 << 20)   # rewritten in place
mover = filled(3, 8 << 20)     # copied to a new mapping, the old one unmapped
open(f"{d}/ready1", "w").close()
while not os.path.exists(f"{d}/go"):
    time.sleep(0.01)
# In 4 KiB / 64 KiB steps: a whole-buffer temporary would itself be new memory in the dump.
for i in range(0, 4 << 20, 4096):
    rewrite[i:i + 4096] = hashlib.sha256(i.to_bytes(8, "little")).digest() * 128
moved = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, 8 << 20, 65536):
    moved[i:i + 65536] = mover[i:i + 65536]
mover.close()
open(f"{d}/ready2", "w").close()
while True:
    time.sleep(1)
"""


def _wait(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


# The CRIU on PATH, and 4.2 where tests/host/provision.sh put it beside 4.1 (4.2 writes a
# pagemap's page counts in another field).
CRIUS = [c for c in (shutil.which("criu"), "/opt/gpusnap-criu42/bin/criu") if c and os.path.exists(c)]


def _dump(criu: str, pid: int, images: Path) -> None:
    images.mkdir()
    proc = subprocess.run([criu, "dump", "-t", str(pid), "-D", str(images), "--leave-running", "-o", "dump.log"],
                          capture_output=True, text=True, timeout=120)
    log = (images / "dump.log").read_text() if (images / "dump.log").exists() else ""
    assert proc.returncode == 0, f"criu dump failed: {proc.stderr}\n{log[-3000:]}"
    (images / "dump.log").unlink()


@pytest.mark.skipif(not CRIUS, reason="criu not installed (run tests/host/provision.sh)")
@pytest.mark.parametrize("criu", CRIUS)
def test_kept_rewritten_and_moved_memory(tmp_path: Path, criu: str) -> None:
    (tmp_path / "holder.py").write_text(HOLDER)
    with open(tmp_path / "out", "wb") as out:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "holder.py"), str(tmp_path)], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, start_new_session=True)
    try:
        _wait(tmp_path / "ready1")
        _dump(criu, proc.pid, tmp_path / "a")
        (tmp_path / "go").touch()
        _wait(tmp_path / "ready2")
        _dump(criu, proc.pid, tmp_path / "b")
    finally:
        proc.kill()
        proc.wait()
    r = ckdiff.diff(tmp_path / "a", tmp_path / "b")
    pages = r.pages
    assert pages.same * ckdiff.PAGE >= 16 * MIB  # kept
    assert (pages.changed + pages.new) * ckdiff.PAGE >= 4 * MIB  # rewritten
    assert pages.moved * ckdiff.PAGE >= 8 * MIB  # moved
    # The moved buffer is one shift; the page-level dedup sends the rewrite and little else,
    # where 16 MiB pieces of the pages file cut without its structure send much more.
    assert r.shifts and r.shifts[0][1] * ckdiff.PAGE >= 8 * MIB
    assert 4 * MIB <= r.send["ideal_page_dedup_bytes"] < 6 * MIB
    assert r.send["fixed_16384k_pieces_bytes"] > 12 * MIB
    moved_maps = [m for m in r.per_mapping if m["moved"] * ckdiff.PAGE >= 8 * MIB]
    assert moved_maps and "anon" in moved_maps[0]["vma"]
    differing = {f.name for f in r.files if f.status == "differs"}
    assert f"core-{proc.pid}.img" in differing and any(n.startswith("pages-") for n in differing)
    out_json = tmp_path / "diff.json"
    assert ckdiff.main([str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["pages"]["moved"] == pages.moved
