"""``gpusnap doctor`` on the work dirs killed runs leave (gpusnap.admin.doctor.check_work_dirs):
what it reports for each kind, and that looking changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpusnap.admin.doctor import OK, WARN, check_work_dirs
from gpusnap.config import Settings
from gpusnap.engines.workdirs import DUMPED, STARTED, STORED, WorkRecord


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(proc.stdout)


def _work(base: Path, pid: int, stage: str, name: str) -> Path:
    work = base / f"work-{pid}-{name}"
    image = work / "checkpoint"
    image.mkdir(parents=True)
    (image / "inventory.img").write_bytes(b"inv")
    (image / "pages-1.img").write_bytes(os.urandom(4096))
    WorkRecord(pid=pid, op="checkpoint", stage=stage, container=f"c-{name}", engine="runc-direct", form="criu-dir",
               checkpoint=str(image), ref=f"localhost/gpusnap/{name}:1").write(work)
    return work


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_work_dirs_reported_and_left_alone(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path / "state", run_dir=tmp_path / "run")
    assert [(c.status, c.detail) for c in check_work_dirs(settings)] == [(OK, "none")]
    base = settings.state_dir / "tmp"
    _work(base, os.getpid(), DUMPED, "live")  # this process "owns" it: in use
    dead = _dead_pid()
    _work(base, dead, STORED, "spare")
    checks = check_work_dirs(settings)
    assert [c.status for c in checks] == [OK] and "1 in use" in checks[0].detail and "1 left by killed runs" in checks[0].detail
    _work(base, dead, DUMPED, "stopped")  # the only copy of a stopped container: stored by the next run
    _work(base, dead, STARTED, "unsure")  # the dump may have finished after gpusnap died
    before = _tree(base)
    checks = check_work_dirs(settings)
    assert _tree(base) == before  # doctor only looks
    by_name = {c.detail.split(" left ")[0].rsplit(" ", 1)[-1]: c for c in checks}
    assert set(by_name) == {"c-stopped", "c-unsure"} and all(c.status == WARN for c in checks)
    assert "localhost/gpusnap/stopped:1" in by_name["c-stopped"].fix and "checkpoint or restore" in by_name["c-stopped"].fix
    assert "gpusnap import" in by_name["c-unsure"].fix and "dump may have finished" in by_name["c-unsure"].detail
