"""`gpusnap demo`: the main job, end to end, on the embedded engine.

A busybox counter starts on runc-direct, is checkpointed into the local store, deleted,
restored under a new name, and shown counting on from where it stopped.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import Annotated

import typer

from gpusnap.cli.output import human_size
from gpusnap.config import Settings
from gpusnap.engines import flows
from gpusnap.engines.base import CheckpointOptions, ContainerInfo
from gpusnap.engines.runc_direct import RuncDirectEngine
from gpusnap.errors import GpusnapError, UsageError

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
            flows.packaging_api()
        except GpusnapError:
            packaging = False
        say(f"1/5 starting {name}: a busybox counter on runc-direct")
        info = engine.run(name, ["sh", "-c", COUNTER])
        before = _wait_for_count(engine, info, 3)
        say(f"    it counts: {' '.join(map(str, before[-3:]))}")
        ref = f"localhost/gpusnap/{name}:demo"
        if packaging:
            say(f"2/5 checkpointing it into the local store as {ref}")
            outcome = flows.checkpoint(settings, name, engine="runc-direct", opts=CheckpointOptions(), ref=ref)
            ref = outcome.ref
            stored = True
        else:
            out_dir = flows.work_dir(settings) / "checkpoint"
            say(f"2/5 checkpointing it into {out_dir}")
            outcome = flows.checkpoint(settings, name, engine="runc-direct", opts=CheckpointOptions(), output=out_dir)
        last = _numbers(engine.logs(info))[-1]
        say(f"    stopped at {last}; checkpoint of {human_size(outcome.size)} taken in {sum(outcome.timings_s.values()):.2f}s")
        say(f"3/5 deleting {name}")
        engine.remove(engine.get(name) or info)
        say(f"4/5 restoring it as {restored_name}")
        restored = flows.restore(settings, ref if out_dir is None else str(out_dir), name=restored_name, engine="runc-direct")
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
                flows.packaging_api().remove(settings.store_dir, ref)
            except Exception:  # noqa: BLE001 - cleanup must not hide the demo's own result
                pass


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        ctx: typer.Context,
        name: Annotated[str, typer.Option("--name", help="Name of the demo container.")] = "gpusnap-demo",
        keep: Annotated[bool, typer.Option("--keep", help="Keep the restored container and the stored checkpoint.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    ) -> None:
        """Checkpoint a counting container, delete it, restore it, and show it counting on."""
        from gpusnap.cli.main import get_ctx, require_root

        require_root("gpusnap demo")
        c = get_ctx(ctx)
        result = run_demo(c.settings, name, keep, (lambda _t: None) if as_json else c.out.info)
        if as_json:
            c.out.json(result)
