"""Locating and running the real runc.

Only the standard library, and only cheap modules at import time: the runtime shim imports this
on every passthrough call, where each millisecond is added to every container operation.
``subprocess`` and ``gpusnap.errors`` are imported inside the functions that need them.
"""

from __future__ import annotations

import os
import sys
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

RUNC_INSTALL_HINT = "install runc (Debian: apt-get install runc, or run tests/host/provision.sh) or set GPUSNAP_RUNC / `runc = ...` in /etc/gpusnap/config.toml"


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def self_paths(argv0: str, env_path: str) -> list[str]:
    """Paths that are this shim: argv[0] as given and as found on PATH (it may be a bare name)."""
    paths = [os.path.realpath(argv0)] if os.sep in argv0 else []
    if os.sep not in argv0:
        found = which(argv0, env_path)
        if found:
            paths.append(os.path.realpath(found))
    return paths


def which(name: str, env_path: str, skip: Sequence[str] = ()) -> str | None:
    """The first executable ``name`` on ``env_path`` whose real path is not in ``skip``.

    shutil.which would do the lookup but costs ~5 ms of imports (fnmatch, re) and cannot skip
    entries, which is what finding "the runc that is not us" needs.
    """
    for directory in env_path.split(os.pathsep):
        if not directory:
            continue
        candidate = os.path.join(directory, name)
        if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
            continue
        real = os.path.realpath(candidate)
        if any(real == s or _same_file(real, s) for s in skip):
            continue
        return candidate
    return None


def find_runc(configured: str | None, env: Mapping[str, str], argv0: str, also: Sequence[str] = ()) -> str:
    """The real runc: the configured path, else the first ``runc`` on PATH that is not this shim.

    ``also``: other names this shim goes by (the sh front, bin/gpusnap-runtime, that started it);
    bin/gpusnap-runtime makes the same decision for passthrough calls and must stay in step.
    """
    env_path = env.get("PATH", os.defpath)
    skip = [p for name in (argv0, *also) for p in self_paths(name, env_path)]
    if configured:
        path = configured if os.sep in configured else which(configured, env_path, skip)
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            if any(os.path.realpath(path) == s for s in skip):
                _missing(f"the configured runc {configured} is gpusnap-runtime itself; point GPUSNAP_RUNC at the real runc")
            return path
        _missing(f"runc not found at {configured} (from GPUSNAP_RUNC or the config file); {RUNC_INSTALL_HINT}")
    path = which("runc", env_path, skip)
    if path is None:
        _missing(f"runc not found on PATH ({env_path}); {RUNC_INSTALL_HINT}")
    return path  # type: ignore[return-value]


def _missing(message: str) -> None:
    from gpusnap.errors import MissingDependencyError

    raise MissingDependencyError(message)


def restore_default_signals() -> None:
    """Give SIGPIPE and SIGXFSZ back their default action before exec.

    Python ignores both at start-up and ignored signals survive exec, so without this runc would
    run with a signal disposition it never has when started directly (subprocess does the same
    reset through ``restore_signals``).
    """
    # _signal is the builtin that `signal` wraps; it is loaded at interpreter start, while
    # `signal` itself pulls in enum (about 4 ms measured with -X importtime) on every call.
    import _signal

    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(_signal, name):
            _signal.signal(getattr(_signal, name), _signal.SIG_DFL)


def exec_runc(runc: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Replace this process with runc: same stdio, inherited fds, signals and exit status."""
    restore_default_signals()
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [runc, *args]
    if env is None:
        os.execv(runc, argv)
    else:
        os.execve(runc, argv, dict(env))


def run_runc(runc: str, args: Sequence[str], *, env: Mapping[str, str] | None = None, capture: bool = False, stdin_devnull: bool = False) -> "subprocess.CompletedProcess[str]":  # noqa: F821
    """Run runc as a child and wait.

    Without ``capture``, stdio and every inherited fd are handed over (``close_fds=False``):
    engines pass console sockets, pipes for the container's stdio and ``--preserve-fds`` fds,
    and runc (through CRIU's inherit-fd) restores the container onto exactly those.
    """
    import subprocess

    kwargs: dict[str, object] = {"env": None if env is None else dict(env)}
    if capture:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    else:
        kwargs.update(close_fds=False)
        if stdin_devnull:
            kwargs["stdin"] = subprocess.DEVNULL
    return subprocess.run([runc, *args], check=False, **kwargs)  # type: ignore[call-overload]


def runc_version(runc: str) -> str:
    """runc's version number (``1.1.5+ds1``), or "" when it does not say."""
    proc = run_runc(runc, ["--version"], capture=True)
    for line in proc.stdout.splitlines():
        if line.startswith("runc version "):
            return line.split()[2]
    return ""
