"""`gpusnap demo`: the main job, end to end, on the embedded engine.

Without a GPU (or with ``--no-gpu``): a busybox counter starts on runc-direct, is checkpointed
into the local store, deleted, restored under a new name, and shown counting on from where it
stopped.

On a host whose NVIDIA driver has the CUDA checkpoint API (or with ``--gpu``): the same round
trip with a CUDA workload. The container runs through gpusnap-runtime with only
``NVIDIA_VISIBLE_DEVICES=all`` asked for (the shim injects devices, driver libraries and the
CRIU config); its root filesystem is an overlay over the host's ``/`` so it has the host's
Python with PyTorch without an image. The workload (:data:`CUDA_WORKLOAD`) holds ``GS_GIB`` GiB
on the GPU, updates it in place every step and prints ``step N CHECKSUM`` every ``GS_EVERY``
steps, the checksum covering every bit of the tensor.

How "it resumed correctly" is checked: the workload is deterministic (fixed seed, elementwise
float ops, integer checksum), so a fresh run of the same program computes the same checksum at
every step. After the restore the demo runs that program once more on the host, on the GPU, up
to the last step the restored container printed (no pauses, a few seconds), and requires (1) the
restored container's first line to be the step right after the last one printed before the
checkpoint (no restart, nothing skipped or repeated) and (2) every checksum printed before the
checkpoint and after the restore to equal the reference run's at the same step. A reference
computed separately, rather than values kept from before the checkpoint, is what makes (2) a
test of the GPU memory that came back: the post-restore values were never seen before.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Optional

import typer

from gpusnap.cli.context import get_ctx, require_root
from gpusnap.cli.output import human_size
from gpusnap.config import Settings
from gpusnap.engines import orchestrate
from gpusnap.engines.base import CheckpointOptions, ContainerInfo
from gpusnap.engines.runc_direct import RuncDirectEngine
from gpusnap.errors import GpusnapError, MissingDependencyError, UsageError

COUNTER = "i=0; while true; do echo $i; i=$((i+1)); sleep 1; done"


def _numbers(text: str) -> list[int]:
    return [int(ln) for ln in text.split() if ln.isdigit()]


def _wait_for_count(engine: RuncDirectEngine, info: ContainerInfo, at_least: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        nums = _numbers(engine.logs(info))
        if len(nums) >= at_least:
            return nums
        if time.monotonic() > deadline:
            raise GpusnapError(f"{info.name} printed {len(nums)} numbers in {timeout:.0f}s, expected {at_least}; see `gpusnap logs {info.name}`")
        time.sleep(0.2)


def run_demo(settings: Settings, name: str, keep: bool, say: Callable[[str], None]) -> dict[str, object]:
    engine = RuncDirectEngine(settings)
    restored_name = f"{name}-restored"
    for n in (name, restored_name):
        if engine.get(n) is not None:
            raise UsageError(f"a runc-direct container named {n} already exists; `gpusnap delete {n}` or pass --name")
    stored = False
    out_dir = None
    ref = ""
    try:
        packaging = True
        try:
            orchestrate.packaging_api()
        except GpusnapError:
            packaging = False
        say(f"1/5 starting {name}: a busybox counter on runc-direct")
        info = engine.run(name, ["sh", "-c", COUNTER])
        before = _wait_for_count(engine, info, 3)
        say(f"    it counts: {' '.join(map(str, before[-3:]))}")
        ref = f"localhost/gpusnap/{name}:demo"
        if packaging:
            say(f"2/5 checkpointing it into the local store as {ref}")
            outcome = orchestrate.checkpoint(settings, name, engine="runc-direct", opts=CheckpointOptions(), ref=ref)
            ref = outcome.ref
            stored = True
        else:
            out_dir = orchestrate.work_dir(settings) / "checkpoint"
            say(f"2/5 checkpointing it into {out_dir}")
            outcome = orchestrate.checkpoint(settings, name, engine="runc-direct", opts=CheckpointOptions(), output=out_dir)
        last = _numbers(engine.logs(info))[-1]
        say(f"    stopped at {last}; checkpoint of {human_size(outcome.size)} taken in {sum(v for k, v in outcome.timings_s.items() if ': ' not in k):.2f}s")
        say(f"3/5 deleting {name}")
        engine.remove(engine.get(name) or info)
        say(f"4/5 restoring it as {restored_name}")
        restored = orchestrate.restore(settings, ref if out_dir is None else str(out_dir), name=restored_name, engine="runc-direct")
        after = _wait_for_count(engine, restored.container, 2)
        resumed = after[0] == last + 1
        say(f"5/5 {restored_name} counts on: {' '.join(map(str, after[:3]))} (it stopped at {last})")
        if not resumed:
            raise GpusnapError(f"the restored counter started at {after[0]}, expected {last + 1}")
        say("done: the container resumed exactly where it was checkpointed")
        return {"container": name, "restored": restored_name, "ref": ref if packaging else str(out_dir), "stopped_at": last, "resumed_at": after[0], "resumed": resumed}
    finally:
        for n in (name, restored_name):
            c = engine.get(n)
            if c is not None and not (keep and n == restored_name):
                engine.remove(c)
        if out_dir is not None:
            shutil.rmtree(out_dir.parent, ignore_errors=True)
        if stored and not keep:
            try:
                orchestrate.packaging_api().remove(settings.store_dir, ref)
            except Exception:  # noqa: BLE001 - cleanup must not hide the demo's own result
                pass


# Runs in the container and, as the reference, on the host. torch.rand on the CUDA generator
# with a fixed seed and elementwise in-place ops are bit for bit reproducible on one GPU model.
CUDA_WORKLOAD = r"""
import os, sys, time
import torch
every, stop, pause = int(os.environ["GS_EVERY"]), int(os.environ.get("GS_STOP", "0")), float(os.environ.get("GS_PAUSE", "0"))
if not torch.cuda.is_available():
    sys.exit("gpusnap demo: torch.cuda.is_available() is False in the workload; check the NVIDIA driver")
