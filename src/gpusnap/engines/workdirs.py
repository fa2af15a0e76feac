"""Work directories of `gpusnap checkpoint`/`restore`, and what a killed run leaves in one.

A work dir holds a whole CRIU image (plain process memory). For a checkpoint that stops the
container, that image is the container's only copy from the end of the dump until the store
has tagged it, so a gpusnap killed in that window (kill -9, OOM) must not have its work dir
deleted by the next run: it is stored instead (:func:`sweep` with a ``recover`` callback).
Anything else a dead run left — a dump that never finished (the container still runs), a
restore's unpacked images, a checkpoint already tagged — is removed, as before.

Liveness: the owner holds an exclusive ``flock`` on ``<work>/owner.lock`` for as long as it
uses the dir; the kernel drops it however the owner dies. A sweeping run takes the same lock
before it touches a dir, so two runs never sweep one dir, and never a live one. The lock file
is created under another name and renamed into place once locked: a dir without it belongs to
a run that is starting (or to a gpusnap before this scheme), and is judged by its owner's PID.
The owner records what the dir holds in ``<work>/gpusnap-work.json`` (:class:`WorkRecord`),
rewritten atomically at each stage, so a sweeper knows whether the dump had finished.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from gpusnap.criu.images import DUMP_STATS

RECORD = "gpusnap-work.json"
LOCK = "owner.lock"

# Stages of a checkpoint's work dir, in order.
STARTED = "started"  # the engine is dumping: the image may be partial
DUMPED = "dumped"  # the engine's checkpoint returned: the image is whole
DESCRIBED = "described"  # gpusnap.json written into it
STORED = "stored"  # tagged in the local store: the work dir is a spare copy

DUMP_DONE = DUMP_STATS  # CRIU writes it into the image directory only when a dump succeeded
# Engines whose checkpoint a dead gpusnap left half-done can be finished by the next run
# (their ``complete_interrupted``): runc-direct, whose runc dumps into gpusnap's work dir.
FINISHES_INTERRUPTED = ("runc-direct",)


@dataclass
class WorkRecord:
    """What a work dir is for, written by its owner (``gpusnap-work.json``)."""

    pid: int
    op: str  # "checkpoint" or "restore"
    stage: str = STARTED
    container: str = ""  # the container's name
    engine: str = ""
    form: str = ""  # criu-dir, docker-dir, podman-archive
    checkpoint: str = ""  # the engine's checkpoint (dir or archive) inside the work dir
    ref: str = ""  # the local store reference the run was going to tag
    push: str = ""  # where it was going to push it
    leave_running: bool = False

    def write(self, work: Path) -> None:
        tmp = work / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1, sort_keys=True))
        os.replace(tmp, work / RECORD)

    @classmethod
    def read(cls, work: Path) -> "WorkRecord | None":
        try:
            data = json.loads((work / RECORD).read_text())
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except (OSError, ValueError, TypeError):
            return None


@dataclass(frozen=True)
class Verdict:
    """What to do with a dead run's work dir."""

    action: str  # "remove", "recover" (store its checkpoint), "keep" (leave it and say how to import it)
    reason: str


