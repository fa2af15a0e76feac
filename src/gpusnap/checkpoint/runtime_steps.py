"""The runtime's checkpoint and restore: runc's own operation with the GPU plan's steps around it.

checkpoint = run_steps([*plan.before_dump, runc checkpoint, *plan.after_dump])
restore    = run_steps([*spec modifiers, read the restored spec, restore marker,
                        *plan.before_restore, GPU nodes of the /dev image, runc restore,
                        *plan.after_restore])
A failing step undoes the ones before it, newest first (gpusnap.steps), so a failed checkpoint
leaves the container running and a failed restore leaves nothing half-restored.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpusnap import __version__
from gpusnap.checkpoint.container import container_ref, env_with_path, fill_ref, runc_freezer, runc_state, state_globals
from gpusnap.config import Settings
from gpusnap.criu.config import TCP_ESTABLISHED_ANNOTATION
from gpusnap.criu.locate import CriuInfo, find_criu
from gpusnap.criu.logs import first_error
from gpusnap.errors import ExitCode, GpusnapError, RestoreError
from gpusnap.gpu.base import ContainerRef, GpuPlan
from gpusnap.gpu.devnodes import retarget_step
from gpusnap.gpu.plan import make_gpu_plan
from gpusnap.metadata import GATE_ENV, RESTORE_TIMINGS_FILE, CheckpointMetadata, hook_notes_path, merge_restore_timings
from gpusnap.runc.invoke import run_runc, runc_version
from gpusnap.runc.argv import Invocation, with_global_flag
from gpusnap.steps import STARTUP, Step, StepFailed, StepRecord, process_age_s, run_steps, signals_as_exceptions

# How often a foreground restore polls `runc state` while waiting for the container to run.
_POLL_S = 0.05
# Signals a foreground restore hands on to runc, which hands them on to the container (as runc
# itself does in the foreground): the shim stands where runc would stand.
_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH", "SIGCONT")


class RuncFailed(GpusnapError):
    """runc itself failed; its stderr already reached the caller and its exit status is kept.
    ``work``: CRIU's work directory, whose log names the cause when CRIU failed."""

    def __init__(self, what: str, returncode: int, work: Path | None = None) -> None:
        cause = first_error(work) if work is not None else None
        super().__init__(f"{what} exited with status {returncode}" + (f" (CRIU: {cause})" if cause else ""))
        self.exit_code = returncode  # type: ignore[assignment]  # runc's own status, not ours


@dataclass
class RuncCall:
    """One intercepted runc command line and how to run runc for it."""

    runc: str
    inv: Invocation
    env: Mapping[str, str]
    cwd: Path = field(default_factory=Path.cwd)

    @property
    def container_id(self) -> str:
        assert self.inv.container_id is not None
        return self.inv.container_id

    def image_dir(self) -> Path:
        # runc's own default when --image-path is not given.
        return (self.cwd / (self.inv.value("image-path") or "checkpoint")).absolute()

    def work_dir(self) -> Path:
        """Where runc has CRIU write its logs: --work-path, else the image directory."""
        work = self.inv.value("work-path")
        return (self.cwd / work).absolute() if work else self.image_dir()

    def criu_args_env(self, criu: CriuInfo) -> tuple[list[str], dict[str, str]]:
        """The caller's argv with ``--criu`` added (unless given) and CRIU's dir first on PATH."""
        args = with_global_flag(self.inv.argv, self.inv, "criu", criu.path)
        return args, env_with_path(self.env, [os.path.dirname(criu.path)])


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def new_metadata(call: RuncCall, settings: Settings, criu: CriuInfo, ref: ContainerRef) -> CheckpointMetadata:
    uname = platform.uname()
    return CheckpointMetadata(
        container_id=call.container_id,
        created=_now(),
        runtime_version=__version__,
        runc_version=runc_version(call.runc),
        criu_version=criu.version_text,
        kernel=uname.release,
        arch=uname.machine,
        hostname=socket.gethostname(),
        leave_running=call.inv.flag("leave-running") or call.inv.flag("pre-dump"),
        tcp_established=call.inv.flag("tcp-established")
        or ref.annotations.get(TCP_ESTABLISHED_ANNOTATION, "").lower() in ("1", "true", "yes", "on"),
    )


