"""Per-container CRIU configuration files, named in the ``org.criu.config`` annotation.

runc hands CRIU the file named by the container's ``org.criu.config`` annotation at checkpoint
and at restore (otherwise /etc/criu/runc.conf), and CRIU lets it override what runc asked for
over RPC. The shim owns one file per container under ``<run_dir>/criu/``, written at every
create and every restore from two sources that never mix: the few options the container may
request (:data:`CONTAINER_OPTIONS`, each with a typed value) and what the host's admin configured
(:func:`host_options`). Nothing a checkpoint carries decides what root CRIU does on the host
that restores it (docs/security.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpusnap.config import check_admin_file
from gpusnap.errors import UsageError
from gpusnap.runc.argv import valid_container_id

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
_FALSE = {"", "0", "false", "no", "off"}

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


# A CRIU long option, optionally with one plain value ("opt value" or "opt=value"): no line
# breaks or other whitespace, so nothing can smuggle in a second option.
# Patterns are compiled on first use (re's own cache), not at import: every create imports this.
_OPTION_RE = r"[a-z][a-z0-9-]*([= ][\w.,:+/@=-]+)?"

# ---- what a container may ask root CRIU to do --------------------------------------------------
#
# CRIU runs as root for every checkpoint and restore, and whoever can set a container's
# annotations (on Kubernetes, possibly the pod's author) must gain nothing by it. So the options
# a container may request are an allow-list of behaviours that concern only the container itself,
# each with a typed value; anything else (plugins, scripts, paths, namespaces, security profiles,
# addresses, cgroups) comes only from the host: ``criu_options`` in the root-owned gpusnap config
# file, or the admin's own CRIU config for runc (see :func:`host_options`).

GHOST_LIMIT_MAX = 512 << 20  # ghost files are copied into the images: bound what one container adds
TIMEOUT_MAX_S = 600
_NETWORK_LOCK_METHODS = ("iptables", "nftables", "skip")
_SIZE_RE = r"([0-9]{1,12})([KkMmGg]?)"
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _flag(name: str, value: str | None) -> str:
    if value is not None:
        raise ValueError("takes no value")
    return name


def _ghost_limit(name: str, value: str | None) -> str:
    m = re.fullmatch(_SIZE_RE, value or "", re.ASCII)
    if m is None:
        raise ValueError("needs a size such as 1M")
    size = int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if size > GHOST_LIMIT_MAX:
        raise ValueError(f"at most {GHOST_LIMIT_MAX >> 20}M")
    return f"{name} {size}"


def _network_lock(name: str, value: str | None) -> str:
    if value not in _NETWORK_LOCK_METHODS:
        raise ValueError(f"one of {', '.join(_NETWORK_LOCK_METHODS)}")
    return f"{name} {value}"


def _timeout(name: str, value: str | None) -> str:
    if value is None or not value.isdigit() or not 1 <= int(value) <= TIMEOUT_MAX_S:
        raise ValueError(f"a whole number of seconds from 1 to {TIMEOUT_MAX_S}")
    return f"{name} {int(value)}"


# name -> checker(name, value) returning the config line, or raising ValueError(what is expected).
CONTAINER_OPTIONS = {
    "link-remap": _flag,
    "tcp-established": _flag,
    "tcp-close": _flag,
    "tcp-skip-in-flight": _flag,
    "skip-in-flight": _flag,
    "file-locks": _flag,
    "ghost-limit": _ghost_limit,
    "network-lock": _network_lock,
    "timeout": _timeout,
}

# Why a known option is refused to containers, for a message that says so. Anything not on the
# allow-list is refused whether or not it is named here.
_REFUSED_CLASSES = {
    "loads or runs code": ("libdir", "action-script", "exec-cmd", "lazy-pages"),
    "names a host path": ("images-dir", "work-dir", "prev-images-dir", "log-file", "output", "config", "pidfile", "root",
                          "ext-mount-map", "external", "inherit-fd", "status-fd", "tls-cacert", "tls-cacrl", "tls-cert",
                          "tls-key", "cgroup-props-file", "lsm-mount-context", "veth-pair", "cgroup-yard"),
    "joins a namespace": ("join-ns",),
    "reaches sockets outside the container": ("ext-unix-sk", "shell-job"),
    "changes a security profile": ("lsm-profile", "skip-file-rwx-check", "unprivileged"),
    "sends data over the network": ("page-server", "address", "port", "ps-socket", "tls", "tls-no-cn-verify"),
    "changes cgroups": ("cgroup-root", "manage-cgroups", "cgroup-props", "cgroup-dump-controller", "freeze-cgroup"),
}
_REFUSED = {opt: why for why, opts in _REFUSED_CLASSES.items() for opt in opts}

# Options runc sets itself over RPC for every checkpoint and restore: not even the host config
# may set them, or runc would look for images, logs and pids where they are not.
RUNC_OWNED_OPTIONS = frozenset({"images-dir", "work-dir", "log-file", "output", "config", "pidfile", "status-fd",
                                "pre-dump", "restore-detached", "root", "inherit-fd", "prev-images-dir"})


def criu_config_path(run_dir: Path, container_id: str) -> Path:
    if not valid_container_id(container_id):
        raise UsageError(f"container id {container_id[:80]!r} is not valid (letters, digits, '_', '+', '-', '.')")
    return run_dir / "criu" / f"{container_id}.conf"


def _partition(option: str) -> tuple[str, str | None]:
    m = re.search("[= ]", option)
    if m is None:
        return option, None
    return option[: m.start()], option[m.end():]


def container_option(option: str) -> str:
    """The CRIU config line for one option a container asked for, or UsageError (exit 2)."""
    raw = option.strip(" ").lstrip("-")
    if not re.fullmatch(_OPTION_RE, raw, re.ASCII):
        raise UsageError(
            f"annotation {EXTRA_OPTIONS_ANNOTATION}: CRIU option {raw[:80]!r} is malformed "
            "(one plain long option per comma, with at most one value); fix or remove it"
        )
    name, value = _partition(raw)
    check = CONTAINER_OPTIONS.get(name)
    if check is None:
        why = _REFUSED.get(name, "it is not on the list of options a container may request")
        raise UsageError(
            f"annotation {EXTRA_OPTIONS_ANNOTATION}: CRIU option {name!r} cannot come from a container ({why}); "
            f"containers may request {', '.join(sorted(CONTAINER_OPTIONS))}; a host admin can set others in criu_options of the gpusnap config file"
        )
    try:
        return check(name, value)
    except ValueError as exc:
        raise UsageError(f"annotation {EXTRA_OPTIONS_ANNOTATION}: CRIU option {raw[:80]!r}: value must be {exc}; fix or remove it") from None


def parse_bool_annotation(annotations: dict[str, str], key: str) -> bool:
    """A yes/no annotation: true/false, yes/no, on/off, 1/0 (or empty: no); anything else is refused."""
    value = str(annotations.get(key, "")).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise UsageError(f"annotation {key}: {value[:40]!r} is not a yes/no value; use true or false")


def options_from_annotations(annotations: dict[str, str]) -> list[str]:
    """CRIU options (config lines, without dashes) this container asks for through its
    annotations: the allow-listed ones only (:data:`CONTAINER_OPTIONS`), else UsageError."""
    options = list(BASE_OPTIONS)
    if parse_bool_annotation(annotations, TCP_ESTABLISHED_ANNOTATION):
        options.append("tcp-established")
    for extra in annotations.get(EXTRA_OPTIONS_ANNOTATION, "").split(","):
        if not extra.strip(" "):
            continue
        line = container_option(extra)
        if line not in options:
            options.append(line)
    return options


# ---- what the host adds --------------------------------------------------------------------------


def admin_option(option: str, where: str) -> str:
    """One CRIU option from the host's own configuration (trusted, but it must be one line and
    leave runc's own options alone)."""
    raw = option.strip().lstrip("-")
    if not re.fullmatch(_OPTION_RE, raw, re.ASCII):
        raise UsageError(f"{where}: CRIU option {raw[:80]!r} is not one long option with at most one plain value; fix it")
    name, _ = _partition(raw)
    if name in RUNC_OWNED_OPTIONS:
        raise UsageError(f"{where}: CRIU option {name!r} is set by runc for every checkpoint and restore; remove it")
    return raw.replace("=", " ", 1) if "=" in raw and " " not in raw else raw


