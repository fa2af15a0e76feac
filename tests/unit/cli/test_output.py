from __future__ import annotations

import io

from rich.console import Console
from rich.table import Column

from gpusnap.cli.output import Out, age, human_size


def test_human_size() -> None:
    assert human_size(0) == "0 B"
    assert human_size(1023) == "1023 B"
    assert human_size(1536) == "1.5 KiB"
    assert human_size(5 * 1024**3) == "5.0 GiB"


def test_age() -> None:
    assert age("2026-01-01T00:00:00Z", now=1767225600 + 42) == "42s ago"
    assert age("2026-01-01T00:00:00Z", now=1767225600 + 3 * 3600 + 5) == "3h ago"
    assert age("") == ""
    assert age("not a date") == "not a date"


def test_table_keeps_to_80_columns() -> None:
    buf = io.StringIO()
    out = Out(Console(file=buf, width=80), Console(file=io.StringIO(), width=80))
    rows = [("a-container-name", "running", 123, "x " * 100)]
    out.table([Column("NAME", no_wrap=True), "STATUS", "PID", Column("COMMAND", overflow="fold")], rows)
    lines = buf.getvalue().splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "PID", "COMMAND"]
    assert lines[1].startswith("a-container-name")
    assert max(map(len, lines)) <= 80


def test_progress_off_when_not_a_terminal() -> None:
    err = io.StringIO()
    out = Out(Console(file=io.StringIO()), Console(file=err), verbose=False)
    with out.progress("working") as report:
        report("step two")
        bar = report.transfer("push")
        bar.add_total(10)
        bar.advance(10)
        bar.close()
    assert err.getvalue() == ""


def test_progress_on_a_terminal_shows_steps_and_transfer_bars() -> None:
    err = io.StringIO()
    out = Out(Console(file=io.StringIO()), Console(file=err, force_terminal=True, width=100), verbose=False)
    with out.progress("working") as report:
        report("pushing x")
        bar = report.transfer("push x")
        bar.add_total(2048)
        bar.advance(1024)
        out.stderr.file.flush()
        bar.close()
    text = err.getvalue()
    assert "pushing x" in text or "push x" in text