def checkpoint(call: RuncCall, settings: Settings, plan: GpuPlan | None = None) -> int:
    """``runc checkpoint`` with the GPU plan around it; returns the exit status for the caller.
    What came before the steps is timed too (``before: …`` in the metadata's timings): with the
    interpreter's start, it is what a checkpoint costs beyond the steps a user would take by hand."""
    before = BeforeSteps()
    state = before.time("runc state", lambda: runc_state(call.runc, call.inv.global_opts, call.container_id, call.env))
    if state is None:
        return _runc_reports(call)
    criu = before.time("find CRIU", lambda: find_criu(settings))
    plan = before.time("GPU backend", lambda: make_gpu_plan(settings)) if plan is None else plan
    ref = container_ref(state, settings.host)
    image_dir = call.image_dir()
    meta = before.time("metadata", lambda: new_metadata(call, settings, criu, ref))
    args, env = call.criu_args_env(criu)
    env = {**env, **criu_env(ref.annotations)}

    def dump() -> None:
        rc = run_runc(call.runc, args, env=env).returncode
        if rc != 0:
            work = call.work_dir()
            failure = plan.dump_failure(ref, first_error(work))
            if failure is not None:
                raise failure
            raise RuncFailed("runc checkpoint", rc, work)

    from gpusnap.checkpoint.recovery import heal, is_suspended, operation_lock

    freezer = runc_freezer(call.runc, call.inv.global_opts, call.container_id, call.env) if state.status == "paused" else None
    with operation_lock(settings, call.container_id):
        healing = time.perf_counter()
        backend = getattr(plan, "backend", None)
        if backend is not None and not is_suspended(settings, call.container_id):
            # A run killed with SIGKILL cannot roll back; its GPU leftovers are healed here. Even
            # asking the driver for a process's state needs that process thawed (see thawed_for_gpu).
            if freezer is not None:
                freezer[1]()
            try:
                healed = heal(backend, settings.host, ref.init_pid, ref.cgroup_procs or None)
            except BaseException:
                if freezer is not None:
                    freezer[0]()
                raise
            if healed:
                meta.extra["healed_before_checkpoint"] = healed
        before.took("lock, look for leftovers of a killed run", time.perf_counter() - healing)
        meta.timings_s.update(before.timings())
        return _checkpoint_steps(plan, ref, image_dir, meta, dump, freezer)


