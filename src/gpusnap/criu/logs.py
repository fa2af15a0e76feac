"""What went wrong, from the log CRIU leaves in its work directory."""

from __future__ import annotations

from pathlib import Path

LOGS = ("dump.log", "restore.log")  # the names runc gives CRIU's logs in its --work-path
# CRIU's consequences of the first error ("exited, status", "Dumping FAILED") and, on hosts
# with a low hard nofile limit, a harmless rlimit line.
_NOISE = ("RLIMIT_NOFILE", "FAILED.", "exited, status=")


def first_error(work: Path, logs: tuple[str, ...] = LOGS) -> str | None:
    """CRIU's first error in ``work`` (its cause; what follows is its consequences), without
    CRIU's source location, or None where no log there names one."""
    for log in logs:
        p = work / log
        if not p.is_file():
            continue
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        errs = [ln for ln in text.splitlines() if "Error" in ln and not any(n in ln for n in _NOISE)]
        if errs:
            return errs[0].split("): ", 1)[-1].strip()
    return None
