"""Every command's --help renders at 80 columns, with its text intact.

Typer renders help through rich markup, so a help text such as ``HOST:CONTAINER[/tcp|udp]`` is
read as a closing tag (a crash) and ``[bold]``-like words silently vanish; this walks the whole
command tree so a new command or option cannot bring that back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from gpusnap.cli.main import build_app


def _walk(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _walk(sub, [*path, name])


APP = build_app()
COMMANDS = list(_walk(typer.main.get_command(APP), []))


def test_the_walk_finds_the_commands() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"", "run", "delete", "inspect", "import", "doctor", "ls", "push"} <= names


@pytest.mark.parametrize("path,command", COMMANDS, ids=[" ".join(p) or "gpusnap" for p, _ in COMMANDS])
def test_help_renders_at_80_columns(path: list[str], command: Any) -> None:
    r = CliRunner().invoke(APP, [*path, "--help"], env={"COLUMNS": "80", "TERM": "dumb", "NO_COLOR": "1"})
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines and all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    flat = re.sub(r"[\s│╭╮╰╯─]+", "", r.output)
    for param in getattr(command, "params", []):
        text = (getattr(param, "help", None) or "").replace("\\[", "[")
        for bracketed in re.findall(r"\[[^\]]*\]", text):  # what rich markup would swallow
            assert re.sub(r"\s+", "", bracketed) in flat, (param.name, bracketed)
