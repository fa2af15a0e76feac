"""How the CLI prints: rich tables that fit the terminal, JSON on request, progress on a TTY only."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table


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

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None) -> None:
        table = Table(title=title, box=None, header_style="bold", pad_edge=False, expand=False)
        for col in columns:
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*("" if v is None else str(v) for v in row))
        self.stdout.print(table)

    def info(self, text: str) -> None:
        self.stdout.print(text)

    def detail(self, text: str) -> None:
        if self.verbose:
            self.stderr.print(f"[dim]{text}[/dim]")

    @contextmanager
    def progress(self, start: str) -> Iterator[Callable[[str], None]]:
        """A spinner with the current step on a terminal; nothing (or -v lines) otherwise."""
        if self.stderr.is_terminal:
            with self.stderr.status(start) as status:
                yield lambda text: status.update(text)
        else:
            self.detail(start)
            yield self.detail


def human_size(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
