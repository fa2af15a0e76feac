"""What the next gpusnap run does with a dead run's work dir (gpusnap.engines.workdirs and
orchestrate.recover_interrupted): the recovery decision on fake work dirs, liveness through the
owner's flock with real processes (alive, killed with SIGKILL, mid-sweep), and the recovery
into a real local store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap.config import Settings
from gpusnap.engines import orchestrate, workdirs
from gpusnap.engines.workdirs import DESCRIBED, DUMPED, STARTED, STORED, WorkRecord, decide, sweep
from gpusnap.metadata import CheckpointMetadata


def _never(_: WorkRecord) -> bool | None:
    raise AssertionError("container_running asked where the record settles it")


def _work(base: Path, pid: int, *, stage: str, leave_running: bool = False, inventory: bool = True, op: str = "checkpoint",
          ref: str = "localhost/gpusnap/web:one", push: str = "") -> tuple[Path, WorkRecord]:
    work = base / f"work-{pid}-abc{stage}{int(leave_running)}{int(inventory)}{op}"
    image = work / "checkpoint"
    image.mkdir(parents=True)
    (image / "pages-1.img").write_bytes(b"\x01" * 8192 + os.urandom(64))
    if inventory:
        (image / "inventory.img").write_bytes(b"inv")
    if stage in (DESCRIBED, STORED):
        CheckpointMetadata(container_id="c1", created="2026-11-24T20:00:00Z", runtime="runc", leave_running=leave_running).write(image)
    record = WorkRecord(pid=pid, op=op, stage=stage, container="web", engine="runc-direct", form="criu-dir", checkpoint=str(image),
                        ref=ref, push=push, leave_running=leave_running)
    record.write(work)
    return work, record


@pytest.mark.parametrize(("stage", "leave_running", "inventory", "action"), [
    (DUMPED, False, True, "recover"),
    (DESCRIBED, False, True, "recover"),
    (DESCRIBED, True, True, "remove"),  # the container still runs: nothing lost
    (STORED, False, True, "remove"),  # tagged: the work dir is a spare copy
    (STARTED, False, False, "remove"),  # CRIU never finished
])
def test_decide_from_the_record(tmp_path: Path, stage: str, leave_running: bool, inventory: bool, action: str) -> None:
    work, record = _work(tmp_path, 1, stage=stage, leave_running=leave_running, inventory=inventory)
    assert decide(record, work, container_running=_never).action == action


def test_decide_without_a_checkpoint_record(tmp_path: Path) -> None:
    work, record = _work(tmp_path, 1, stage=DESCRIBED, op="restore")
    assert decide(record, work, container_running=_never).action == "remove"
    assert decide(None, work, container_running=_never).action == "remove"
    work2, record2 = _work(tmp_path, 2, stage=DESCRIBED)
    record2.checkpoint = str(tmp_path / "elsewhere")  # moved out (--output) or outside the dir
    assert decide(record2, work2, container_running=_never).action == "remove"


@pytest.mark.parametrize(("running", "action"), [(True, "remove"), (False, "keep"), (None, "keep")])
def test_decide_a_dump_that_may_have_finished_after_gpusnap_died(tmp_path: Path, running: bool | None, action: str) -> None:
    """Killed during the dump with CRIU's inventory written: only a running container proves
    the dump failed (the flow guarantees that); otherwise the images may be all that is left."""
    work, record = _work(tmp_path, 1, stage=STARTED, inventory=True)
    verdict = decide(record, work, container_running=lambda r: running)
    assert verdict.action == action, verdict


OWNER = """
import sys, time
from pathlib import Path
from gpusnap.engines import workdirs
with workdirs.claim(Path(sys.argv[1])) as work:
    rec = workdirs.WorkRecord(pid=__import__("os").getpid(), op="checkpoint", stage=sys.argv[2], container="web",
                              engine="runc-direct", form="criu-dir", checkpoint=str(work / "checkpoint"), ref="localhost/gpusnap/web:k")
    (work / "checkpoint").mkdir()
    (work / "checkpoint" / "pages-1.img").write_bytes(b"p" * 4096)
    (work / "checkpoint" / "inventory.img").write_bytes(b"i")
    rec.write(work)
    print(work, flush=True)
    time.sleep(600)
