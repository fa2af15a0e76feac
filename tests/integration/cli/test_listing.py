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


def read_table(text: str, columns: list[str], new_row_column: str) -> list[dict[str, str]]:
    """The cells of a rendered table, folded cells joined up again.

    Columns are cut at the header's word positions (left-aligned columns only); a line whose
    ``new_row_column`` cell is not empty starts a row, other lines continue the cells above.
    """
    lines = [ln for ln in text.splitlines() if ln.strip() and not set(ln.strip()) <= {"─"}]
    header = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [columns[0]])
    starts = [lines[header].index(c) for c in columns]
    rows: list[dict[str, str]] = []
    for line in lines[header + 1 :]:
        cut = {c: line[starts[i] : starts[i + 1] if i + 1 < len(starts) else len(line)].strip() for i, c in enumerate(columns)}
        if cut[new_row_column] or not rows:
            rows.append(cut)
        else:
            for c, v in cut.items():
                rows[-1][c] += v
    return rows


def read_ls(text: str) -> list[dict[str, str]]:
    """The rows of `gpusnap ls`, in either of its layouts: one line per checkpoint, or (when the
    references leave no room beside them) each reference on its own line, details indented below."""
    columns = ["REFERENCE", "DIGEST", "CONTAINER", "CREATED"]
    lines = [ln for ln in text.splitlines() if ln.strip() and not set(ln.strip()) <= {"─"}]
    if lines[0].split() != ["REFERENCE"]:
        return read_table(text, columns, new_row_column="DIGEST")
    rows: list[dict[str, str]] = []
    for line in lines[2:]:
        if not line.startswith(" "):
            rows.append(dict.fromkeys(columns, "") | {"REFERENCE": line.strip()})
            continue
        cells = read_table(lines[1] + "\n" + line, columns[1:], new_row_column="DIGEST")[0]
        for c in columns[1:]:
            rows[-1][c] += cells[c]
    return rows


def test_ls_and_inspect_fit_80_columns_and_match_json(gs: Gs) -> None:
    names = [unique("rd-ls"), unique("rd-ls-second")]
    try:
        for n in names:
            gs("run", n, "--", "sh", "-c", COUNTER)
            gs("checkpoint", n, "--leave-running")
        table = gs("ls").stdout
        assert max(len(line) for line in table.splitlines()) <= 80, table
        rows = gs.json("ls")
        assert sorted(r["container"] for r in rows) == sorted(names)  # type: ignore[index,union-attr]
        cells = read_ls(table)
        assert sorted((c["REFERENCE"], c["DIGEST"], c["CONTAINER"]) for c in cells) == sorted(
            (r["ref"], r["digest"].split(":")[1][:12], r["container"]) for r in rows  # type: ignore[index,union-attr]
        )
        for r in rows:  # type: ignore[union-attr]
            info = gs.json("inspect", r["ref"])
            assert info["container"]["name"] == r["container"] and info["digest"] == r["digest"]  # type: ignore[index]
            shown = gs("inspect", r["ref"]).stdout
            assert max(len(line) for line in shown.splitlines()) <= 80, shown
            assert info["form"] in shown and info["engine"]["name"] in shown  # type: ignore[index]
            assert [ln.split() for ln in shown.splitlines() if ln.strip().startswith("└── 1 ")] == [["└──", "1", "sh"]]
    finally:
        for n in names:
            gs("delete", n, check=False)
