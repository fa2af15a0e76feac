"""A restore whose memory pages are still being written when runc starts: CRIU is held just
before it reads them.

gpusnap's runc-direct engine opens the runtime's gate (``GPUSNAP_RESTORE_GATE_FD``, see
gpusnap.metadata) in two words when the pages come last: ``rootfs`` once the root filesystem
and every image file but the pages files are in place, then ``pages`` once the pages files are
whole (or ``stop``: they never will be). Between the two, runc and CRIU already run the first
part of the restore — runc's start, CRIU's start and image collection, the forked root task,
its namespaces, the prestart and createRuntime hooks — and CRIU waits for the pages at its
``setup-namespaces`` action, before any task restores its mount namespace (which restores SysV
shared memory from the pages) or maps its memory.

Why an action script: runc drives CRIU over RPC and answers its notifications itself, but CRIU
3.19 and later also runs the action scripts of its config file in that mode, and the runtime
owns that file for every container (gpusnap.criu.config). For one restore the runtime adds an
``action-script`` line naming a shell script of its own (started by root CRIU, in the runtime's
private run directory) and takes it away again when the restore ends, whichever way. The script
reads one word from a FIFO that only the runtime holds open for writing: ``ok`` lets CRIU go on;
``stop``, or end of file (the runtime is gone), fails CRIU's restore, and runc then removes the
half-restored tasks. Were the hold ever skipped (CRIU reached ``pre-resume`` without passing
it), the script fails the restore there, before any restored task runs on pages read too early.

Where CRIU cannot be held (older than 3.19, or a container naming its admin's own CRIU config,
which gpusnap does not edit), the runtime waits for ``pages`` before runc, as with one word.
"""

from __future__ import annotations

import os
import shlex
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.errors import RestoreError
from gpusnap.metadata import GATE_ALL, GATE_PAGES, GATE_ROOTFS

HOLD_SINCE = (3, 19)  # CRIU runs a config file's action scripts under RPC (runc) from 3.19 on
HOLD_ACTION = "setup-namespaces"
CHECK_ACTIONS = ("pre-resume", "post-restore")  # the hold must have been passed before these
ACTION_SCRIPT_OPTION = "action-script"



def criu_can_hold(version: tuple[int, ...]) -> bool:
    return tuple(version[:2]) >= HOLD_SINCE


def hold_dir(run_dir: Path) -> Path:
    return run_dir / "restore-pages"


class Gate:
    """The read end of the runtime's gate pipe: one word per line."""

    def __init__(self, fd_text: str, env_name: str) -> None:
        try:
            self.fd = int(fd_text)
        except ValueError:
            raise RestoreError(f"{env_name}={fd_text[:40]!r} is not a file descriptor; unset it (only gpusnap itself sets it)") from None
        self.env_name = env_name
        self._buffer = b""
        self.pages_pending = False
        try:
            # Passed to this process inheritable: runc, CRIU and the container must not get it.
            os.set_inheritable(self.fd, False)
        except OSError as exc:
            raise RestoreError(f"cannot read the restore's go-ahead from fd {self.fd} ({exc.strerror}); unset {self.env_name}") from None

    def word(self) -> bytes:
        """The next line's word; b"" at end of file (the caller is gone)."""
        while b"\n" not in self._buffer and len(self._buffer) < 4096:
            try:
                chunk = os.read(self.fd, 4096)
            except OSError as exc:
                raise RestoreError(f"cannot read the restore's go-ahead from fd {self.fd} ({exc.strerror}); unset {self.env_name}") from None
            if not chunk:
                break
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.strip()

    def wait_first(self) -> None:
        """The first word: ``ok`` (all ready) or ``rootfs`` (the pages still coming)."""
        word = self.word()
        if word == GATE_ROOTFS:
            self.pages_pending = True  # the pipe stays open for the next word
            return
        self.close()
        if word != GATE_ALL:
            raise RestoreError("the caller stopped the restore before runc ran: its root filesystem or images could not be made ready")

    def wait_pages(self) -> bool:
        """After ``rootfs``: whether the pages are whole (``pages``) rather than never (``stop``,
        end of file). Closes the pipe."""
        try:
            return self.word() == GATE_PAGES
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


