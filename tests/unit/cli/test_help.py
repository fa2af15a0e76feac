"""Every command's --help renders at 80 columns through the real entry point, text intact.

Typer renders help through rich markup, so a help text such as ``HOST:CONTAINER[/tcp|udp]`` is
read as a closing tag (a crash) and a word in brackets may silently vanish; this walks the whole
command tree so a new command or option cannot bring that back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from gpusnap.cli.main import build_app, build_command, main


def _walk(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _walk(sub, [*path, name])


def _raw_helps() -> dict[tuple[str, ...], list[str]]:
    """Each command's help texts as written (before gpusnap escapes them for rich)."""
    import typer

    raw: dict[tuple[str, ...], list[str]] = {}
    for path, cmd in _walk(typer.main.get_command(build_app()), []):
        raw[tuple(path)] = [t for t in [cmd.help, *(getattr(p, "help", None) for p in cmd.params)] if isinstance(t, str)]
    return raw


COMMANDS = [path for path, _ in _walk(build_command(), [])]
RAW = _raw_helps()


def test_the_walk_finds_the_commands() -> None:
    names = {" ".join(p) for p in COMMANDS}
    assert {"", "run", "delete", "inspect", "import", "doctor", "ls", "push", "checkpoint"} <= names


@pytest.mark.parametrize("path", COMMANDS, ids=[" ".join(p) or "gpusnap" for p in COMMANDS])
def test_help_renders_at_80_columns(path: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.setenv("NO_COLOR", "1")
    with pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    lines = out.splitlines()
    assert lines and all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    flat = re.sub(r"[\s│╭╮╰╯─]+", "", out)
    for text in RAW[tuple(path)]:
        for bracketed in re.findall(r"\[[^\]]*\]", text):  # what rich markup would swallow
            assert re.sub(r"\s+", "", bracketed) in flat, bracketed


@pytest.mark.parametrize("path", [p for p in COMMANDS if p], ids=[" ".join(p) for p in COMMANDS if p])
def test_help_paragraphs_flow_to_the_width(path: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A docstring's own line breaks do not reach the screen: a paragraph's lines are filled to
    the width, so only its last line may end early (``delete`` once showed "… each that does" /
    "not or" / "could not be deleted, …")."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.setenv("NO_COLOR", "1")
    with pytest.raises(SystemExit):
        main([*path, "--help"])
    out = capsys.readouterr().out
    description = out.split("╭")[0].splitlines()[3:]  # after "Usage: ..." and its blank line
    paragraph: list[str] = []
    for line in [*description, ""]:
        text = line.strip()
        if text:
            paragraph.append(text)
            continue
        for early, following in zip(paragraph, paragraph[1:]):
            # filled: the next line's first word would not have fitted on this one
            assert len(early) + 1 + len(following.split()[0]) > 78, (early, following)
        paragraph = []
