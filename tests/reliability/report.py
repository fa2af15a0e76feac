"""Print the reliability table from the ledger the suite wrote in its last run.

    python tests/reliability/report.py [--details] [build/reliability/ledger.jsonl]

Every number comes from the ledger (tests/reliability/ledger.py); nothing here is typed in by
hand. A category with nothing recorded prints "not run" rather than a zero that looks like a pass.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_ledger import Entry, Ledger, ledger_path  # noqa: E402

_ROWS = [
    ("fault", "Faults injected"),
    ("bad-input", "Bad inputs tried"),
    ("crypto", "Encryption attacks tried"),
    ("privilege", "Privilege boundary"),
    ("load", "Load held"),
    ("permissions", "Private permissions checked"),
]


def _group(entries: list[Entry], category: str) -> dict[str, list[Entry]]:
    groups: dict[str, list[Entry]] = defaultdict(list)
    for e in entries:
        if e.category == category:
            groups[e.name].append(e)
    return groups


def render(entries: list[Entry]) -> str:
    lines = ["| What | Figure | Detail |", "|---|---|---|"]
    for category, title in _ROWS:
        groups = _group(entries, category)
        if not groups:
            lines.append(f"| {title} | not run | |")
            continue
        tried = sum(e.tried for g in groups.values() for e in g)
        if category == "privilege":
            # tried: what a container (or a checkpoint) asked root CRIU for; refused: the runtime
            # said no (or the restore ran without it); passed: nothing changed on the host.
            refused = sum(e.refused for g in groups.values() for e in g)
            held = sum(e.passed for g in groups.values() for e in g)
            figure = f"{tried} tried, {refused} refused, {held} left nothing changed"
            families = defaultdict(int)
            for name, g in groups.items():
                families[name.split(":", 1)[0]] += sum(e.tried for e in g)
            detail = ", ".join(f"{fam} {n}" for fam, n in sorted(families.items()))
        elif category in ("bad-input", "crypto"):
            refused = sum(e.refused for g in groups.values() for e in g)
            figure = f"{tried} tried, {refused} refused"
            families: dict[str, int] = defaultdict(int)
            for name, g in groups.items():
                families[name.split(":", 1)[0]] += sum(e.tried for e in g)
            detail = ", ".join(f"{fam} {n}" for fam, n in sorted(families.items()))
        else:
            held = sum(e.passed for g in groups.values() for e in g)
            figure = f"{tried} run, {held} held"
            with_detail = category == "load"  # load's detail is its figures (time, memory)
            detail = ", ".join(
                f"{name}" + (f" ({g[-1].detail})" if with_detail and g[-1].detail else "") + (f" ×{len(g)}" if len(g) > 1 else "")
                for name, g in sorted(groups.items())
            )
        lines.append(f"| {title} | {figure} | {detail} |")
    lost = sum(e.lost for e in entries)
    lines.append(f"| Data lost | {lost} | checkpoints/blobs missing or corrupt after every fault, load and attack above |")
    return "\n".join(lines)


def render_details(entries: list[Entry]) -> str:
    """Every recorded kind, one row each: what the summary table adds up."""
    rows = ["| Category | Kind | Tried | Refused / held | Lost | Detail |", "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[Entry]] = defaultdict(list)
    for e in entries:
        groups[(e.category, e.name)].append(e)
    for (cat, name), g in sorted(groups.items()):
        ok = sum(e.refused if cat in ("bad-input", "crypto", "privilege") else e.passed for e in g)
        details = "; ".join(sorted({e.detail for e in g if e.detail}))
        rows.append(f"| {cat} | {name} | {sum(e.tried for e in g)} | {ok} | {sum(e.lost for e in g)} | {details} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if not a.startswith("--")]
    path = Path(args[0]) if args else ledger_path(Path(__file__).resolve().parents[2])
    entries = Ledger(path).entries()
    if not entries:
        print(f"no ledger at {path}: run the suite first (bash tests/run.sh)", file=sys.stderr)
        return 1
    print(render(entries))
    if "--details" in argv:
        print()
        print(render_details(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