"""


def _owner(base: Path, stage: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(base), stage], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_decide_a_dump_that_finished_after_gpusnap_died(tmp_path: Path) -> None:
    """CRIU's stats-dump proves the dump succeeded: runc-direct's checkpoint is recovered (its
    engine finishes it) without asking whether the container runs; other engines' are judged
    as before."""
    work, record = _work(tmp_path, 1, stage=STARTED, inventory=True)
    (Path(record.checkpoint) / workdirs.DUMP_DONE).write_bytes(b"stats")
    assert decide(record, work, container_running=_never).action == "recover"
    record.engine = "podman"
    assert decide(record, work, container_running=lambda r: False).action == "keep"
    record.engine = "runc-direct"
    record.leave_running = True  # the container went on running: nothing to recover
    assert decide(record, work, container_running=_never).action == "remove"


def test_sweep_spares_a_live_run_and_recovers_a_killed_one(tmp_path: Path) -> None:
    base = tmp_path / "tmp"
    live, live_work = _owner(base, DESCRIBED)
    dead, dead_work = _owner(base, DESCRIBED)
    removed, removed_work = _owner(base, STARTED)
    try:
        for p in (dead, removed):
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
        stored: list[Path] = []
        done = sweep(base, recover=lambda work, rec: stored.append(work) or "localhost/gpusnap/web:k",
                     container_running=lambda rec: True)
        assert stored == [dead_work]
        assert {s.work: s.verdict.action for s in done} == {dead_work: "recover", removed_work: "remove"}
        assert live_work.is_dir() and not dead_work.exists() and not removed_work.exists()
    finally:
        live.kill()
        live.wait(10)
    # Dead now: the next sweep takes it.
    assert [s.verdict.action for s in sweep(base, recover=lambda w, r: "x", container_running=lambda r: True)] == ["recover"]
    assert not live_work.exists()


def test_sweep_skips_a_dir_another_sweeper_holds_and_one_a_child_still_writes(tmp_path: Path) -> None:
    base = tmp_path / "tmp"
    owner, work = _owner(base, DESCRIBED)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(10)
    # Another gpusnap sweeping it right now holds the owner lock.
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl,os,sys,time; fd=os.open(sys.argv[1], os.O_RDWR); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print(1, flush=True); time.sleep(600)", str(work / workdirs.LOCK)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "1"
    try:
        assert sweep(base, recover=lambda w, r: pytest.fail("recovered a dir another run holds"), container_running=_never) == []
    finally:
        holder.kill()
        holder.wait(10)
    # The dead owner's runc (a kill -9 spares children) may still be writing there.
    writer = subprocess.Popen(["sleep", "600"], cwd=work / "checkpoint")
    try:
        time.sleep(0.2)
        assert sweep(base, recover=lambda w, r: pytest.fail("recovered a dir a process still writes"), container_running=_never) == []
    finally:
        writer.kill()
        writer.wait(10)
    assert [s.verdict.action for s in sweep(base, recover=lambda w, r: "x", container_running=_never)] == ["recover"]


def test_a_failed_recovery_keeps_the_dir_for_the_next_run(tmp_path: Path) -> None:
    base = tmp_path / "tmp"
    owner, work = _owner(base, DUMPED)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(10)

    def full(w: Path, r: WorkRecord) -> str:
        raise OSError(28, "No space left on device")

    done = sweep(base, recover=full, container_running=_never)
    assert [(s.verdict.action, "No space" in s.verdict.reason) for s in done] == [("keep", True)]
    assert (work / "checkpoint" / "pages-1.img").is_file()
    assert [s.verdict.action for s in sweep(base, recover=lambda w, r: "x", container_running=_never)] == ["recover"]
    assert not work.exists()


def test_legacy_dirs_are_judged_by_their_pid(tmp_path: Path) -> None:
    """A dir without the owner lock: a run before this scheme, or one that is starting."""
    base = tmp_path / "tmp"
    gone = subprocess.Popen(["true"])
    gone.wait(10)
    old = base / f"work-{gone.pid}-x"
    starting = base / f"work-{os.getppid()}-y"
    for d in (old, starting):
        d.mkdir(parents=True)
    done = sweep(base, recover=None, container_running=_never)
    assert [s.work for s in done] == [old] and not old.exists() and starting.is_dir()


def _settings(tmp_path: Path) -> Settings:
    return Settings(run_dir=tmp_path / "run", state_dir=tmp_path / "state", store_dir=tmp_path / "store")


def test_recover_interrupted_stores_it_under_the_runs_reference(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    work, record = _work(settings.state_dir / "tmp", 999_999_999, stage=DESCRIBED, push="reg.example:5000/a/web:one")
    pages = (Path(record.checkpoint) / "pages-1.img").read_bytes()
    lines: list[str] = []
    done = orchestrate.recover_interrupted(settings, lines.append)
    assert [s.note for s in done] == ["localhost/gpusnap/web:one"]
    assert not work.exists()
    from gpusnap.packaging import api

    assert [r["ref"] for r in api.list_checkpoints(settings.store_dir)] == ["localhost/gpusnap/web:one"]
    assert len(lines) == 1 and "gpusnap restore localhost/gpusnap/web:one" in lines[0], lines
    assert "gpusnap push localhost/gpusnap/web:one reg.example:5000/a/web:one" in lines[0]
    dest = tmp_path / "back"
    api.materialize_checkpoint(settings.store_dir, "localhost/gpusnap/web:one", dest, form="criu-dir")
    assert (dest / "pages-1.img").read_bytes() == pages
    assert (dest / "inventory.img").read_bytes() == b"inv"


def test_recover_interrupted_when_the_tag_landed_or_is_taken(tmp_path: Path) -> None:
    from gpusnap.packaging import api

    settings = _settings(tmp_path)
    # Killed after the tag landed, before the record said so: the same checkpoint is there.
    work, record = _work(settings.state_dir / "tmp", 999_999_999, stage=DESCRIBED)
    meta = CheckpointMetadata.read(Path(record.checkpoint))
    api.store_checkpoint(settings.store_dir, Path(record.checkpoint), form="criu-dir", ref=record.ref, metadata=meta)
    lines: list[str] = []
    assert [s.note for s in orchestrate.recover_interrupted(settings, lines.append)] == [record.ref]
    assert [r["ref"] for r in api.list_checkpoints(settings.store_dir)] == [record.ref]
    # The reference now names another checkpoint: the recovered one goes beside it.
    work, record = _work(settings.state_dir / "tmp", 999_999_998, stage=DESCRIBED)
    (Path(record.checkpoint) / "pages-1.img").write_bytes(b"other")
    [swept] = orchestrate.recover_interrupted(settings, lines.append)
    assert swept.note.startswith("localhost/gpusnap/web:one-recovered-"), swept.note
    assert sorted(r["ref"] for r in api.list_checkpoints(settings.store_dir)) == sorted([record.ref, swept.note])
    assert f"gpusnap restore {swept.note}" in lines[-1]


def test_the_notice_for_a_kept_dir_says_how_to_import_it(tmp_path: Path) -> None:
    work, record = _work(tmp_path, 7, stage=STARTED)
    line = orchestrate._recovery_notice(workdirs.Swept(work, record, workdirs.Verdict("keep", "web is gone")))
    assert f"gpusnap import {record.checkpoint} REF" in line and "\n" not in line
    assert json.loads((work / workdirs.RECORD).read_text())["stage"] == STARTED


def test_a_failed_rollback_keeps_the_only_copy(tmp_path: Path) -> None:
    """The checkpoint stopped the container and bringing it back failed (exit 11): the work dir
    stays for the next run to store; a rollback that worked, or a --leave-running one, does not."""
    from gpusnap.errors import ExitCode
    from gpusnap.steps import StepFailed

    work, record = _work(tmp_path, os.getpid(), stage=DESCRIBED)
    failed = StepFailed(step="push the checkpoint", cause=OSError("registry gone"), undo_errors=[("checkpoint", OSError("restore failed"))])
    assert orchestrate._lost_without(work, record, failed)
    assert failed.exit_code == ExitCode.ROLLBACK_FAILED and f"stays in {work}" in str(failed)
    rolled_back = StepFailed(step="push the checkpoint", cause=OSError("registry gone"), undone=["store the checkpoint", "checkpoint"])
    assert not orchestrate._lost_without(work, record, rolled_back)
    record.leave_running = True
    assert not orchestrate._lost_without(work, record, StepFailed(step="x", cause=OSError("y"), undo_errors=[("checkpoint", OSError("z"))]))


def test_release_unmounts_what_is_mounted_inside_first(tmp_path: Path) -> None:
    """A restore killed with its image tmpfs mounted: the sweep's release unmounts it (deepest
    first, escaped names read back) before removing the dir."""
    work = tmp_path / "work-1-x"
    (work / "images").mkdir(parents=True)
    odd = work / "a b"
    odd.mkdir()
    mountinfo = "\n".join([
        f"30 1 0:5 / {tmp_path} rw - ext4 /dev/vda rw",
        f"41 30 0:40 / {work}/images rw - tmpfs gpusnap-images rw",
        f"42 41 0:41 / {work}/images/inner rw - tmpfs x rw",
        f"43 30 0:42 / {str(odd).replace(' ', chr(92) + '040')} rw - tmpfs y rw",
        f"44 30 0:43 / {tmp_path}/work-1-xy rw - tmpfs z rw",  # a sibling whose name starts alike
    ])
    calls: list[list[str]] = []
    workdirs.release(work, mountinfo=mountinfo, run=calls.append)
    assert calls == [["umount", "-l", f"{work}/images/inner"], ["umount", "-l", f"{work}/images"], ["umount", "-l", str(odd)]]
    assert not work.exists()


def test_the_mount_table_reads_escaped_and_non_ascii_points_back() -> None:
    mountinfo = "\n".join([
        r"41 30 0:40 / /run/a\040b\011c rw - tmpfs gpusnap-images rw",
        r"42 30 0:41 / /run/back\134slash rw shared:2 - ext4 /dev/vdb rw",
        "43 30 0:42 / /run/réseau rw - tmpfs t rw",
        "garbage line",
    ])
    assert workdirs.mount_table(mountinfo) == [("/run/a b\tc", "tmpfs"), ("/run/back\\slash", "ext4"), ("/run/réseau", "tmpfs")]


def _wait_gone(path: Path, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not path.exists()


def test_a_background_release_moves_the_dir_away_at_once_and_removes_it_later(tmp_path: Path) -> None:
    base = tmp_path / "tmp"
    with workdirs.claim(base) as work:
        (work / "checkpoint").mkdir()
        (work / "checkpoint" / "pages-1.img").write_bytes(os.urandom(1 << 20))
        workdirs.release(work, background=True, mountinfo="")
        assert not work.exists()  # gone from its name before release returns
    assert _wait_gone(base / (workdirs.GONE_PREFIX + work.name)), "the detached rm did not remove the moved dir"
    assert list(base.iterdir()) == []


def test_a_background_release_removes_in_place_when_rm_cannot_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workdirs, "remove_detached", lambda path: False)
    base = tmp_path / "tmp"
    with workdirs.claim(base) as work:
        (work / "f").write_text("x")
        workdirs.release(work, background=True, mountinfo="")
    assert list(base.iterdir()) == []


def test_the_sweep_finishes_a_background_removal_that_was_cut_short(tmp_path: Path) -> None:
    base = tmp_path / "tmp"
    left = base / f"{workdirs.GONE_PREFIX}work-1-abc"
    (left / "checkpoint").mkdir(parents=True)
    (left / "checkpoint" / "pages-1.img").write_bytes(b"x" * 4096)
    assert sweep(base, recover=None, container_running=lambda record: None) == []
    assert _wait_gone(left)
