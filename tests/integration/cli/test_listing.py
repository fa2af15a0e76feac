"""Listings fit an 80-column terminal and their --json says the same as the table."""

from __future__ import annotations

import pytest

from .conftest import COUNTER, Gs, unique

pytestmark = pytest.mark.integration


def test_ps_table_fits_80_columns_and_matches_json(gs: Gs) -> None:
    names = [unique("rd-list-long-name"), unique("rd")]
    try:
        for n in names:
            gs("run", n, "--", "sh", "-c", COUNTER + " # padding to make the command column long enough to wrap")
        table = gs("ps").stdout
        assert table.strip(), "ps printed nothing"
        assert max(len(line) for line in table.splitlines()) <= 80, table
        rows = gs.json("ps")
        assert sorted(r["name"] for r in rows) == sorted(names)  # type: ignore[index,union-attr]
        lines = table.splitlines()
        assert lines[0].split() == ["NAME", "STATUS", "PID", "NET", "CREATED", "COMMAND"]
        for r in rows:  # type: ignore[union-attr]
            assert r["status"] == "running" and r["pid"] > 0
            # The JSON row and the table row agree on every short field.
            [line] = [ln for ln in lines if ln.startswith(r["name"] + " ")]
            assert line.split()[1:4] == [r["status"], str(r["pid"]), r["labels"]["network"]]
    finally:
        for n in names:
            gs("delete", n, check=False)
