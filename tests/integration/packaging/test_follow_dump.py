"""The store that follows a dump, on dumps the real CRIU writes: it packs pages while CRIU is
still writing them, and the artifact is the one a store of the finished directory makes.

How much a follower packs before CRIU ends is a race on a fast disk (CRIU writes the 768 MiB
here in ~0.3 s and flushes its pagemap only three times), so the test holds CRIU still
(SIGSTOP) once its first pagemap flush is on disk, until the follower has packed what that
flush describes: "packed while CRIU was writing" is then a fact of the run, not of the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap.packaging import api
from gpusnap.packaging.follow import DumpFollower
from gpusnap.packaging.store import OciStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: stored_artifacts
from stored_artifacts import layers_and_config as _artifact  # noqa: E402

MIB = 1 << 20
SIZE_MIB = 768  # CRIU flushes a pagemap every ~270 entries of up to 1 MiB: this one flushes during the dump
HOLDER = r"""
import mmap, os, random, sys, time
d, size = sys.argv[1], int(sys.argv[2]) << 20
m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
rnd = random.Random(7)
for i in range(0, size, 8 << 20):
    m[i:i + (8 << 20)] = rnd.randbytes(8 << 20)
m[size // 3: size // 3 + (16 << 20)] = bytes(16 << 20)  # a zero run: zero pieces
open(f"{d}/ready", "w").close()
while True:
    time.sleep(1)
"""
CRIUS = [c for c in (shutil.which("criu"), "/opt/gpusnap-criu42/bin/criu") if c and os.path.exists(c)]


def _hold_criu_after_first_flush(dump: subprocess.Popen, images: Path, follower: DumpFollower,
                                  want: int, timeout: float = 60) -> bool:
    """SIGSTOP CRIU once a pagemap has entries on disk, SIGCONT once ``follower`` has packed
    ``want`` bytes (or ``timeout`` passed). Returns whether CRIU was held mid-dump."""
    while dump.poll() is None:
        if any(p.stat().st_size > 0 for p in images.glob("pagemap-*.img")):
            break
        time.sleep(0.001)
    else:
        return False
    os.kill(dump.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout
        while follower.bytes_while_dumping < want and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        os.kill(dump.pid, signal.SIGCONT)
    return True


def _wait(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.skipif(os.geteuid() != 0, reason="criu dump needs root")
@pytest.mark.skipif(not CRIUS, reason="criu not installed (run tests/host/provision.sh)")
@pytest.mark.parametrize("criu", CRIUS)
def test_store_follows_a_real_criu_dump(tmp_path: Path, criu: str) -> None:
    (tmp_path / "holder.py").write_text(HOLDER)
    with open(tmp_path / "out", "wb") as out:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "holder.py"), str(tmp_path), str(SIZE_MIB)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    images = tmp_path / "images"
    follower = None
    try:
        _wait(tmp_path / "ready")
        follower = DumpFollower(OciStore(tmp_path / "followed"), images, compress=False, poll_s=0.005).start()
        images.mkdir()
        dump = subprocess.Popen([criu, "dump", "-t", str(proc.pid), "-D", str(images), "--leave-running",
                                 "-o", "dump.log"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        held = _hold_criu_after_first_flush(dump, images, follower, want=128 * MIB)
        _, err = dump.communicate(timeout=300)
        log = (images / "dump.log").read_text() if (images / "dump.log").exists() else ""
        assert dump.returncode == 0, f"criu dump failed: {err}\n{log[-3000:]}"
        assert held, "CRIU ended before its first pagemap flush reached the disk"
        (images / "dump.log").unlink()
        while_dumping = follower.bytes_while_dumping
        stored = api.store_checkpoint(tmp_path / "followed", images, form="criu-dir", ref="local/f:1", follower=follower)
        follower = None
    finally:
        if follower is not None:
            follower.close()
        proc.kill()
        proc.wait()
    pages = sum(p.stat().st_size for p in images.glob("pages-*.img"))
    assert pages > SIZE_MIB * MIB * 0.9
    # CRIU's pagemap reached the disk during the dump, and the follower packed from it
    assert while_dumping >= 128 * MIB, f"only {while_dumping} of {pages} bytes packed while CRIU wrote"
    finished = api.store_checkpoint(tmp_path / "finished", images, form="criu-dir", ref="local/f:1")
    assert _artifact(tmp_path / "followed", stored.digest) == _artifact(tmp_path / "finished", finished.digest)
    out = tmp_path / "out-images"
    api.materialize_checkpoint(tmp_path / "followed", "local/f:1", out, form="criu-dir")
    for f in images.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
