"""Two checkpoints of one container a few seconds apart: the second push sends ≤ 10% of the first.

The container: runc, rootfs an overlay with lower=/ (so the host's python3 runs inside), holding
1 GiB of deterministic pseudo-random bytes that never change plus a counter that does.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from gs_pkg_containers import RuncContainer, run
from stack.registry import Registry

from gpusnap.packaging import api
from gpusnap.packaging.store import OciStore

pytestmark = pytest.mark.integration

HOLDER = """
import os, random, time
rnd = random.Random(7)
data = [rnd.randbytes(64 << 20) for _ in range(16)]   # 1 GiB, never touched again
i = 0
while True:
    i += 1
    with open('/count.tmp', 'w') as f:
        f.write(str(i))
    os.replace('/count.tmp', '/count')
    time.sleep(0.2)
"""


@pytest.fixture
def big_container(tmp_path: Path) -> Iterator[RuncContainer]:
    if not shutil.which("python3"):
        pytest.skip("python3 missing")
    ovl = tmp_path / "ovl"
    ovl.mkdir()
    # upper/work on their own tmpfs: they must not lie inside the lower layer (/).
    run("mount", "-t", "tmpfs", "-o", "size=256m", "gs-pkg-ovl", str(ovl))
    for d in ("upper", "work", "merged"):
        (ovl / d).mkdir()
    run("mount", "-t", "overlay", "gs-pkg-ovl", "-o", f"lowerdir=/,upperdir={ovl}/upper,workdir={ovl}/work", str(ovl / "merged"))
    (ovl / "upper" / "holder.py").write_text(HOLDER)
    c = RuncContainer(tmp_path / "ctr", ovl / "merged", ["/usr/bin/python3", "/holder.py"], criu_conf="link-remap\n")
    try:
        c.start()
        yield c
    finally:
        c.destroy()
        subprocess.run(["umount", "-l", str(ovl / "merged")], check=False)
        subprocess.run(["umount", "-l", str(ovl)], check=False)


def test_second_push_sends_only_changed_memory(tmp_path: Path, registry: Registry, big_container: RuncContainer) -> None:
    c = big_container
    c.wait_count(2, timeout=120)  # the 1 GiB is allocated before the first count
    first, second = tmp_path / "ck1", tmp_path / "ck2"
    c.checkpoint(first, leave_running=True)
    n = c.count()
    c.wait_count(n + 10, timeout=60)  # a few seconds of changes
    c.checkpoint(second, leave_running=True)
    pages = sum(p.stat().st_size for p in second.glob("pages-*.img"))
    assert pages >= 1 << 30

    store = tmp_path / "store"
    s1 = api.store_checkpoint(store, first, form="criu-dir", ref="gs-pkg/big:1")
    s2 = api.store_checkpoint(store, second, form="criu-dir", ref="gs-pkg/big:2", parent="gs-pkg/big:1")
    assert s2.new_bytes <= 0.1 * s1.new_bytes  # the local store dedups the same way

    p1 = api.push(store, s1.ref, f"{registry.host}/gs-pkg/big:1", insecure=True)
    p2 = api.push(store, s2.ref, f"{registry.host}/gs-pkg/big:2", insecure=True)
    print(f"first push {p1.uploaded_bytes} B, second push {p2.uploaded_bytes} B "
          f"({100 * p2.uploaded_bytes / p1.uploaded_bytes:.2f}%), skipped {p2.skipped_bytes} B")
    assert p1.uploaded_bytes >= 1 << 30
    assert p2.uploaded_bytes <= 0.10 * p1.uploaded_bytes

    # Pulling the second checkpoint next to the first downloads only what changed, too.
    store2 = tmp_path / "store2"
    api.pull(store2, f"{registry.host}/gs-pkg/big:1", insecure=True)
    before = OciStore(store2).disk_usage()
    local = api.pull(store2, f"{registry.host}/gs-pkg/big:2", insecure=True)
    assert OciStore(store2).disk_usage() - before <= 0.10 * p1.uploaded_bytes
    out = api.materialize_checkpoint(store2, local, tmp_path / "out", form="criu-dir")
    for f in second.iterdir():
        if f.is_file():
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert api.inspect(store2, local).parent == s1.digest
