"""Transfer progress: a rich progress bar on a terminal, silence otherwise.

Push and pull report bytes from several worker threads; rich's Progress is thread-safe.
"""

from __future__ import annotations

import sys
from typing import Protocol


class Progress(Protocol):
    def add_total(self, n: int) -> None: ...
    def advance(self, n: int) -> None: ...
    def close(self) -> None: ...


class NullProgress:
    def add_total(self, n: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class CountingProgress(NullProgress):
    """Records totals; used by tests and the benchmark to check what moved."""

    def __init__(self) -> None:
        self.total = 0
        self.done = 0

    def add_total(self, n: int) -> None:
        self.total += n

    def advance(self, n: int) -> None:
        self.done += n


class RichProgress:
    def __init__(self, description: str) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress as _P, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        self._p = _P(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                     transient=True)
        self._p.start()
        self._task = self._p.add_task(description, total=0)

    def add_total(self, n: int) -> None:
        self._p.update(self._task, total=(self._p.tasks[0].total or 0) + n)

    def advance(self, n: int) -> None:
        self._p.advance(self._task, n)

    def close(self) -> None:
        self._p.stop()


def default_progress(description: str) -> Progress:
    return RichProgress(description) if sys.stderr.isatty() else NullProgress()
