"""Per-container CRIU configuration files, named in the ``org.criu.config`` annotation.

runc hands CRIU the file named by the container's ``org.criu.config`` annotation at checkpoint
and at restore (otherwise /etc/criu/runc.conf), and CRIU lets it override what runc asked for
over RPC. The shim owns one file per container under ``<run_dir>/criu/``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpusnap.errors import UsageError

CRIU_CONFIG_ANNOTATION = "org.criu.config"
# Set by the shim next to org.criu.config so a later pass (restore) knows the file is its own
# and may rewrite it; a user's own org.criu.config is left alone.
MANAGED_ANNOTATION = "gpusnap.io/criu-config"
TCP_ESTABLISHED_ANNOTATION = "gpusnap.io/tcp-established"
EXTRA_OPTIONS_ANNOTATION = "gpusnap.io/criu-options"  # comma-separated CRIU long options

# Always on: dumping a process whose binary is mapped from an overlay lower layer fails without
# it ("Can't create link remap ... Use link-remap option", see shared/ENVIRONMENT.md).
BASE_OPTIONS = ("link-remap",)

_TRUE = {"1", "true", "yes", "on"}

# A container whose network namespace holds only loopback has no connection a peer outside could
# see, so CRIU's network lock (iptables rules it installs in that namespace, through
# iptables-restore) protects nothing there; hosts without iptables (GPU images often lack it)
# fail the dump on it. "skip" turns the lock off for such containers.
NETWORK_LOCK_SKIP = "network-lock skip"
# CRIU 4.1.x dies of SIGSEGV when it reads any "network-lock" line from a config file in RPC
# mode (runc's swrk): seen with Debian's 4.1.1; 4.2.1 reads it and skips the lock.
NETWORK_LOCK_IN_CONFIG_SINCE = (4, 2)


def takes_network_lock_option(version: tuple[int, ...]) -> bool:
    """Whether this CRIU version can be given ``network-lock`` through runc's config file."""
    return version[:2] >= NETWORK_LOCK_IN_CONFIG_SINCE


def with_network_lock_skip(annotations: dict[str, str], skip: bool) -> None:
    """Add (``skip``) or take away ``network-lock skip`` in the extra-options annotation,
    keeping every other option the container asked for."""
    options = [o.strip() for o in annotations.get(EXTRA_OPTIONS_ANNOTATION, "").split(",")]
    options = [o for o in options if o and not o.lstrip("-").startswith("network-lock")]
    if skip:
        options.append(NETWORK_LOCK_SKIP)
    if options:
        annotations[EXTRA_OPTIONS_ANNOTATION] = ",".join(options)
    else:
        annotations.pop(EXTRA_OPTIONS_ANNOTATION, None)


def skips_network_lock(annotations: dict[str, str]) -> bool:
    return NETWORK_LOCK_SKIP in [o.strip().lstrip("-") for o in annotations.get(EXTRA_OPTIONS_ANNOTATION, "").split(",")]


# runc's own container id alphabet; checked here because the id becomes a file name.
_ID_RE = re.compile(r"[\w+\-.]{1,1024}", re.ASCII)
# A CRIU long option, optionally with one plain value ("opt value" or "opt=value"): no line
# breaks or other whitespace, so nothing can smuggle in a second option.
_OPTION_RE = re.compile(r"[a-z][a-z0-9-]*([= ][\w.,:+/-]+)?", re.ASCII)
# Options that make CRIU (running as root) execute something or write/read files we did not pick.
_FORBIDDEN_OPTIONS = {"action-script", "exec-cmd", "log-file", "output", "config", "images-dir",
                      "work-dir", "pidfile", "root", "inherit-fd", "status-fd", "pre-dump", "restore-detached"}


def criu_config_path(run_dir: Path, container_id: str) -> Path:
    if not _ID_RE.fullmatch(container_id) or container_id in (".", ".."):
        raise UsageError(f"container id {container_id[:80]!r} is not valid (letters, digits, '_', '+', '-', '.')")
    return run_dir / "criu" / f"{container_id}.conf"


def options_from_annotations(annotations: dict[str, str]) -> list[str]:
    """CRIU long options (without dashes) this container asks for through its annotations."""
    options = list(BASE_OPTIONS)
    if annotations.get(TCP_ESTABLISHED_ANNOTATION, "").strip().lower() in _TRUE:
        options.append("tcp-established")
    for extra in annotations.get(EXTRA_OPTIONS_ANNOTATION, "").split(","):
        extra = extra.strip(" ").lstrip("-")
        if extra and (not _OPTION_RE.fullmatch(extra) or re.split("[= ]", extra, maxsplit=1)[0] in _FORBIDDEN_OPTIONS):
            raise UsageError(
                f"annotation {EXTRA_OPTIONS_ANNOTATION}: CRIU option {extra[:80]!r} is not allowed "
                "(one plain long option per comma; no options that run programs or name files)"
            )
        if extra and extra not in options:
            options.append(extra)
    return options


def render_config(options: list[str]) -> str:
    # CRIU's config syntax: one long option per line, without the leading dashes.
    return "# written by gpusnap-runtime\n" + "".join(f"{opt}\n" for opt in options)


def write_config(path: Path, options: list[str]) -> None:
    """Write the file atomically so a concurrent runc never reads half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(render_config(options))
    tmp.replace(path)
