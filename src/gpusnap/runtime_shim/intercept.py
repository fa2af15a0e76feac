"""The commands the shim acts on itself: create/run, checkpoint, restore, features.

Imported only for those commands, so the passthrough path never pays for jsonschema,
dataclasses or the GPU plan; create/run do not load the checkpoint flows either (about 20 ms
of imports: platform, socket, the GPU plan), since every container start pays for what
create imports.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gpusnap import __version__
from gpusnap.config import Settings, load_settings
from gpusnap.errors import ExitCode, GpusnapError
from gpusnap.ocispec.modifiers import ModifyContext, apply_chain, default_chain
from gpusnap.ocispec.spec import config_path, load_spec, save_spec, validate_spec
from gpusnap.runc.invoke import exec_runc, run_runc
from gpusnap.runc.argv import Invocation
from gpusnap.steps import Step, StepFailed, run_steps

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (create pays for imports)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any


def spec_steps(inv: Invocation, settings: Settings, cwd: Path) -> list[Step]:
    """Validate the bundle's config.json, run the modifier chain, validate the result.

    Returns the steps that apply it (host files, then config.json itself, each with its undo);
    nothing on disk changes until those steps run.
    """
    return spec_plan(inv, settings, cwd)[0]


def spec_plan(inv: Invocation, settings: Settings, cwd: Path) -> tuple[list[Step], dict[str, Any]]:
    """:func:`spec_steps` and the modified spec they write (a restore needs its device numbers)."""
    assert inv.command is not None and inv.container_id is not None
    bundle = (cwd / (inv.value("bundle") or ".")).absolute()
    path = config_path(bundle)
    original = path.read_bytes() if path.is_file() else None
    spec = load_spec(path)
    schema_cache = settings.run_dir / "schema"
    validate_spec(spec, path, cache_dir=schema_cache)
    ctx = ModifyContext(container_id=inv.container_id, bundle=bundle, command=inv.command, settings=settings)
    result = apply_chain(spec, default_chain(settings), ctx)
    try:
        validate_spec(result.spec, path, stage="gpusnap's spec modifiers", cache_dir=schema_cache)
    except GpusnapError as exc:
        raise GpusnapError(f"{exc} (a gpusnap bug: please report it)", exit_code=ExitCode.FAILURE) from None
    if result.spec == spec:
        return result.steps, result.spec

    def put_back() -> None:
        if original is not None:
            path.write_bytes(original)

    return [*result.steps, Step(f"write {path}", lambda: save_spec(path, result.spec), put_back)], result.spec


def create_or_run(inv: Invocation, runc: str, env: Mapping[str, str], settings: Settings) -> int:
    steps = spec_steps(inv, settings, Path.cwd())
    # exec either never returns or raises: as the last step, its failure undoes the edits.
    run_steps([*steps, Step("exec runc", lambda: exec_runc(runc, inv.argv))])
    return 0  # not reached: exec replaced this process


def features(inv: Invocation, runc: str, env: Mapping[str, str]) -> int:
    """runc's own answer when it has ``features``; otherwise a conservative one of our own."""
    proc = run_runc(runc, inv.argv, capture=True, env=env)
    if proc.returncode == 0:
        sys.stdout.write(proc.stdout)
        return 0
    # urfave/cli's answer for a command it does not have.
    lacks = "No help topic for 'features'" in proc.stderr or "unknown command" in proc.stderr
    if not lacks:
        sys.stderr.write(proc.stderr)
        return proc.returncode
    json.dump(fallback_features(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def fallback_features() -> dict[str, object]:
    """What any runc the shim supports (>= 1.0) implements, per the OCI features document."""
    return {
        "ociVersionMin": "1.0.0",
        "ociVersionMax": "1.0.2",
        "hooks": ["prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"],
        "mountOptions": ["bind", "rbind", "ro", "rw", "nosuid", "nodev", "noexec", "relatime", "private", "rprivate", "slave", "rslave", "shared", "rshared"],
        "linux": {
            "namespaces": ["cgroup", "ipc", "mount", "network", "pid", "user", "uts"],
            "cgroup": {"v1": True, "v2": True},
        },
        "annotations": {"io.gpusnap.runtime.version": __version__, "io.gpusnap.runtime.features": "fallback"},
    }


def dispatch(inv: Invocation, runc: str, env: Mapping[str, str]) -> int:
    """Run an intercepted command; returns the exit status (or does not return: exec)."""
    settings = load_settings(env)
    command = inv.command
    if command == "features":
        return features(inv, runc, env)
    cwd = Path.cwd()
    if command in ("create", "run", "restore") and not config_path(cwd / (inv.value("bundle") or ".")).is_file():
        exec_runc(runc, inv.argv)  # no bundle to modify: runc says what is missing, in its words
    if command in ("create", "run"):
        try:
            return create_or_run(inv, runc, env, settings)
        except StepFailed as exc:
            report(inv, str(exc))
            return int(exc.exit_code)
    from gpusnap.gpu.warm import start_driver_warmup

    start_driver_warmup(settings.gpu_backend)  # beside the imports and steps below (gpu/warm.py)
    from gpusnap.checkpoint.runtime_steps import RuncCall, checkpoint, failure_exit_code, restore

    call = RuncCall(runc=runc, inv=inv, env=env, cwd=cwd)
    try:
        if command == "checkpoint":
            return checkpoint(call, settings)
        if command == "restore":
            spec_start = time.perf_counter()
            steps, spec = spec_plan(inv, settings, call.cwd)
            return restore(call, settings, steps, spec=spec, planned_s=time.perf_counter() - spec_start)
    except StepFailed as exc:
        default = ExitCode.CHECKPOINT_FAILED if command == "checkpoint" else ExitCode.RESTORE_FAILED
        code = failure_exit_code(exc, default)
        if not (type(exc.cause).__name__ == "RuncFailed" and not exc.undone and not exc.undo_errors):
            report(inv, str(exc))
        return code
    raise AssertionError(f"not an intercepted command: {command}")


def report(inv: Invocation, message: str) -> None:
    """One line on stderr, and in runc's --log file in its format (engines read errors there)."""
    print(f"gpusnap-runtime: {message}", file=sys.stderr, flush=True)
    log = inv.global_opts.get("log")
    if not isinstance(log, str) or not log:
        return
    from datetime import datetime, timezone

    now = datetime.now(timezone.utc).isoformat()
    if inv.global_opts.get("log-format") == "json":
        line = json.dumps({"level": "error", "msg": f"gpusnap-runtime: {message}", "time": now})
    else:
        line = f'time="{now}" level=error msg={json.dumps("gpusnap-runtime: " + message)}'
    try:
        with open(log, "a") as fh:
            fh.write(line + "\n")
    except OSError:
        pass  # the message is on stderr already