def read_admin_criu_config(path: Path) -> list[str]:
    """The options of the admin's CRIU config for runc (``/etc/criu/runc.conf``): runc reads it
    for containers without ``org.criu.config``, which gpusnap sets, so gpusnap carries it over."""
    if not path.is_file():
        return []
    check_admin_file(path, "CRIU config")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(admin_option(line, f"{path}:{n}"))
    return out


CRIU_PLUGIN_DIRS = ("usr/lib/criu", "usr/local/lib/criu", "usr/lib64/criu")
AMD_PLUGIN = "amdgpu_plugin.so"


def find_criu_plugin_dir(host_root: Path, plugin: str = AMD_PLUGIN) -> str | None:
    """The host's own directory holding a CRIU plugin (a system path; never the container's choice)."""
    for rel in CRIU_PLUGIN_DIRS:
        d = host_root / rel
        if (d / plugin).is_file():
            return str(d)
    return None


def host_options(configured: tuple[str, ...] | list[str], host_root: Path, *, gpu_vendor: str = "") -> list[str]:
    """CRIU options the restoring or creating host adds for every container: the admin's runc
    CRIU config, ``criu_options`` from the gpusnap config file, and the amdgpu plugin's
    directory for AMD GPU containers. Re-derived on every create and every restore, so a
    checkpoint never carries them to another host."""
    options = read_admin_criu_config(host_root / "etc" / "criu" / "runc.conf")
    options += [admin_option(o, "criu_options in the gpusnap config file") for o in configured]
    if gpu_vendor == "amd":
        libdir = find_criu_plugin_dir(host_root)
        if libdir is not None:
            options.append(f"libdir {libdir}")
    return options


