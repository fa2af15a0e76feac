"""The reliability suite's ledger: tests record what they tried, the report prints it.

Every figure in the reliability table comes from a line a test wrote in the same pytest run:
``record(category, name, tried=..., refused=..., lost=...)``. ``pytest_collection_modifyitems``
clears the ledger once per run (the StashKey makes the two conftests that load this module agree
on "once"), and the terminal summary prints the table (see report.py).

The pytest side (the hooks and the ``ledger`` / ``module_ledger`` fixtures) is at the end: the
conftest.py of tests/unit/reliability and of tests/integration/reliability import it from here.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

LEDGER_ENV = "GPUSNAP_RELIABILITY_LEDGER"
_CLEARED = pytest.StashKey[bool]()


@dataclass
class Entry:
    category: str  # fault | bad-input | load | permissions | crypto | privilege
    name: str
    tried: int = 1
    refused: int = 0  # bad inputs refused with a clear error; privilege requests refused
    passed: int = 0  # faults whose four checks held; load runs that held; privilege cases that changed nothing
    lost: int = 0  # blobs/checkpoints missing or corrupt after the event
    detail: str = ""


def ledger_path(root: Path) -> Path:
    env = os.environ.get(LEDGER_ENV)
    return Path(env) if env else root / "build" / "reliability" / "ledger.jsonl"


class Ledger:
    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, category: str, name: str, **fields: object) -> Entry:
        entry = Entry(category, name, **fields)  # type: ignore[arg-type]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Appends from parallel threads/processes must not interleave.
        with self.path.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(json.dumps(asdict(entry)) + "\n")
        return entry

    def entries(self) -> list[Entry]:
        if not self.path.exists():
            return []
        return [Entry(**json.loads(line)) for line in self.path.read_text().splitlines() if line.strip()]


def clear_once(config: pytest.Config) -> Ledger:
    ledger = Ledger(ledger_path(config.rootpath))
    if not config.stash.get(_CLEARED, False):
        config.stash[_CLEARED] = True
        if ledger.path.exists():
            ledger.path.unlink()
    return ledger


def summary_once(config: pytest.Config, terminalreporter: object) -> None:
    key = _SUMMARY
    if config.stash.get(key, False):
        return
    config.stash[key] = True
    from report import render, render_details  # same directory, on sys.path through the conftests

    ledger = Ledger(ledger_path(config.rootpath))
    entries = ledger.entries()
    if not entries:
        return
    table = render(entries)
    out = ledger.path.with_name("report.md")
    out.write_text(table + "\n\n" + render_details(entries) + "\n")
    terminalreporter.write_sep("=", "gpusnap reliability table")  # type: ignore[attr-defined]
    terminalreporter.write_line(table)  # type: ignore[attr-defined]
    terminalreporter.write_line(f"(written to {out})")  # type: ignore[attr-defined]


_SUMMARY = pytest.StashKey[bool]()


# ---- the pytest side: what each reliability directory's conftest.py imports ------------------

def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    clear_once(config)


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: pytest.Config) -> None:
    summary_once(config, terminalreporter)


@pytest.fixture
def ledger(pytestconfig: pytest.Config) -> Ledger:
    return Ledger(ledger_path(pytestconfig.rootpath))


@pytest.fixture(scope="module")
def module_ledger(pytestconfig: pytest.Config) -> Ledger:
    return Ledger(ledger_path(pytestconfig.rootpath))
