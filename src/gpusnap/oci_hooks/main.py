"""``gpusnap-hook STAGE``: the OCI hooks gpusnap puts into GPU containers, restore-aware.

The runtime writes the container's state JSON on standard input. What each stage does:

- ``prestart`` / ``createRuntime`` (runtime namespace): record which GPUs the container holds in
  ``<state_dir>/gpus/<id>.json``. During ``runc restore`` runc runs these at CRIU's
  setup-namespaces step, before the container's mount tree exists, so nothing here may need it;
  the record is refreshed with the restored PID.
- ``createContainer`` (container mount namespace, before pivot_root): make the injected driver
  libraries known to the container's linker cache when the image has a glibc linker
  (``etc/ld.so.conf``): an ``ld.so.conf.d`` entry for the stable library dir and
  ``ldconfig -r <rootfs>``. During a restore this is skipped: the restored rootfs already has it.
- ``startContainer`` / ``poststart``: mark the record running (startContainer runs inside the
  container, where the state dir is usually absent: then it does nothing).
- ``poststop``: remove the record.

A stage is part of a restore when ``<run_dir>/restoring/<container-id>`` exists (the shim creates
it around ``runc restore``). Exit codes are :class:`gpusnap.errors.ExitCode`; bad input is a
one-line message on stderr and exit 2.

Only the standard library is imported: runc waits on every hook of every GPU container.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.config import Settings, load_settings
from gpusnap.errors import ExitCode, GpusnapError, MissingDependencyError, UsageError
from gpusnap.runc.argv import valid_container_id

STAGES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")
STATUSES = ("creating", "created", "running", "stopped", "paused")
STABLE_LIB_DIR = "/usr/local/gpusnap/driver/lib"  # same value as gpusnap.ocispec.gpu_modifiers
LD_CONF_NAME = "000-gpusnap-driver.conf"
ANN_ASSIGNED = "gpusnap.io/assigned-gpus"
ANN_VENDOR = "gpusnap.io/gpu-vendor"


@dataclass
class State:
    oci_version: str
    id: str
    status: str
    bundle: Path
    pid: int = 0
    annotations: dict[str, str] = field(default_factory=dict)


def parse_state(text: str) -> State:
    """The runtime-spec state (rules of schema/oci-state.schema.json, checked by hand so the
    hook does not pay for importing jsonschema on every container start)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"stdin is not the OCI state JSON ({exc.msg} at char {exc.pos}); run gpusnap-hook only as an OCI hook") from None
    except RecursionError:
        raise UsageError("stdin is JSON nested too deeply to be an OCI state; run gpusnap-hook only as an OCI hook") from None
    if not isinstance(doc, dict):
        raise UsageError("stdin is not a JSON object; run gpusnap-hook only as an OCI hook")
    for key in ("ociVersion", "id", "status", "bundle"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise UsageError(f"OCI state on stdin lacks a non-empty string {key!r}; run gpusnap-hook only as an OCI hook")
    # The id names files under the state and run dirs: only runc's id alphabet, never a path.
    if not valid_container_id(doc["id"]):
        raise UsageError(f"OCI state id {doc['id'][:80]!r} is not a container id (letters, digits, '_', '+', '-', '.')")
    if doc["status"] not in STATUSES:
        raise UsageError(f"OCI state status {doc['status']!r} is not one of {', '.join(STATUSES)}")
    if not doc["bundle"].startswith("/"):
        raise UsageError(f"OCI state bundle {doc['bundle']!r} is not an absolute path")
    pid = doc.get("pid", 0)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
        raise UsageError(f"OCI state pid {pid!r} is not a non-negative integer")
    ann = doc.get("annotations") or {}
    if not isinstance(ann, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ann.items()):
        raise UsageError("OCI state annotations must map strings to strings")
    return State(doc["ociVersion"], doc["id"], doc["status"], Path(doc["bundle"]), pid, dict(ann))


def is_restoring(settings: Settings, container_id: str) -> bool:
    return (settings.run_dir / "restoring" / container_id).exists()


def record_path(settings: Settings, container_id: str) -> Path:
    return settings.state_dir / "gpus" / f"{container_id}.json"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)  # atomic: a reader never sees half a record