# ---- gpusnap.io/criu-env: the amdgpu plugin's switches ------------------------------------------

_KFD_NAME_RE = r"KFD_[A-Z0-9_]{1,64}"
_KFD_VALUE_RE = r"[0-9]{1,20}[KMGkmg]?"  # counts, 0/1 switches, sizes (1G)


def check_criu_env(env: dict[str, str], key: str) -> dict[str, str]:
    """What ``gpusnap.io/criu-env`` may add to runc's (and so root CRIU's) environment: the
    amdgpu plugin's KFD_* switches with numeric values; any other name (LD_PRELOAD, PATH) or
    value would let a container change how root programs run."""
    bad = sorted(k for k in env if not re.fullmatch(_KFD_NAME_RE, k, re.ASCII))
    if bad:
        raise UsageError(f"annotation {key} may set only KFD_* variables, not {', '.join(b[:40] for b in bad)}; remove them from it")
    bad = sorted(k for k, v in env.items() if not re.fullmatch(_KFD_VALUE_RE, str(v), re.ASCII))
    if bad:
        raise UsageError(f"annotation {key}: {', '.join(bad)} must be numbers (0 turns a check off; sizes may end in K, M or G); fix the value")
    return env


def render_config(options: list[str]) -> str:
    # CRIU's config syntax: one long option per line, without the leading dashes.
    return "# written by gpusnap-runtime\n" + "".join(f"{opt}\n" for opt in options)


def write_config(path: Path, options: list[str]) -> None:
    """Write the file atomically so a concurrent runc never reads half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(render_config(options))
    tmp.replace(path)


# ---- the gate: every gpusnap.io/ annotation that reaches CRIU -----------------------------------

CRIU_ENV_ANNOTATION = "gpusnap.io/criu-env"
AMD_RELAXED_ANNOTATION = "gpusnap.io/amd-relaxed-checks"


def check_annotations(annotations: dict[str, str]) -> None:
    """Refuse (UsageError, exit 2) any value a container may not give an annotation that reaches
    root CRIU or runc; docs/security.md lists every annotation, who sets it and what it reaches."""
    options_from_annotations(annotations)
    parse_bool_annotation(annotations, AMD_RELAXED_ANNOTATION)
    managed = annotations.get(MANAGED_ANNOTATION)
    if managed is not None and managed != "true":
        raise UsageError(f"annotation {MANAGED_ANNOTATION} is gpusnap's own marker and can only be \"true\"; remove it")
    raw = annotations.get(CRIU_ENV_ANNOTATION)
    if raw:
        import json

        try:
            env = json.loads(raw)
        except ValueError:
            raise UsageError(f"annotation {CRIU_ENV_ANNOTATION} is not a JSON object; remove or fix it") from None
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise UsageError(f"annotation {CRIU_ENV_ANNOTATION} must map names to strings")
        check_criu_env(env, CRIU_ENV_ANNOTATION)


def check_user_criu_config(path: str) -> None:
    """A container that names its own ``org.criu.config`` names a file from which root CRIU takes
    any option: only a file the admin wrote (root-owned, not writable by others) is accepted."""
    if not os.path.isabs(path):
        raise UsageError(f"annotation {CRIU_CONFIG_ANNOTATION} must be an absolute path, got {path[:80]!r}")
    check_admin_file(Path(path), f"annotation {CRIU_CONFIG_ANNOTATION}: CRIU config")
