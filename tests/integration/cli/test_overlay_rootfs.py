"""runc-direct with ``--rootfs-overlay /``: the host's own Python, unmodified, in a container
whose root is an overlay of the host's root, through checkpoint, delete and restore.

This is the path `gpusnap demo --gpu` takes with a CUDA workload, here with a pure-Python one
so it runs on CPU hosts: the restored process must continue its deterministic sequence.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Gs, delete_all, wait_parsed

pytestmark = pytest.mark.integration

PYTHON = "/usr/bin/python3"
# A 64-bit LCG: step i's value depends on every step before it, so a restart or a lost step shows.
WORKLOAD = r"""
import time
v = 12345
for i in range(1, 100000):
    v = (v * 6364136223846793005 + 1442695040888963407) % (1 << 64)
    print(f"step {i} {v}", flush=True)
    time.sleep(0.1)
"""


def unique(kind: str) -> str:
    return f"gs-demo-{kind}-{uuid.uuid4().hex[:6]}"


def expected(upto: int) -> dict[int, int]:
    v, out = 12345, {}
    for i in range(1, upto + 1):
        v = (v * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out[i] = v
    return out


def steps(text: str) -> dict[int, int]:
    out = {}
    for line in text.splitlines():
        p = line.split()
        if len(p) == 3 and p[0] == "step":
            out[int(p[1])] = int(p[2])
    return out


def mounts_under(root: Path) -> list[str]:
    lines = Path("/proc/self/mounts").read_text().splitlines()
    return [ln.split()[1] for ln in lines if ln.split()[1].startswith(str(root))]


@pytest.fixture
def overlay_gs(gs: Gs) -> Iterator[Gs]:
    yield gs
    delete_all(gs)
    for m in sorted(mounts_under(gs.root), reverse=True):  # only if a delete above failed
        subprocess.run(["umount", "-l", m], check=False)


def wait_steps(gs: Gs, name: str, at_least: int, timeout: float = 60) -> dict[int, int]:
    return wait_parsed(lambda: gs("logs", name).stdout, steps, at_least, timeout, 0.3)  # type: ignore[no-any-return]


def test_overlay_rootfs_python_checkpoint_restore_continues(overlay_gs: Gs, tmp_path: Path) -> None:
    gs = overlay_gs
    name = unique("ovl")
    info = json.loads(gs("run", name, "--json", "--rootfs-overlay", "/", "--", PYTHON, "-c", WORKLOAD).stdout)
    assert info["image"] == "overlay:/"  # type: ignore[index]
    assert any(m.endswith(f"{name}/overlay-root") for m in mounts_under(gs.root))
    before = wait_steps(gs, name, 3)
    assert len(before) >= 3 and before == {k: v for k, v in expected(max(before)).items() if k in before}
    out = tmp_path / "cp"
    gs("checkpoint", name, "--output", str(out))
    # The writable layer travels with the checkpoint (CRIU's link-remap files are in it).
    image_dir = next(p.parent for p in out.rglob("runc-direct.json"))
    assert (image_dir / "rootfs-upper.tar").is_file()
    stopped = max(steps(gs("logs", name).stdout))
    gs("delete", name)
    assert not any(name + "/" in m for m in mounts_under(gs.root))
    restored = name + "-r"
    gs("restore", str(out), "--name", restored)
    after = wait_steps(gs, restored, 3)
    assert min(after) == stopped + 1, (stopped, sorted(after)[:3])
    ref = expected(max(after))
    assert {k: ref[k] for k in after} == after
    gs("delete", restored)
    assert mounts_under(gs.root) == []


def test_overlay_rootfs_through_the_local_store(overlay_gs: Gs) -> None:
    """The demo's path: checkpoint into the store, delete, restore from the reference."""
    gs = overlay_gs
    name = unique("ovs")
    gs("run", name, "--rootfs-overlay", "/", "--", PYTHON, "-c", WORKLOAD)
    wait_steps(gs, name, 2)
    ref = json.loads(gs("checkpoint", name, "--json").stdout)["ref"]
    stopped = max(steps(gs("logs", name).stdout))
    gs("delete", name)
    gs("restore", ref, "--name", name + "-r")
    after = wait_steps(gs, name + "-r", 2)
    assert min(after) == stopped + 1
    ref_values = expected(max(after))
    assert {k: ref_values[k] for k in after} == after
    gs("delete", name + "-r")
    gs("rm", ref)
    assert mounts_under(gs.root) == []


def test_rootfs_and_overlay_exclude_each_other(overlay_gs: Gs, tmp_path: Path) -> None:
    proc = overlay_gs("run", unique("ovl"), "--rootfs", str(tmp_path), "--rootfs-overlay", "/", "--", "true", check=False)
    assert proc.returncode == 2 and "exclude each other" in proc.stderr
    proc = overlay_gs("run", unique("ovl"), "--rootfs-overlay", str(tmp_path / "nope"), "--", "true", check=False)
    assert proc.returncode == 3 and "is not a directory" in proc.stderr
    assert mounts_under(overlay_gs.root) == []
