#!/usr/bin/env python3
"""Where a CRIU dump spent its time, from its dump.log (runc has CRIU log at level 4, each line
stamped with seconds since CRIU started): milestones, time by the log's subsystem prefix, and the
longest silences, for one log or several side by side (e.g. a by-hand `runc checkpoint` and
gpusnap's, kept with GPUSNAP_CRIU_LOG_DIR).

    python3 bench/criu_log_phases.py LOG [LOG ...] [--gaps 8]

Time between two stamped lines is given to the first of them: to its prefix ("page-pipe:",
"mnt:", …; "-" for lines without one) and, if it is among the longest, listed with both lines.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

STAMP = re.compile(r"^\((\d+\.\d+)\) (.*)$")
PREFIX = re.compile(r"^([a-z][\w-]*(?: [\w-]+)?):")
# First line matching each, in the order CRIU reaches them in a dump.
MILESTONES = (
    ("dump starts", re.compile(r"Dumping processes")),
    ("tasks frozen", re.compile(r"freezing processes: \d+ attempts done|freezer\.state=FROZEN|Freezing tasks")),
    ("first task", re.compile(r"Dumping task \(pid")),
    ("first pages", re.compile(r"Dumping pages \(type")),
    ("unfreezing", re.compile(r"Unfreezing tasks|Unlock network|Unseizing")),
    ("finished", re.compile(r"Dumping finished successfully|Dump finished")),
)


@dataclass
class Phases:
    path: Path
    total: float = 0.0
    lines: int = 0
    milestones: dict[str, float] = field(default_factory=dict)
    by_prefix: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    gaps: list[tuple[float, float, str, str]] = field(default_factory=list)  # (seconds, at, line, next line)


def parse(path: Path, keep_gaps: int = 8) -> Phases:
    """Read one dump.log; unstamped lines (the parasite's "pie:" ones) are skipped."""
    out = Phases(path)
    prev: tuple[float, str] | None = None
    gaps: list[tuple[float, float, str, str]] = []
    with open(path, errors="replace") as f:
        for raw in f:
            m = STAMP.match(raw.rstrip("\n"))
            if not m:
                continue
            t, text = float(m.group(1)), m.group(2)
            out.lines += 1
            for name, rx in MILESTONES:
                if name not in out.milestones and rx.search(text):
                    out.milestones[name] = t
            if prev is not None:
                dt = t - prev[0]
                pm = PREFIX.match(prev[1])
                out.by_prefix[pm.group(1) if pm else "-"] += dt
                if dt > 0:
                    gaps.append((dt, prev[0], prev[1], text))
                    if len(gaps) > 4 * keep_gaps:  # bounded memory on logs of millions of lines
                        gaps = sorted(gaps, reverse=True)[:keep_gaps]
            if text.startswith("page-xfer:"):
                out.milestones["last page written"] = t  # the last of them: the pages' end
            prev = (t, text)
            out.total = t
    out.gaps = sorted(gaps, reverse=True)[:keep_gaps]
    return out


def report(logs: list[Phases], top_prefixes: int = 10) -> list[str]:
    lines = ["| | " + " | ".join(p.path.name for p in logs) + " |", "|---|" + "---:|" * len(logs)]
    lines.append("| total s (lines) | " + " | ".join(f"{p.total:.3f} ({p.lines})" for p in logs) + " |")
    for name in [*(n for n, _ in MILESTONES[:-2]), "last page written", *(n for n, _ in MILESTONES[-2:])]:
        lines.append(f"| {name} at s | " + " | ".join(f"{p.milestones[name]:.3f}" if name in p.milestones else "-" for p in logs) + " |")
    spent: dict[str, float] = defaultdict(float)
    for p in logs:
        for k, v in p.by_prefix.items():
            spent[k] = max(spent[k], v)
    for k in sorted(spent, key=spent.get, reverse=True)[:top_prefixes]:  # type: ignore[arg-type]
        lines.append(f"| after '{k}' lines, s | " + " | ".join(f"{p.by_prefix.get(k, 0.0):.3f}" for p in logs) + " |")
    for p in logs:
        lines.append("")
        lines.append(f"longest silences in {p.path.name}:")
        for dt, at, text, nxt in p.gaps:
            lines.append(f"  {dt:.3f} s at {at:.3f}: {text[:110]}  ->  {nxt[:110]}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--gaps", type=int, default=8, help="longest silences to list per log")
    args = ap.parse_args()
    missing = [str(p) for p in args.logs if not p.is_file()]
    if missing:
        ap.error(f"no such log: {missing[0]}")
    print("\n".join(report([parse(p, args.gaps) for p in args.logs])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
