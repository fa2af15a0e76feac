"""Wires this directory's tests to the reliability ledger (tests/reliability/reliability_ledger.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "reliability"))

from reliability_ledger import ledger, module_ledger, pytest_collection_modifyitems, pytest_terminal_summary  # noqa: E402,F401
