"""How the CLI prints: rich tables that fit the terminal, JSON on request, progress on a TTY only."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rich.console import Console

TYPE_CHECKING = False
if TYPE_CHECKING:
    from rich.table import Column

# rich.progress, rich.table and rich.text load where they are used: checkpoint and restore
# print no table and, off a terminal, no progress (about 15 ms of every command's start-up).


def print_error(exc: BaseException) -> None:
    """The one line an expected failure prints on stderr, the same from every command."""
    print(f"gpusnap: error: {exc}", file=sys.stderr)


@dataclass(frozen=True)
class Out:
    """The consoles of one command run; built per invocation (no module-level state)."""

    stdout: Console
    stderr: Console
    verbose: bool = False

    @classmethod
    def make(cls, verbose: bool = False) -> "Out":
        # soft_wrap off + COLUMNS honoured by rich: tables are laid out to the terminal width.
        return cls(Console(highlight=False), Console(stderr=True, highlight=False), verbose)

    def json(self, data: Any) -> None:
        # Plain print: rich would wrap long strings and break the JSON.
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")

    def table(self, columns: Sequence[str | Column], rows: Sequence[Sequence[Any]], *, title: str | None = None) -> None:
        """A borderless table laid out to the terminal width (80 when not a terminal).

        Pass a rich Column to say how a column gives way: identifiers should never wrap, free
        text (commands) ends in an ellipsis rather than pushing lines past the width.
        """
        from rich.table import Column, Table

        table = Table(title=title, box=None, header_style="bold", pad_edge=False, expand=False)
        for col in columns:
            if isinstance(col, Column):
                table.add_column(col.header, no_wrap=col.no_wrap, overflow=col.overflow, justify=col.justify,
                                 min_width=col.min_width, max_width=col.max_width)
            else:
                table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*("" if v is None else str(v) for v in row))
        self.stdout.print(table)

    def info(self, text: str) -> None:
        # Not wrapped: references and paths must stay whole for copy and paste.
        self.stdout.print(text, soft_wrap=True)

    def notice(self, text: str) -> None:
        """A line the user must see whatever --json says (stderr), e.g. what was recovered."""
        self.stderr.print(text, soft_wrap=True, markup=False, highlight=False)

    def detail(self, text: str) -> None:
        if self.verbose:
            self.stderr.print(f"[dim]{text}[/dim]")

    @contextmanager
    def progress(self, start: str) -> Iterator["Reporter"]:
        """Live progress on a terminal (a spinner for steps, bars for transfers); -v lines otherwise."""
        if not self.stderr.is_terminal:
            self.detail(start)
            yield Reporter(None, self.detail)
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TransferSpeedColumn

        bytes_only = [_transfer_column(c) for c in (BarColumn(), DownloadColumn(), TransferSpeedColumn())]
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), *bytes_only, console=self.stderr, transient=True) as live:
            yield Reporter(live, self.detail, live.add_task(start, total=None))


def _transfer_column(inner: Any) -> Any:
    """``inner`` shown for byte transfers only; step lines are a spinner and their text."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class TransferColumn(ProgressColumn):
        def render(self, task: Any) -> Any:
            return inner.render(task) if task.fields.get("transfer") else Text("")

    return TransferColumn()


class _Transfer:
    """One byte-counting bar inside the command's live display (packaging's Progress protocol)."""

    def __init__(self, live: Any, description: str) -> None:
        self._live = live
        self._task = live.add_task(description, total=0, transfer=True)

    def add_total(self, n: int) -> None:
        task = next(t for t in self._live.tasks if t.id == self._task)
        self._live.update(self._task, total=(task.total or 0) + n)

    def advance(self, n: int) -> None:
        self._live.advance(self._task, n)

    def close(self) -> None:
        self._live.remove_task(self._task)


class _NoTransfer:
    def add_total(self, n: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class Reporter:
    """Called with the current step's text; ``transfer()`` gives a bar for bytes moved."""

    def __init__(self, live: Any, detail: Callable[[str], None], task: Any = None) -> None:
        self._live, self._detail, self._task = live, detail, task

    def __call__(self, text: str) -> None:
        if self._live is not None:
            self._live.update(self._task, description=text)
        self._detail(text)

    def transfer(self, description: str) -> Any:
        return _Transfer(self._live, description) if self._live is not None else _NoTransfer()


def human_size(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def age(rfc3339: str, now: float | None = None) -> str:
    """How long ago, compactly (``42s``, ``5m``, ``3h``, ``2d``), as listings show it."""
    import time
    from datetime import datetime

    if not rfc3339:
        return ""
    try:
        then = datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return rfc3339
    secs = max(0, int((time.time() if now is None else now) - then))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit} ago"
    return f"{secs}s ago"
