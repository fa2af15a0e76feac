"""A restore writes its CRIU image directory on a tmpfs under the run dir when the image fits in
free memory (engines/imagedir.py) — a huge-page tmpfs of its own, mounted there — unmounts and
removes it afterwards, and the container counts on; the checkpoint's and the restore's --json
timings name their stages."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import COUNTER, Gs, unique, wait_numbers

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("source", ["store", "registry"])
def test_restore_images_in_memory_then_gone(gs: Gs, registry: str, source: str) -> None:
    mem = gs.root / "run" / "tmp"
    mem.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m,mode=0700", "tmpfs", str(mem)], check=True)
    name = unique("img")
    try:
        gs("run", name, "--", "sh", "-c", COUNTER)
        wait_numbers(lambda: gs("logs", name).stdout, 3)
        ref = f"{registry}/{name}:v1"
        ck = json.loads(gs("checkpoint", name, "--push", ref, "--insecure", "--json").stdout)["timings_s"]
        # The store's phases and the runtime's own steps are named inside their steps.
        assert {"store the checkpoint: pack the rest", "store the checkpoint: publish (durable, then visible)",
                "checkpoint: runtime: runc checkpoint", "checkpoint: runtime: before: start-up and imports",
                "checkpoint: engine: gpusnap-runtime checkpoint", "checkpoint: engine: after the dump",
                "push the checkpoint: the uploads still going", "push the checkpoint: the last blobs and the manifest"} <= set(ck), ck
        last = wait_numbers(lambda: gs("logs", name).stdout, 1)[-1]
        gs("delete", name)
        if source == "registry":
            gs("rm", ref)  # nothing in the store: straight from the registry into the image dir
        out = gs("-v", "restore", ref, "--insecure", "--name", name + "-r", "--json")
        timings = json.loads(out.stdout)["timings_s"]
        assert "image directory in memory" in out.stderr, out.stderr
        assert "a huge-page tmpfs of its own" in out.stderr, out.stderr  # imagedir.mount_tmpfs
        stage = "materialize" if source == "store" else "pull into the image directory"
        # The pages files are written on a thread of their own while the engine prepares the
        # container (orchestrate.restore): its lap is the first stage, its whole time is beside
        # the laps. Through gpusnap-runtime the engine mounts the root filesystem and waits for
        # the rest beside the runtime's start, and the runtime waits for both before runc; the
        # runtime's own account of its steps comes back as "restore: runtime: ...".
        # A lazy restore (the default where the kernel can) waits only for the pages CRIU
        # copies itself; the page server follows the rest (gpusnap.criu.landed).
        waits = {"restore: beside the runtime: wait for the checkpoint images", "restore: beside the runtime: wait for the pages CRIU copies itself"}
        assert waits & set(timings), timings
        assert {f"{stage} (all but the pages files)", f"background: {stage}", "restore", "check the host",
                "restore: restore the container", "restore: runtime: wait for the root filesystem and images",
                "restore: runtime: runc restore", "restore: runtime: start-up and imports", "restore: runtime: total"} <= set(timings), timings
        assert list(mem.iterdir()) == [], "the in-memory image directory is removed after the restore"
        assert str(mem) + "/" not in Path("/proc/self/mountinfo").read_text(), "its tmpfs is unmounted"
        after = wait_numbers(lambda: gs("logs", name + "-r").stdout, 2)
        assert after[0] >= last, (last, after)
    finally:
        for n in (name, name + "-r"):
            gs("delete", n, check=False)
        subprocess.run(["umount", "-l", str(mem)], capture_output=True)


def test_a_killed_restores_image_tmpfs_is_unmounted_by_the_next_sweep(tmp_path: Path) -> None:
    """kill -9 while the image directory is on its own tmpfs (it holds the checkpoint's memory):
    the next run's sweep of the work dirs unmounts it and removes the dir."""
    import sys

    from gpusnap.engines import workdirs

    base = tmp_path / "tmp"
    code = ("import sys, time; from pathlib import Path; from gpusnap.engines import imagedir, workdirs\n"
            "with workdirs.claim(Path(sys.argv[1])) as work:\n"
            "    where = imagedir.mount_tmpfs(work, 64 << 20)\n"
            "    (where / 'pages-1.img').write_bytes(b'x' * (8 << 20))\n"
            "    print(where, flush=True)\n"
            "    time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(base)], stdout=subprocess.PIPE, text=True)
    try:
        where = Path(child.stdout.readline().strip())  # type: ignore[union-attr]
        assert where.name == "images" and f" {where} " in Path("/proc/self/mountinfo").read_text()
    finally:
        child.kill()
        child.wait()
    swept = workdirs.sweep(base, recover=None, container_running=lambda record: None)
    assert [s.verdict.action for s in swept] == ["remove"]
    assert f" {where} " not in Path("/proc/self/mountinfo").read_text()
    assert list(base.iterdir()) == []