def decide(record: WorkRecord | None, work: Path, *, container_running: Callable[[WorkRecord], bool | None]) -> Verdict:
    """The fate of the work dir ``work`` of a run known to be dead, from its record and contents.

    ``container_running(record)``: whether the checkpointed container still runs (None: cannot
    tell); asked only when a dump may have finished after gpusnap died (its runc lives on)."""
    if record is None or record.op != "checkpoint":
        return Verdict("remove", "holds nothing that is not stored elsewhere")
    image = Path(record.checkpoint) if record.checkpoint else None
    if image is None or not image.exists() or not image.is_relative_to(work):
        return Verdict("remove", "holds no checkpoint")
    if record.stage == STORED:
        return Verdict("remove", f"its checkpoint is stored as {record.ref}")
    if record.leave_running:
        return Verdict("remove", f"{record.container} kept running (--leave-running)")
    if record.stage in (DUMPED, DESCRIBED):
        return Verdict("recover", f"the only copy of {record.container}, stopped by the checkpoint")
    # STARTED: gpusnap died while the engine dumped. The engine's runc (and CRIU) may have
    # finished without it; then the container is stopped and these images are all that is left.
    if record.form == "criu-dir" and not (image / "inventory.img").exists():
        return Verdict("remove", "the dump did not finish")  # CRIU writes the inventory first
    if record.form == "criu-dir" and record.engine in FINISHES_INTERRUPTED and (image / DUMP_DONE).exists():
        # CRIU writes stats-dump only once a dump has succeeded: the container is stopped and
        # this is its checkpoint, which the engine can finish (the steps gpusnap did not live
        # to take) and the next run store.
        return Verdict("recover", f"the dump of {record.container} finished after gpusnap died: its only copy")
    running = container_running(record)
    if running:
        return Verdict("remove", f"the dump did not finish; {record.container} still runs")
    return Verdict("keep", f"the dump may have finished after gpusnap died, and {record.container} is "
                           + ("gone" if running is False else "in an unknown state"))