torch.manual_seed(20261122)
x = torch.rand(int(float(os.environ["GS_GIB"]) * (1 << 28)), device="cuda")

def checksum():
    # The sum of the tensor's 32-bit patterns, in chunks: a whole-tensor int64 sum would
    # allocate (and the caching allocator keep) twice the tensor's size again.
    torch.cuda.synchronize()
    return sum(int(c.sum(dtype=torch.int64).item()) for c in x.view(torch.int32).split(1 << 24))

print("ready", flush=True)
step = 0
while True:
    x.mul_(1.0000001).add_(1e-7)
    step += 1
    if step % every == 0:
        print(f"step {step} {checksum()}", flush=True)
        if stop and step >= stop:
            break
    if pause:
        time.sleep(pause)
"""
# All the container asks for: gpusnap-runtime injects the device nodes, driver libraries and
# CRIU config, as for any container started with the NVIDIA Container Toolkit's variable.
GPU_REQUEST = "NVIDIA_VISIBLE_DEVICES=all"
GPU_GIB = 1.0
GPU_EVERY = 10
GPU_PAUSE = 0.05


@dataclass(frozen=True)
class GpuDemoParams:
    python: str  # the interpreter with torch, a host path also seen through the overlay of /
    gib: float = GPU_GIB
    every: int = GPU_EVERY
    pause: float = GPU_PAUSE
    lower: str = "/"
    ready_timeout: float = 240.0


def gpu_unavailable_reason(settings: Settings) -> str | None:
    """Why this host cannot run the GPU demo, or None when the NVIDIA checkpoint API is there."""
    if settings.gpu_backend not in ("auto", "nvidia"):
        return f"the GPU backend is {settings.gpu_backend!r}; the GPU demo needs the real NVIDIA driver (GPUSNAP_GPU_BACKEND=auto)"
    from gpusnap.gpu.plan import make_backend

    backend = make_backend(settings)
    try:
        backend._driver()  # type: ignore[attr-defined]  # raises with the reason
    except GpusnapError as exc:
        return str(exc)
    return None


def choose_gpu(requested: bool | None, unavailable: Callable[[], str | None]) -> bool:
    """--gpu / --no-gpu win; otherwise the GPU demo runs where the GPU backend is available."""
    if requested is False:
        return False
    reason = unavailable()
    if requested is None:
        return reason is None
    if reason is not None:
        raise MissingDependencyError(f"--gpu needs an NVIDIA GPU with the CUDA checkpoint API: {reason}; run `gpusnap doctor`, or use --no-gpu")
    return True


def default_python() -> str:
    return shutil.which("python3") or "python3"


def torch_missing_reason(python: str) -> str | None:
    """Why ``python`` cannot run the CUDA workload (absent, or no torch), or None when it can."""
    exe = shutil.which(python)
    if exe is None:
        return f"Python interpreter {python} not found"
    try:
        proc = subprocess.run([exe, "-c", "import torch"], capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return f"{exe} took over 120 s to import torch"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"{exe} cannot import torch ({last})"
    return None


def require_torch(python: str) -> None:
    """The workload's interpreter must exist and import torch: checked before anything starts."""
    reason = torch_missing_reason(python)
    if reason is not None:
        raise MissingDependencyError(f"{reason}; pass --python PATH to an interpreter that has PyTorch with CUDA, or --no-gpu for the CPU demo")