class BeforeSteps:
    """Times what a runtime call does before its steps, the interpreter's start and imports
    first (process_age_s at the first call: nothing the process starts itself can see them)."""

    def __init__(self) -> None:
        self._age = process_age_s()
        self._spent: dict[str, float] = {}

    def time(self, what: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            self.took(what, time.perf_counter() - started)

    def took(self, what: str, seconds: float) -> None:
        self._spent[what] = round(seconds, 4)

    def timings(self) -> dict[str, float]:
        out = {f"before: {STARTUP}": round(self._age, 4)} if self._age is not None else {}
        return {**out, **{f"before: {k}": v for k, v in self._spent.items()}}


def _checkpoint_steps(plan: GpuPlan, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata, dump: Callable[[], None],
                      freezer: tuple[Callable[[], None], Callable[[], None]] | None = None) -> int:
    # No undo for the dump itself: with --leave-running the container still runs, without it
    # the dump is what the caller asked for; the GPU steps before it carry their own undo.
    before = plan.before_dump(ref, image_dir, meta)
    after = plan.after_dump(ref, image_dir, meta, meta.leave_running)
    steps = [*before, Step("runc checkpoint", dump), *after]
    if freezer is not None:
        steps = thawed_for_gpu(before, dump, after, meta.leave_running, *freezer)
    with signals_as_exceptions():  # a signal mid-checkpoint rolls the GPU steps back too
        records = run_steps(steps)
    # Keep the GPU plan's breakdown (gpu_lock, gpu_checkpoint, criu_dump, total) beside the steps.
    meta.timings_s.update({r.name: round(r.seconds, 6) for r in records})
    image_dir.mkdir(parents=True, exist_ok=True)  # runc made it; a --page-server dump may not
    meta.write(image_dir)
    return 0


def thawed_for_gpu(before: list[Step], dump: Callable[[], None], after: list[Step], leave_running: bool,
                   pause: Callable[[], None], resume: Callable[[], None]) -> list[Step]:
    """The checkpoint of a container its engine paused first, as containerd does for every
    checkpoint (docker's and the kubelet's): the CUDA driver's checkpoint calls are answered by
    the process itself, and a frozen process never answers, so each call would wait for ever.
    The container is thawed for the GPU steps only and frozen again for CRIU, and left paused
    as the engine had it; each thaw and freeze has its undo, so a failure anywhere puts the
    container back as it was (paused, its GPU state back on the GPU)."""
    if not before and not after:
        return [Step("runc checkpoint", dump)]
    steps = [Step("thaw the paused container for the GPU", resume, pause), *before,
             Step("freeze the container again for CRIU", pause, resume), Step("runc checkpoint", dump)]
    if leave_running and after:
        steps += [Step("thaw the container for the GPU restore", resume, pause), *after,
                  Step("freeze the container again, as its engine left it", pause)]
    else:
        steps += after
    return steps


def _runc_reports(call: RuncCall) -> int:
    """Let runc run the line unchanged so its own error (and exit status) reaches the caller."""
    return run_runc(call.runc, call.inv.argv, env=call.env).returncode


@dataclass
class RestoreParts:
    """The pieces of a restore the shim runs around runc (built by the shim, testable alone)."""

    spec_steps: list[Step]
    marker: Path


def restore_marker(settings: Settings, container_id: str) -> Path:
    return settings.run_dir / "restoring" / container_id


def marker_step(marker: Path) -> Step:
    def create() -> None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        hook_timings_path(marker).unlink(missing_ok=True)  # a killed restore's
        marker.write_text(f"{os.getpid()}\n")

    return Step("restore marker", create, lambda: marker.unlink(missing_ok=True))


def criu_env(annotations: Mapping[str, str]) -> dict[str, str]:
    """What the container's ``gpusnap.io/criu-env`` annotation adds to the environment runc
    (and so CRIU, whose amdgpu plugin reads KFD_*) runs with. Only KFD_* names with numeric
    values (gpusnap.criu.config.check_criu_env): any other would let a container's annotations
    change how runc, as root, runs (LD_PRELOAD, PATH). Checked at create already; again here
    for containers created before that check or without the shim."""
    from gpusnap.ocispec.gpu_modifiers import ANN_CRIU_ENV, criu_settings_from_annotations

    if not annotations.get(ANN_CRIU_ENV):
        return {}
    _, env = criu_settings_from_annotations(annotations)
    return env


def restore(
    call: RuncCall, settings: Settings, spec_steps: list[Step], plan: GpuPlan | None = None, *, spec: dict[str, object] | None = None,
    planned_s: float | None = None,
) -> int:
    """``runc restore`` (detached or foreground) with the GPU plan around it.

    ``spec`` is the bundle's config.json as the spec modifiers left it: its GPU device numbers
    are written into CRIU's /dev image (gpusnap.gpu.devnodes) and its ``gpusnap.io/criu-env``
    joins runc's environment. ``planned_s``: how long the caller took to plan ``spec_steps``,
    reported with the steps' own times in the image directory's restore timings."""
    age_at_entry = process_age_s()
    criu = find_criu(settings)
    plan = make_gpu_plan(settings) if plan is None else plan
    image_dir = call.image_dir()
    try:
        (image_dir / RESTORE_TIMINGS_FILE).unlink(missing_ok=True)  # an earlier restore's: this one writes its own
    except OSError:
        pass  # a read-only image directory keeps it; nothing is written there either
    try:
        meta = CheckpointMetadata.read(image_dir)
    except (ValueError, TypeError) as exc:
        raise RestoreError(f"{image_dir}/gpusnap.json is unreadable ({exc}); re-create the checkpoint") from None
    if meta is not None and meta.arch and meta.arch != platform.machine():
        # Engines that pick the image themselves (containerd restoring a Kubernetes checkpoint
        # image) check no architecture: refused here, before runc or CRIU sees a foreign image.
        from gpusnap.errors import IncompatibleHostError

        raise IncompatibleHostError(f"the checkpoint was taken on {meta.arch} and this host is {platform.machine()}; restore it on a {meta.arch} host")
    bundle = (call.cwd / (call.inv.value("bundle") or ".")).absolute()
    ref = ContainerRef(container_id=call.container_id, init_pid=0, bundle=bundle)
    args, env = call.criu_args_env(criu)
    annotations = (spec or {}).get("annotations")
    gate = env.get(GATE_ENV)
    env = {**{k: v for k, v in env.items() if k != GATE_ENV}, **criu_env(annotations if isinstance(annotations, dict) else {})}
    marker = restore_marker(settings, call.container_id)
    restored_spec: dict[str, Any] = {}

    def read_spec() -> None:
        # What the spec modifiers made of config.json for this host: the GPUs the restored
        # container is given (the GPU plan pairs the checkpoint's GPUs with them) and its device
        # nodes (written into CRIU's /dev image, which CRIU unpacks instead of runc's own /dev).
        try:
            restored_spec.update(json.loads((bundle / "config.json").read_text()))
        except (OSError, ValueError):
            return  # runc restore reports a missing or broken bundle in its own words
        ref.annotations = {str(k): str(v) for k, v in (restored_spec.get("annotations") or {}).items()}

    detached = call.inv.flag("detach")
    from gpusnap.checkpoint.recovery import operation_lock

    runner = _Foreground(call, args, env) if not detached else None
    # Held until the container runs, not for a foreground container's whole life.
    with operation_lock(settings, call.container_id, error=RestoreError):
        records, hooks, held = _restore_locked(call, settings, spec_steps, plan, image_dir, meta, ref, args, env, marker, runner, read_spec,
                                               restored_spec, gate, criu)
    record_restore_timings(image_dir, records, hooks, age_at_entry, planned_s, held)
    return 0 if runner is None else runner.wait()


def record_restore_timings(image_dir: Path, records: list[StepRecord], hooks: dict[str, float], age_at_entry: float | None,
                           planned_s: float | None, pages_hold: dict[str, float] | None = None) -> None:
    """The runtime's side of a restore, beside the GPU plan's timings in the image directory:
    each step, the hooks runc ran meanwhile, and what came before the steps (the interpreter's
    start and imports, planning the spec), so that the caller can tell where the time went."""
    steps: dict[str, float] = {}
    for r in records:
        steps[r.name] = round(steps.get(r.name, 0.0) + r.seconds, 4)
    extra: dict[str, Any] = {"steps_s": steps, "hooks_s": hooks}
    if pages_hold:
        extra["pages_hold_s"] = dict(pages_hold)
    if age_at_entry is not None:
        extra["before_steps_s"] = {STARTUP: round(age_at_entry - (planned_s or 0.0), 4),
                                   **({"plan the spec": round(planned_s, 4)} if planned_s is not None else {})}
    age = process_age_s()
    if age is not None:
        extra["total_s"] = round(age, 4)
    merge_restore_timings(image_dir, extra)


GATE_STEP = "wait for the root filesystem and images"
HOLD_STEP = "hold CRIU before the memory pages"
RELEASE_STEP = "take the hold out of CRIU's config"


def gate_steps(fd_text: str, settings: Settings, criu: CriuInfo, ref: ContainerRef,
               timings: dict[str, float]) -> tuple[list[Step], list[Step]]:
    """The steps before and after ``runc restore`` for a gated restore (gpusnap.checkpoint.pages_hold).

    Before: wait for the first word; when the pages are still coming, hold CRIU before it reads
    them (or, where it cannot be held, wait for them here). After: take the hold away again.
    ``ref.annotations`` are read when the hold step runs: the restored spec is read by then."""
    from gpusnap.checkpoint.pages_hold import Gate, PagesHold, criu_can_hold, hold_dir
    from gpusnap.criu.config import CRIU_CONFIG_ANNOTATION, MANAGED_ANNOTATION, criu_config_path

    gate = Gate(fd_text, GATE_ENV)
    holds: list[PagesHold] = []

    def hold() -> None:
        if not gate.pages_pending:
            return
        config = criu_config_path(settings.run_dir, ref.container_id)
        annotations = ref.annotations
        ours = annotations.get(MANAGED_ANNOTATION) == "true" and annotations.get(CRIU_CONFIG_ANNOTATION) == str(config)
        if ours and config.is_file() and criu_can_hold(criu.version):
            holds.append(PagesHold(gate, config, hold_dir(settings.run_dir), ref.container_id, timings=timings))
            holds[0].install()
            return
        started = time.perf_counter()
        whole = gate.wait_pages()
        timings["pages whole, waited for before runc"] = round(time.perf_counter() - started, 4)
        if not whole:
            raise RestoreError("the caller stopped the restore before runc ran: the checkpoint's memory pages could not be made ready")

    def release() -> None:
        for h in holds:
            h.release()

    # No undo for the gate: a hold's relay may still be reading it; the process's exit closes it.
    before = [Step(GATE_STEP, gate.wait_first), Step(HOLD_STEP, hold, release)]
    return before, [Step(RELEASE_STEP, release)]


def hook_timings_path(marker: Path) -> Path:
    """Where gpusnap-hook, run by runc during the restore of ``marker``, notes how long it ran."""
    return hook_notes_path(marker.parent.parent, marker.name)


def _read_hook_timings(path: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            doc = json.loads(line)
            out[str(doc["stage"])] = round(out.get(str(doc["stage"]), 0.0) + float(doc["seconds"]), 4)
        except (ValueError, KeyError, TypeError):
            continue  # a hook killed mid-line: its time is simply unknown
    return out


def _restore_locked(call: RuncCall, settings: Settings, spec_steps: list[Step], plan: GpuPlan, image_dir: Path, meta: CheckpointMetadata | None,
                    ref: ContainerRef, args: list[str], env: dict[str, str], marker: Path, runner: "_Foreground | None",
                    read_spec: Callable[[], None], restored_spec: dict[str, Any], gate: str | None,
                    criu: CriuInfo) -> tuple[list[StepRecord], dict[str, float], dict[str, float]]:

    def do_restore() -> None:
        if runner is None:
            rc = run_runc(call.runc, args, env=env).returncode
            if rc != 0:
                raise RuncFailed("runc restore", rc, call.work_dir())
        else:
            runner.start_and_wait_running()
        state = runc_state(call.runc, call.inv.global_opts, call.container_id, call.env)
        if state is not None:
            fill_ref(ref, state, settings.host)

    def undo_restore() -> None:
        # Whatever runc restored must not outlive a failed restore.
        run_runc(call.runc, [*state_globals(call.inv.global_opts), "delete", "--force", call.container_id], capture=True, env=call.env)
        if runner is not None:
            runner.wait()

    held: dict[str, float] = {}
    gated_before: list[Step] = []
    gated_after: list[Step] = []
    if gate is not None:
        gated_before, gated_after = gate_steps(gate, settings, criu, ref, held)
    steps = [
        *spec_steps,
        Step("read the restored spec", read_spec),
        marker_step(marker),
        *plan.before_restore(image_dir, meta, ref),
        retarget_step(image_dir, restored_spec),
        *gated_before,
        Step("runc restore", do_restore, undo_restore),
        *gated_after,
        *plan.after_restore(ref, image_dir, meta),
    ]
    hooks_path = hook_timings_path(marker)
    try:
        records = run_steps(steps)
        return records, _read_hook_timings(hooks_path), held
    finally:
        marker.unlink(missing_ok=True)
        hooks_path.unlink(missing_ok=True)


class _Foreground:
    """runc restore without --detach: runc stays as the container's parent until it exits."""

    def __init__(self, call: RuncCall, args: list[str], env: Mapping[str, str]) -> None:
        self.call = call
        self.args = args
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.previous: dict[int, Callable[..., object] | int | None] = {}

    def _forward(self, signum: int, _frame: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def start_and_wait_running(self) -> None:
        # Popen's restore_signals resets SIGPIPE/SIGXFSZ, which Python ignores, for runc.
        self.proc = subprocess.Popen([self.call.runc, *self.args], env=self.env, close_fds=False)
        for name in _FORWARDED:
            signum = getattr(signal, name)
            self.previous[signum] = signal.signal(signum, self._forward)
        while True:
            rc = self.proc.poll()
            if rc is not None:
                if rc != 0:
                    raise RuncFailed("runc restore", rc, self.call.work_dir())
                return  # restored and already exited: nothing left to wait for
            state = runc_state(self.call.runc, self.call.inv.global_opts, self.call.container_id, self.call.env)
            if state is not None and state.status in ("running", "paused"):
                return
            time.sleep(_POLL_S)

    def wait(self) -> int:
        """runc's exit status as a shell would report it (128+N when a signal ended it)."""
        if self.proc is None:
            return int(ExitCode.RESTORE_FAILED)
        try:
            while True:
                try:
                    rc = self.proc.wait()
                    break
                except InterruptedError:
                    continue
        finally:
            for signum, handler in self.previous.items():
                signal.signal(signum, handler)  # type: ignore[arg-type]
            self.previous.clear()
        return rc if rc >= 0 else 128 - rc


def failure_exit_code(error: StepFailed, default: ExitCode) -> int:
    """Exit status for a failed flow: runc's own when runc failed, else the cause's, else ``default``."""
    if isinstance(error.cause, (GpusnapError,)) or error.undo_errors:
        return int(error.exit_code)
    return int(default)
