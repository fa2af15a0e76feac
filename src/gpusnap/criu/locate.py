"""Finding CRIU >= 4.0, reading its version and running ``criu check`` once per boot."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpusnap.config import Settings
from gpusnap.errors import MissingDependencyError

MIN_VERSION = (4, 0)
CRIU_INSTALL_HINT = "install CRIU 4.x (run tests/host/provision.sh, or set GPUSNAP_CRIU / `criu = ...` in /etc/gpusnap/config.toml)"

# `criu --version` prints "Version: 4.1.1" and, for git builds, "GitID: v4.1-12-g...".
_VERSION_RE = re.compile(r"^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)


@dataclass(frozen=True)
class CriuInfo:
    path: str
    version: tuple[int, int, int]

    @property
    def version_text(self) -> str:
        return ".".join(str(p) for p in self.version)


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``(4, 1, 1)`` from ``criu --version`` output, or None when it has no version line."""
    match = _VERSION_RE.search(text)
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def locate_criu(settings: Settings, env_path: str | None = None) -> str:
    """The CRIU binary: ``settings.criu`` (a path or a name on PATH), else ``criu`` on PATH."""
    env_path = os.environ.get("PATH", os.defpath) if env_path is None else env_path
    wanted = settings.criu or "criu"
    if os.sep in wanted:
        if os.path.isfile(wanted) and os.access(wanted, os.X_OK):
            return wanted
        raise MissingDependencyError(f"CRIU not found at {wanted}; {CRIU_INSTALL_HINT}")
    found = shutil.which(wanted, path=env_path)
    if found is None:
        raise MissingDependencyError(f"CRIU ({wanted}) not found on PATH; {CRIU_INSTALL_HINT}")
    return found


def criu_version(path: str) -> tuple[int, int, int]:
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        raise MissingDependencyError(f"CRIU at {path} cannot run ({exc.strerror}); {CRIU_INSTALL_HINT}") from None
    version = parse_version(proc.stdout + proc.stderr)
    if proc.returncode != 0 or version is None:
        last = (proc.stderr.strip().splitlines() or ["no version printed"])[-1]
        raise MissingDependencyError(f"CRIU at {path} did not report its version ({last}); {CRIU_INSTALL_HINT}")
    return version


def probe_criu(settings: Settings, env_path: str | None = None) -> tuple[str | None, str]:
    """The CRIU :func:`locate_criu` picks and its version ("4.1.1"), for reports that describe
    this host instead of refusing (doctor, host facts): ``(None, "")`` when there is no CRIU,
    ``(path, "")`` when it does not run or prints no version."""
    try:
        path = locate_criu(settings, env_path)
    except MissingDependencyError:
        return None, ""
    try:
        return path, ".".join(str(p) for p in cached_criu_version(settings, path))
    except MissingDependencyError:
        return path, ""


def _boot_id(settings: Settings) -> str:
    try:
        return (settings.host.proc / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


def _cache_file(settings: Settings, path: str, kind: str, suffix: str) -> Path:
    """Where a fact about the CRIU binary at ``path`` is kept until the boot ends or the binary
    changes (its real path, size and modification times are in the name)."""
    st = os.stat(path)
    real = os.path.realpath(path)
    real_st = os.stat(real)
    key = f"{_boot_id(settings)}|{real}|{real_st.st_mtime_ns}|{real_st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return settings.run_dir / "criu" / f"{kind}-{digest}.{suffix}"


def cached_criu_version(settings: Settings, path: str) -> tuple[int, int, int]:
    """:func:`criu_version`, kept under run_dir like ``criu check``'s result: every checkpoint
    and restore asks twice (the CLI and the runtime), and running ``criu --version`` took
    0.09-0.10 s of the runtime's start on the H100 hosts (the driver's load runs beside it)."""
    cache: Path | None
    try:
        cache = _cache_file(settings, path, "version", "txt")
    except OSError:
        cache = None  # criu_version says what is wrong with the binary
    if cache is not None:
        try:
            version = parse_version(cache.read_text())
        except OSError:
            version = None
        if version is not None:
            return version
    version = criu_version(path)
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
            tmp.write_text("Version: " + ".".join(str(p) for p in version) + "\n")
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only run dir: asked again next time
    return version


def criu_check(settings: Settings, path: str) -> None:
    """Run ``criu check`` unless it already passed for this binary since boot.

    The result is cached under run_dir (a tmpfs in production, so the cache dies with the boot):
    ``criu check`` takes about a second, too long to pay on every checkpoint.
    """
    cache = _cache_file(settings, path, "check", "ok")
    if cache.exists():
        return
    try:
        proc = subprocess.run([path, "check"], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MissingDependencyError(f"`{path} check` could not run ({exc}); {CRIU_INSTALL_HINT}") from None
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip() and "RLIMIT_NOFILE" not in ln]
        last = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        raise MissingDependencyError(
            f"`{path} check` failed on this kernel ({last}); {CRIU_INSTALL_HINT} built for this kernel"
        )
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(proc.stdout)


def find_criu(settings: Settings, env_path: str | None = None, *, check: bool = True) -> CriuInfo:
    """CRIU >= 4.0, checked against this kernel; raises MissingDependencyError naming the fix."""
    path = locate_criu(settings, env_path)
    version = cached_criu_version(settings, path)
    if version[:2] < MIN_VERSION:
        have = ".".join(str(p) for p in version)
        raise MissingDependencyError(f"CRIU at {path} is {have}, gpusnap needs 4.0 or newer; {CRIU_INSTALL_HINT}")
    if check:
        criu_check(settings, path)
    return CriuInfo(path=os.path.abspath(path), version=version)