def parse_steps(text: str) -> dict[int, int]:
    """``step N CHECKSUM`` lines of the workload's output (anything else, e.g. warnings, skipped)."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "step" and parts[1].isdigit() and parts[2].lstrip("-").isdigit():
            out[int(parts[1])] = int(parts[2])
    return out


def compare_with_reference(before: dict[int, int], after: dict[int, int], reference: dict[int, int], every: int) -> dict[str, object]:
    """The verdict: the restored run continues at the next step and every value matches."""
    stopped_at = max(before) if before else 0
    resumed_at = min(after) if after else 0
    seen = {**before, **after}
    missing = sorted(s for s in seen if s not in reference)
    mismatched = sorted(s for s in seen if s in reference and seen[s] != reference[s])
    return {
        "stopped_at": stopped_at,
        "resumed_at": resumed_at,
        "resumed": bool(before) and bool(after) and resumed_at == stopped_at + every,
        "steps_compared": len(seen) - len(missing),
        "steps_after_restore": len(after),
        "mismatched_steps": mismatched[:10],
        "values_matched": bool(after) and not missing and not mismatched,
    }


def _workload_env(params: GpuDemoParams, stop: int = 0, pause: float | None = None) -> dict[str, str]:
    return {"GS_GIB": str(params.gib), "GS_EVERY": str(params.every), "GS_STOP": str(stop),
            "GS_PAUSE": str(params.pause if pause is None else pause), "PYTHONUNBUFFERED": "1"}


def _wait_for_steps(engine: RuncDirectEngine, info: ContainerInfo, at_least: int, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        text = engine.logs(info)
        steps = parse_steps(text)
        if len(steps) >= at_least:
            return steps
        if not engine.is_running(info):
            tail = (text.strip().splitlines() or ["no output"])[-1]
            raise GpusnapError(f"the CUDA workload in {info.name} stopped before printing {at_least} checksums: {tail}")
        if time.monotonic() > deadline:
            raise GpusnapError(f"{info.name} printed {len(steps)} checksums in {timeout:.0f}s, expected {at_least}; see `gpusnap logs {info.name}`")
        time.sleep(0.2)


def _settled_log(engine: RuncDirectEngine, info: ContainerInfo, timeout: float = 10.0) -> str:
    """The old container's log once its copier has drained the pipe (it is written after the dump)."""
    deadline = time.monotonic() + timeout
    last = engine.logs(info)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = engine.logs(info)
        if now == last:
            return now
        last = now
    return last