@contextmanager
def claim(base: Path) -> Iterator[Path]:
    """A new work dir under ``base``, locked as this process's until the block ends, then removed."""
    base.mkdir(parents=True, exist_ok=True)
    # The owner's PID in the name: dirs of runs that predate the lock (or are starting) are
    # judged by it.
    work = Path(tempfile.mkdtemp(prefix=f"work-{os.getpid()}-", dir=base))
    fd = os.open(work / f".{LOCK}.new", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.replace(work / f".{LOCK}.new", work / LOCK)
        yield work
    finally:
        os.close(fd)


def release(work: Path, *, mountinfo: str | None = None, run: Callable[[list[str]], object] | None = None,
            background: bool = False) -> None:
    """Remove ``work``, unmounting first what is mounted inside it (a restore's image tmpfs,
    engines/imagedir.py: left mounted by a killed run, it would hold its memory until reboot).

    ``background``: the contents are of no more use (a checkpoint stored): the dir is renamed
    out of the way at once and removed by a detached ``rm`` while gpusnap returns. Freeing a
    whole CRIU image is not quick — unlinking 5 GiB on a tmpfs took 0.63 s on the CI machine, a
    34 GB training image several seconds — and nobody waits for it. A removal cut short (host
    reboot, rm killed) leaves a ``.gone-`` dir that the next :func:`sweep` hands to ``rm`` again.
    """
    for point in mounts_under(work, mountinfo):
        (run or run_quiet)(["umount", "-l", point])  # lazy: a process that still has a file open there keeps it till it exits
    if background:
        gone = work.with_name(GONE_PREFIX + work.name)
        try:
            os.rename(work, gone)
        except OSError:
            pass
        else:
            if remove_detached(gone):
                return
            work = gone
    shutil.rmtree(work, ignore_errors=True)


GONE_PREFIX = ".gone-"  # a work dir being removed in the background (release)


def remove_detached(path: Path) -> bool:
    """Start ``rm -rf`` of ``path`` in a session of its own, not waited for; False if it
    cannot start. ``--one-file-system``: never into a mount left inside."""
    try:
        subprocess.Popen(["rm", "-rf", "--one-file-system", "--", str(path)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError:
        return False
    return True


_OCTAL = re.compile(r"\\([0-7]{3})")  # an escaped byte in a mountinfo field


def mount_table(mountinfo: str | None = None) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount in /proc/self/mountinfo (or the text
    ``mountinfo``); [] when it cannot be read. The kernel writes space, tab, newline and
    backslash in a point as octal escapes (\\040 …): they are read back."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return []
    table = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields_ = left.split()
        if not sep or len(fields_) < 5 or not right.split():
            continue
        table.append((_OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields_[4]), right.split()[0]))
    return table


def mounts_under(path: Path, mountinfo: str | None = None) -> list[str]:
    """Mount points at or below ``path`` (deepest first)."""
    root = os.path.realpath(path)
    points = {point for point, _ in mount_table(mountinfo) if point == root or point.startswith(root.rstrip("/") + "/")}
    return sorted(points, key=len, reverse=True)


def run_quiet(argv: list[str]) -> int:
    """Run a mount(8)/umount(8) command, its output dropped: its exit status (127 where the
    command is missing)."""
    try:
        return subprocess.run(argv, capture_output=True, check=False).returncode
    except OSError:
        return 127


@dataclass(frozen=True)
class Swept:
    work: Path
    record: WorkRecord | None
    verdict: Verdict
    note: str = ""  # what the recovery said (the stored reference), or why it failed


def sweep(base: Path, *, recover: Callable[[Path, WorkRecord], str] | None,
          container_running: Callable[[WorkRecord], bool | None]) -> list[Swept]:
    """Judge every work dir under ``base`` whose run is dead (:func:`decide`) and act on it.

    ``recover(work, record)`` stores the checkpoint and returns its reference; None where the
    store cannot be written (the dir is then kept). A failed recovery keeps the dir too: the next
    run tries again. Returns what was done with each dead run's dir (live ones are skipped)."""
    done: list[Swept] = []
    for gone in base.glob(f"{GONE_PREFIX}work-*"):  # a background removal cut short; not waited for either
        if not remove_detached(gone):
            shutil.rmtree(gone, ignore_errors=True)
    for work in sorted(base.glob("work-*-*")):
        with _dead(work) as dead:
            if not dead:
                continue
            record = WorkRecord.read(work)
            verdict = decide(record, work, container_running=container_running)
            if verdict.action == "remove":
                release(work)
                done.append(Swept(work, record, verdict))
                continue
            assert record is not None
            if verdict.action == "recover" and recover is not None:
                try:
                    ref = recover(work, record)
                except Exception as exc:  # noqa: BLE001 - kept, told, tried again next run
                    done.append(Swept(work, record, Verdict("keep", f"storing it failed: {exc}")))
                    continue
                # Tagged now: the work dir is a spare copy. Said in its record first, so a run
                # killed while removing it leaves a dir the next one just removes.
                record.stage, record.ref = STORED, ref
                try:
                    record.write(work)
                except OSError:
                    pass  # then the next run finds the same checkpoint under the tag: nothing added
                release(work)
                done.append(Swept(work, record, verdict, ref))
                continue
            done.append(Swept(work, record, Verdict("keep", verdict.reason)))
    return done


@dataclass(frozen=True)
class Found:
    """One work dir as :func:`survey` sees it, nothing done to it."""

    work: Path
    record: WorkRecord | None
    live: bool  # its run is still going (or a process still uses it)
    verdict: Verdict | None  # for a dead run's dir: what the next gpusnap run will do with it


def survey(base: Path, *, container_running: Callable[[WorkRecord], bool | None]) -> list[Found]:
    """Every work dir under ``base`` and what the next run would do with it, without touching
    any (``gpusnap doctor``)."""
    found: list[Found] = []
    for work in sorted(base.glob("work-*-*")):
        with _dead(work) as dead:
            record = WorkRecord.read(work)
            verdict = decide(record, work, container_running=container_running) if dead else None
            found.append(Found(work, record, not dead, verdict))
    return found


@contextmanager
def _dead(work: Path) -> Iterator[bool]:
    """True (holding the owner's lock while the block runs) when ``work``'s run is dead."""
    try:
        fd = os.open(work / LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        if not work.exists():
            yield False  # another run swept it
            return
        yield not _pid_alive(work) and not _in_use(work)
        return
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False  # its owner, or another sweeper, holds it
            return
        # A runc/CRIU the dead owner started may still write there (a kill -9 spares children).
        yield work.exists() and not _in_use(work)
    finally:
        os.close(fd)


def _pid_alive(work: Path) -> bool:
    try:
        pid = int(work.name.split("-")[1])
    except (IndexError, ValueError):
        return True  # not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _in_use(work: Path) -> bool:
    """Whether a process has its working directory or an open file under ``work``."""
    root = str(work.resolve())
    me = os.getpid()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == me:
            continue
        try:
            links = [os.readlink(proc / "cwd")] + [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue  # gone, or not ours to see
        if any(link == root or link.startswith(root + "/") for link in links):
            return True
    return False