def script_text(fifo: Path, passed: Path, waiting: Path, failed: Path) -> str:
    f, p, w, x = (shlex.quote(str(path)) for path in (fifo, passed, waiting, failed))
    checks = "|".join(CHECK_ACTIONS)
    return f"""#!/bin/sh
# Written by gpusnap-runtime for one restore and removed when it ends (gpusnap.checkpoint.pages_hold).
case "$CRTOOLS_SCRIPT_ACTION" in
{HOLD_ACTION})
    # CRIU may list a config file's script twice (it reads the file once more under runc's
    # RPC) and runs every one even after one failed: a later run repeats the first's answer.
    [ -e {p} ] && exit 0
    [ -e {x} ] && exit 1
    : > {w}
    word=
    read -r word < {f} || true
    if [ "$word" = ok ]; then
        : > {p}
        exit 0
    fi
    : > {x}
    echo "gpusnap: the checkpoint's memory pages could not be made ready; the restore stops here" >&2
    exit 1 ;;
{checks})
    [ -e {p} ] && exit 0
    echo "gpusnap: CRIU reached $CRTOOLS_SCRIPT_ACTION without waiting for the memory pages; the restore stops here" >&2
    exit 1 ;;
esac
exit 0
"""


@dataclass
class PagesHold:
    """CRIU held at ``setup-namespaces`` of one restore until ``gate`` says the pages are whole.

    ``install`` writes the FIFO and the script and adds the script to ``config`` (CRIU's config
    file for this container); ``release`` puts ``config`` back as it was and removes the rest.
    Both are idempotent, so ``release`` serves as the undo of a failed restore and as the last
    step of one that worked."""

    gate: Gate
    config: Path
    directory: Path
    container_id: str
    clock: Callable[[], float] = time.monotonic
    timings: dict[str, float] = field(default_factory=dict)
    _fd: int = -1
    _previous: bytes | None = None
    _relay: threading.Thread | None = None
    _installed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def fifo(self) -> Path:
        return self.directory / f"{self.container_id}.fifo"

    @property
    def script(self) -> Path:
        return self.directory / f"{self.container_id}.sh"

    @property
    def passed(self) -> Path:
        return self.directory / f"{self.container_id}.passed"

    @property
    def failed(self) -> Path:
        return self.directory / f"{self.container_id}.failed"

    @property
    def waiting(self) -> Path:
        return self.directory / f"{self.container_id}.waiting"

    def install(self) -> None:
        try:
            self._install()
        except BaseException:
            self.release()  # a step that fails is not undone by run_steps: leave nothing behind
            raise

    def _install(self) -> None:
        self.release()  # a killed restore's leftovers
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)  # root's; CRIU runs the script as root
        os.mkfifo(self.fifo, 0o600)
        # Held open for writing by this process only (close-on-exec: runc, CRIU and the
        # container never inherit it), so the script's read sees end of file if it dies.
        self._fd = os.open(self.fifo, os.O_RDWR | os.O_CLOEXEC)
        tmp = self.script.with_name(f".{self.script.name}.tmp")
        tmp.write_text(script_text(self.fifo, self.passed, self.waiting, self.failed))
        os.chmod(tmp, stat.S_IRWXU)
        tmp.replace(self.script)
        self._previous = self.config.read_bytes()
        self._installed = True
        text = self._previous.decode()
        if text and not text.endswith("\n"):
            text += "\n"
        _write_atomically(self.config, f"{text}{ACTION_SCRIPT_OPTION} {self.script}\n".encode())
        started = self.clock()
        self._relay = threading.Thread(target=self._pass_on, args=(started,), name="gpusnap-pages-hold", daemon=True)
        self._relay.start()

    def _pass_on(self, started: float) -> None:
        try:
            whole = self.gate.wait_pages()
        except RestoreError:
            whole = False  # an unreadable gate: the pages are not known to be whole
        self.timings["pages whole, after runc was let go"] = round(self.clock() - started, 4)
        self._note_criu_wait()
        with self._lock:  # never a write to an fd number ``release`` closed and something reused
            if self._fd < 0:
                return  # released already: the restore ended without CRIU reaching the hold
            try:
                os.write(self._fd, b"ok\n" if whole else b"stop\n")
            except OSError:
                pass

    def _note_criu_wait(self) -> None:
        try:
            began = self.waiting.stat().st_mtime
        except OSError:
            self.timings["CRIU waited for the pages"] = 0.0  # CRIU had not reached the hold yet
            return
        self.timings["CRIU waited for the pages"] = round(max(0.0, time.time() - began), 4)

    def release(self) -> None:
        if self._installed and self._previous is not None:
            try:
                _write_atomically(self.config, self._previous)
            except OSError:
                pass  # the container's CRIU config went with its bundle
        self._installed = False
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)  # a script still waiting reads end of file and fails CRIU
                self._fd = -1
        for path in (self.script, self.fifo, self.passed, self.failed, self.waiting):
            path.unlink(missing_ok=True)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.hold")
    tmp.write_bytes(data)
    tmp.replace(path)
