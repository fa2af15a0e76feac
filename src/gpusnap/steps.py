"""Explicit sequences of steps, each with its undo, so rollback is structural.

Checkpoint and restore are written as a list of :class:`Step`. :func:`run_steps` runs them in
order, times each one, and on any failure (an exception, or a signal turned into one by
:func:`signals_as_exceptions`) runs the undo of every step that completed, newest first, then
raises :class:`StepFailed` naming the step and the cause. An undo that itself fails does not
stop the other undos; it is reported in the error so nothing is silently left behind.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from gpusnap.errors import ExitCode, GpusnapError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (2 ms on every create)
if TYPE_CHECKING:
    from concurrent.futures import Future
    from typing import Any


@dataclass
class Step:
    """One unit of work and, if it changes anything, how to take that change back."""

    name: str
    do: Callable[[], Any]
    undo: Callable[[], None] | None = None


@dataclass
class StepRecord:
    """A step that ran: its name, how long it took and what it returned."""

    name: str
    seconds: float
    result: Any = None


@dataclass
class StepFailed(GpusnapError):
    """A step failed; completed steps were undone (see ``undo_errors`` for undos that failed)."""

    step: str
    cause: BaseException
    completed: list[StepRecord] = field(default_factory=list)
    undone: list[str] = field(default_factory=list)
    undo_errors: list[tuple[str, BaseException]] = field(default_factory=list)

    def __post_init__(self) -> None:
        msg = f"{self.step} failed: {self.cause}"
        if self.undo_errors:
            left = "; ".join(f"undo of {n} failed: {e}" for n, e in self.undo_errors)
            msg += f" — rollback incomplete: {left}"
        elif self.undone:
            msg += f" (rolled back: {', '.join(self.undone)})"
        GpusnapError.__init__(self, msg)
        if self.undo_errors:
            self.exit_code = ExitCode.ROLLBACK_FAILED
        elif isinstance(self.cause, GpusnapError):
            self.exit_code = self.cause.exit_code

    def __str__(self) -> str:  # dataclass would otherwise replace Exception.__str__
        return GpusnapError.__str__(self)

    __hash__ = object.__hash__


class Interrupted(GpusnapError):
    """A termination signal arrived while steps were running."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def run_steps(steps: Sequence[Step], *, clock: Callable[[], float] = time.perf_counter) -> list[StepRecord]:
    """Run ``steps`` in order; on failure undo the completed ones in reverse and raise StepFailed."""
    completed: list[tuple[Step, StepRecord]] = []
    for step in steps:
        start = clock()
        try:
            result = step.do()
        except BaseException as exc:  # noqa: BLE001 - signals and SystemExit must roll back too
            undone, undo_errors = _undo(completed)
            raise StepFailed(
                step=step.name,
                cause=exc,
                completed=[r for _, r in completed],
                undone=undone,
                undo_errors=undo_errors,
            ) from exc
        completed.append((step, StepRecord(step.name, clock() - start, result)))
    return [r for _, r in completed]


def _undo(completed: list[tuple[Step, StepRecord]]) -> tuple[list[str], list[tuple[str, BaseException]]]:
    undone: list[str] = []
    errors: list[tuple[str, BaseException]] = []
    for step, _ in reversed(completed):
        if step.undo is None:
            continue
        try:
            step.undo()
            undone.append(step.name)
        except BaseException as exc:  # noqa: BLE001 - keep undoing the rest
            errors.append((step.name, exc))
    return undone, errors


def background(fn: Callable[[], Any], name: str) -> "Future[Any]":
    """Run ``fn`` on a thread of its own (a daemon: an exception is raised where the result is
    read, and a failure elsewhere does not wait for it)."""
    import threading
    from concurrent.futures import Future

    fut: Future[Any] = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the reader of the result
            fut.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


class Beside:
    """Steps run on a thread of their own while the caller's steps go on, with the same
    rollback: a failure there undoes what completed there (as :func:`run_steps` does), and
    :meth:`undo` takes back, newest first, what completed once the caller's own steps fail.
    Made to be a caller's step itself: ``Step(name, beside.start, beside.undo)``."""

    def __init__(self, steps: Sequence[Step], *, name: str = "gpusnap-beside", clock: Callable[[], float] = time.perf_counter) -> None:
        import threading

        self.steps = list(steps)
        self.clock = clock
        self.records: list[StepRecord] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self.records = run_steps(self.steps, clock=self.clock)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the steps have ended (done or failed) within ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> list[StepRecord]:
        """Wait for the steps; their records, or their StepFailed (already undone there)."""
        self.wait()
        if self.error is not None:
            raise self.error
        return self.records

    def undo(self) -> None:
        if not self._thread.is_alive() and not self._thread.ident:
            return  # never started
        self.wait()
        if self.error is not None:
            return  # undone on its own thread when it failed
        _, errors = _undo(list(zip(self.steps, self.records)))
        if errors:
            raise errors[0][1]


@contextmanager
def signals_as_exceptions(signums: Sequence[int] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)) -> Iterator[None]:
    """Turn termination signals into :class:`Interrupted` so running steps roll back.

    Only usable from the main thread (Python delivers signals there).
    """

    def handler(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# What a report calls the time before a process's own first step: the interpreter's start, its
# imports (and a CLI's parsing of its command line), from process_age_s.
STARTUP = "start-up and imports"


def process_age_s(proc: str = "/proc") -> float | None:
    """Seconds since this process started (the kernel's start time, in clock ticks): what came
    before the first step, the interpreter's start and the imports included, which no clock the
    process starts itself can see. None where /proc cannot tell."""
    import os

    try:
        with open(f"{proc}/self/stat", "rb") as fh:
            stat = fh.read()
        # Field 22; the command name (field 2) may hold spaces and ')' so count from its end.
        started_ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        ticks = os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / ticks)
    except (OSError, ValueError, IndexError):
        return None