def reference_run(python: str, params: GpuDemoParams, stop: int, timeout: float = 300.0) -> dict[int, int]:
    """The workload run afresh on the host's GPU, without pauses, up to ``stop``."""
    env = {**os.environ, **_workload_env(params, stop=stop, pause=0.0)}
    try:
        proc = subprocess.run([python, "-c", CUDA_WORKLOAD], env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise GpusnapError(f"the reference run did not reach step {stop} in {timeout:.0f}s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise GpusnapError(f"the reference run of the CUDA workload failed: {last}")
    return parse_steps(proc.stdout)


def gpu_timings(timings: dict[str, float]) -> dict[str, float]:
    """The GPU part of a checkpoint's gpusnap.json timings, under the names the demo shows."""
    names = {"gpu_lock": "lock", "gpu_checkpoint": "gpu_to_host", "criu_dump": "criu_dump", "total": "total"}
    return {short: timings[key] for key, short in names.items() if key in timings}


def run_gpu_demo(settings: Settings, name: str, keep: bool, say: Callable[[str], None], params: GpuDemoParams) -> dict[str, object]:
    """The CUDA round trip; the caller has checked ``params.python`` (:func:`require_torch`)."""
    engine = RuncDirectEngine(settings)
    restored_name = f"{name}-restored"
    for n in (name, restored_name):
        if engine.get(n) is not None:
            raise UsageError(f"a runc-direct container named {n} already exists; `gpusnap delete {n}` or pass --name")
    ref = f"localhost/gpusnap/{name}:demo"
    stored = False
    try:
        orchestrate.packaging_api()  # the GPU demo goes through the local store, as users would
        say(f"1/6 starting {name}: a CUDA workload holding {params.gib:g} GiB on the GPU (runc-direct, overlay of {params.lower}, NVIDIA_VISIBLE_DEVICES=all)")
        env = [f"{k}={v}" for k, v in _workload_env(params).items()] + [GPU_REQUEST, "HOME=/root"]
        info = engine.run(name, [params.python, "-c", CUDA_WORKLOAD], rootfs_overlay=params.lower, env=env)
        seen = _wait_for_steps(engine, info, 3, params.ready_timeout)
        say("    it computes: " + ", ".join(f"step {s} → {seen[s]}" for s in sorted(seen)[-2:]))
        say(f"2/6 checkpointing it into the local store as {ref}")
        outcome = orchestrate.checkpoint(settings, name, engine="runc-direct", opts=CheckpointOptions(), ref=ref)
        stored = True
        meta = outcome.metadata
        if not meta.processes:
            raise GpusnapError(f"the checkpoint of {name} holds no GPU process; is {name} running through gpusnap-runtime (`gpusnap doctor`)?")
        gpu_mem = sum(p.gpu_memory_bytes for p in meta.processes)
        t = gpu_timings(meta.timings_s)
        say(f"    {human_size(outcome.size)} stored; GPU memory saved: {human_size(gpu_mem)}")
        labels = {"lock": "lock", "gpu_to_host": "GPU→host", "criu_dump": "CRIU dump", "total": "checkpoint total"}
        say("    " + ", ".join(f"{labels[k]} {v:.2f}s" for k, v in t.items()))
        before = parse_steps(_settled_log(engine, info))
        stopped_at = max(before)
        say(f"    the workload stopped after step {stopped_at}")
        say(f"3/6 deleting {name}")
        engine.remove(engine.get(name) or info)
        say(f"4/6 restoring it from {ref} as {restored_name}")
        started = time.monotonic()
        restored = orchestrate.restore(settings, ref, name=restored_name, engine="runc-direct")
        restore_s = round(time.monotonic() - started, 3)
        after = _wait_for_steps(engine, restored.container, 3, 120.0)
        say(f"    restored in {restore_s:.2f}s; it goes on: " + ", ".join(f"step {s}" for s in sorted(after)[:3]))
        last = max(after)
        say(f"5/6 computing the reference: the same workload afresh on the GPU, steps 1-{last}")
        reference = reference_run(params.python, params, last)
        verdict = compare_with_reference(before, after, reference, params.every)
        say(f"6/6 {verdict['steps_compared']} checksums compared with the reference ({verdict['steps_after_restore']} after the restore): "
            + ("all equal" if verdict["values_matched"] else f"differences at steps {verdict['mismatched_steps']}"))
        if not verdict["resumed"]:
            raise GpusnapError(f"the restored workload went on at step {verdict['resumed_at']}, expected {stopped_at + params.every}")
        if not verdict["values_matched"]:
            raise GpusnapError(f"the restored workload's checksums differ from the reference run at steps {verdict['mismatched_steps']} (or the reference lacks steps)")
        say("done: the CUDA workload resumed exactly where it was checkpointed, its GPU memory intact")
        return {"mode": "gpu", "container": name, "restored": restored_name, "ref": ref, "gib": params.gib,
                "gpu_memory_bytes": gpu_mem, "checkpoint_size": outcome.size, "gpu_timings_s": t,
                "checkpoint_timings_s": dict(meta.timings_s), "restore_s": restore_s, **verdict}
    finally:
        for n in (name, restored_name):
            c = engine.get(n)
            if c is not None and not (keep and n == restored_name):
                engine.remove(c)
        if stored and not keep:
            try:
                orchestrate.packaging_api().remove(settings.store_dir, ref)
            except Exception:  # noqa: BLE001 - cleanup must not hide the demo's own result
                pass


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        ctx: typer.Context,
        name: Annotated[str, typer.Option("--name", help="Name of the demo container.")] = "gpusnap-demo",
        keep: Annotated[bool, typer.Option("--keep", help="Keep the restored container and the stored checkpoint.")] = False,
        gpu: Annotated[Optional[bool], typer.Option("--gpu/--no-gpu", help="The CUDA workload / the busybox counter; default: CUDA where the NVIDIA checkpoint API is available.")] = None,
        python: Annotated[Optional[str], typer.Option("--python", help="Interpreter with PyTorch for the CUDA workload; default: python3 on PATH.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    ) -> None:
        """Checkpoint a running container (a CUDA workload on a GPU host), delete it, restore it, and show it going on."""
        require_root("gpusnap demo")
        c = get_ctx(ctx)
        say = (lambda _t: None) if as_json else c.out.info
        use_gpu = choose_gpu(gpu, lambda: gpu_unavailable_reason(c.settings))
        python_exe = python or default_python()
        fallback = None
        if use_gpu and gpu is None and python is None:
            # A GPU host whose default python3 has no PyTorch (a bare driver install): the user
            # asked for nothing in particular, so show the CPU demo and say how to get the CUDA one.
            fallback = torch_missing_reason(python_exe)
            if fallback is not None:
                use_gpu = False
                say(f"a GPU is here, but {fallback}: showing the busybox counter (pass --python PATH to an interpreter with PyTorch for the CUDA workload)")
        elif use_gpu:
            require_torch(python_exe)  # asked for: an error, checked before anything starts
        if use_gpu:
            result = run_gpu_demo(c.settings, name, keep, say, GpuDemoParams(python=python_exe))
        else:
            result = {"mode": "counter", **run_demo(c.settings, name, keep, say), **({"gpu_skipped": fallback} if fallback else {})}
        if as_json:
            c.out.json(result)
