"""gpusnap-runtime-py: runc's command line; runc itself for everything it does not intercept.

Engines call bin/gpusnap-runtime, a sh front that execs runc itself for passthrough calls and
this shim for the rest (see that script); called directly, this shim does both.

The passthrough path (every command but create, run, checkpoint, restore, features and
--version) imports only cheap standard-library modules and ends in ``os.execv`` of the real
runc, so the engine sees runc's own stdio, fds, signals and exit status.
"""

from __future__ import annotations

import os
import sys

from gpusnap.runc.invoke import exec_runc, find_runc
from gpusnap.runc.argv import INTERCEPTED, Invocation, parse, valid_container_id
from gpusnap.runtime_shim.fastconfig import fast_settings

PROG = "gpusnap-runtime"


def _intercepts(inv: Invocation) -> bool:
    if inv.command not in INTERCEPTED or not inv.known or inv.global_opts.get("help"):
        return False
    if inv.command == "features":
        return True
    return valid_container_id(inv.container_id) and not inv.flag("help")


def _forget_criu_config(inv: Invocation, run_dir: str) -> None:
    """On ``delete``, drop the container's CRIU config file (a restore writes it again)."""
    ids = [a for a in inv.positionals if not a.startswith("-")]
    if len(ids) == 1 and valid_container_id(ids[0]):
        try:
            os.unlink(os.path.join(run_dir, "criu", ids[0] + ".conf"))
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    env = os.environ
    # Set by bin/gpusnap-runtime, the sh front that execs this shim: it is "us" too when looking
    # for the real runc. Dropped here so runc and the container never see it.
    front = env.pop("GPUSNAP_FRONT", None)
    inv = parse(args)
    try:
        cfg = fast_settings(env)
        runc = find_runc(cfg["runc"], env, sys.argv[0], (front,) if front else ())
        if inv.command is None and inv.global_opts.get("version") and not inv.global_opts.get("help"):
            from gpusnap import __version__

            sys.stdout.write(f"{PROG} version {__version__}\n")
        elif inv.command == "delete":
            _forget_criu_config(inv, str(cfg["run_dir"]))
        elif _intercepts(inv):
            from gpusnap.runtime_shim.lazy import defer_unused_on_create

            defer_unused_on_create()
            from gpusnap.runtime_shim.intercept import dispatch

            return dispatch(inv, runc, env)
        exec_runc(runc, args)
    except Exception as exc:  # noqa: BLE001 - one line and an exit code, never a traceback
        return _fail(inv, exc)
    return 0  # not reached: exec replaced this process


def _fail(inv: Invocation, exc: Exception) -> int:
    from gpusnap.errors import ExitCode, GpusnapError

    if os.environ.get("GPUSNAP_DEBUG"):
        import traceback

        traceback.print_exc()
    if isinstance(exc, GpusnapError):
        message, code = str(exc), int(exc.exit_code)
    elif isinstance(exc, OSError):
        message, code = f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}; set GPUSNAP_DEBUG=1 for details", int(ExitCode.FAILURE)
    else:
        message, code = f"internal error: {type(exc).__name__}: {exc}; set GPUSNAP_DEBUG=1 and report it", int(ExitCode.FAILURE)
    try:
        from gpusnap.runtime_shim.intercept import report

        report(inv, message)
    except Exception:  # noqa: BLE001 - reporting must not hide the error itself
        print(f"{PROG}: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