def record_assignment(settings: Settings, state: State, stage: str, restoring: bool) -> Path:
    path = record_path(settings, state.id)
    previous: dict[str, Any] = {}
    if path.is_file():
        try:
            previous = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            previous = {}  # a torn record from a crash is replaced, not trusted
    uuids = [u for u in state.annotations.get(ANN_ASSIGNED, "").split(",") if u]
    record = {
        "container_id": state.id,
        "bundle": str(state.bundle),
        "vendor": state.annotations.get(ANN_VENDOR, ""),
        "gpus": uuids,
        "pid": state.pid,
        "status": state.status,
        "stage": stage,
        "restores": int(previous.get("restores", 0)) + (1 if restoring else 0),
        "created": previous.get("created") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_json(path, record)
    return path


def _rootfs(bundle: Path) -> Path:
    try:
        config = json.loads((bundle / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {bundle / 'config.json'}: {exc}") from None
    root = Path(str((config.get("root") or {}).get("path", "rootfs")))
    return root if root.is_absolute() else bundle / root


def _write_ld_conf(rootfs: Path) -> bool:
    """Write etc/ld.so.conf.d/000-gpusnap-driver.conf inside the image without following its
    symlinks: this hook runs as root before pivot_root, where an absolute link in the image
    (etc -> /etc, or the file itself -> /etc/shadow) would name a file of the host. An image
    whose etc or ld.so.conf.d is a link gets no entry (LD_LIBRARY_PATH still finds the driver)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    fds: list[int] = []
    try:
        fds.append(os.open(rootfs / "etc", flags))
        try:
            os.mkdir("ld.so.conf.d", 0o755, dir_fd=fds[0])
        except FileExistsError:
            pass
        fds.append(os.open("ld.so.conf.d", flags, dir_fd=fds[0]))
        fd = os.open(LD_CONF_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=fds[1])
        with os.fdopen(fd, "w") as f:
            f.write(STABLE_LIB_DIR + "\n")
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return False
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return True


def refresh_ld_cache(rootfs: Path, ldconfig: str | None = None) -> bool:
    """Teach the container's linker cache the stable driver dir; False when the image has no
    glibc linker configuration (static or musl images need LD_LIBRARY_PATH only)."""
    if not (rootfs / "etc/ld.so.conf").is_file():
        return False
    if not (rootfs / STABLE_LIB_DIR.lstrip("/")).is_dir():
        return False
    if not _write_ld_conf(rootfs):
        return False
    import shutil
    import subprocess

    binary = ldconfig or shutil.which("ldconfig") or "/sbin/ldconfig"
    if not os.access(binary, os.X_OK):
        raise MissingDependencyError(f"ldconfig not found (looked for {binary}); install libc-bin on the host")
    # The host's ldconfig on the container's tree (-r): the image may have none of its own.
    done = subprocess.run([binary, "-r", str(rootfs)], capture_output=True, text=True, timeout=25)
    if done.returncode != 0:
        msg = " ".join((done.stderr or done.stdout).split())[:300]
        raise GpusnapError(f"ldconfig -r {rootfs} failed: {msg}")
    return True


def run_stage(stage: str, state: State, settings: Settings) -> str:
    """Do ``stage``'s work; returns a short description (for logs and tests)."""
    restoring = is_restoring(settings, state.id)
    if stage in ("prestart", "createRuntime"):
        path = record_assignment(settings, state, stage, restoring)
        return f"recorded {path}" + (" (restore)" if restoring else "")
    if stage == "createContainer":
        if restoring:
            return "restore: linker cache kept from the checkpointed rootfs"
        return "ld cache refreshed" if refresh_ld_cache(_rootfs(state.bundle)) else "ld cache: image has no glibc linker config of its own (none, or links out of the image)"
    if stage in ("startContainer", "poststart"):
        path = record_path(settings, state.id)
        if not path.is_file():
            return "no record (not visible from this namespace)"
        return f"recorded {record_assignment(settings, state, stage, False)}"
    if stage == "poststop":
        path = record_path(settings, state.id)
        try:
            path.unlink()
        except FileNotFoundError:
            return "nothing to clean"
        return f"removed {path}"
    raise UsageError(f"unknown stage {stage!r}; use one of {', '.join(STAGES)}")


def note_restore_time(settings: Settings, container_id: str, stage: str) -> None:
    """During a restore, add how long this hook ran (its interpreter's start included) to the
    shim's record of the restore: runc runs some hooks while CRIU waits for them."""
    if not is_restoring(settings, container_id):
        return
    from gpusnap.metadata import hook_notes_path
    from gpusnap.steps import process_age_s

    age = process_age_s()
    if age is None:
        return
    notes = hook_notes_path(settings.run_dir, container_id)
    try:
        notes.parent.mkdir(parents=True, exist_ok=True)
        # One short append per hook; O_APPEND keeps two hooks' lines whole.
        with open(notes, "a") as fh:
            fh.write(json.dumps({"stage": stage, "seconds": round(age, 4)}) + "\n")
    except OSError:
        pass  # timings only: never fail the hook for them


USAGE = f"usage: gpusnap-hook STAGE  (STAGE: {' | '.join(STAGES)}); the OCI state JSON comes on stdin"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # runc passes hook.args verbatim, whose first item is argv[0] by convention.
    if args and args[0] not in STAGES and os.path.basename(args[0]) == "gpusnap-hook":
        args = args[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return int(ExitCode.OK)
    if len(args) != 1:
        print(f"gpusnap-hook: expected one STAGE argument, got {len(args)}; {USAGE}", file=sys.stderr)
        return int(ExitCode.USAGE)
    stage = args[0]
    try:
        if stage not in STAGES:
            raise UsageError(f"unknown stage {stage!r}; use one of {', '.join(STAGES)}")
        state = parse_state(sys.stdin.read())
        settings = load_settings()
        message = run_stage(stage, state, settings)
        note_restore_time(settings, state.id, stage)
    except GpusnapError as exc:
        print(f"gpusnap-hook {stage}: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    except OSError as exc:
        print(f"gpusnap-hook {stage}: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return int(ExitCode.FAILURE)
    if os.environ.get("GPUSNAP_HOOK_VERBOSE"):
        print(f"gpusnap-hook {stage}: {message}", file=sys.stderr)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
