"""gpusnap.host.priority: the store's threads give way to the dump, the caller's thread keeps
its priority."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpusnap.config import load_settings
from gpusnap.errors import UsageError
from gpusnap.host.priority import thread_nice, yield_cpu
from gpusnap.packaging.registry import PipelinedPush
from gpusnap.packaging.store import OciStore


def _in_thread(fn):  # type: ignore[no-untyped-def]
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join()
    return out["v"]


def test_yield_cpu_raises_only_the_calling_thread() -> None:
    mine = thread_nice()

    def lowered() -> int:
        yield_cpu(mine + 5)
        return thread_nice()

    assert _in_thread(lowered) == min(mine + 5, 19)
    assert thread_nice() == mine


def test_yield_cpu_never_lowers_a_nice_value_and_zero_leaves_it() -> None:
    def twice() -> tuple[int, int]:
        yield_cpu(12)
        yield_cpu(3)  # already nicer than 3: unchanged (lowering would need privilege anyway)
        after = thread_nice()
        yield_cpu(0)
        return after, thread_nice()

    base = thread_nice()
    assert _in_thread(twice) == (max(12, base), max(12, base))
    assert _in_thread(lambda: (yield_cpu(0), thread_nice())[1]) == base


def test_nice_beyond_the_range_is_capped() -> None:
    assert _in_thread(lambda: (yield_cpu(40), thread_nice())[1]) == 19


def test_pool_threads_of_a_pipelined_push_give_way(tmp_path: Path) -> None:
    class NoRegistry:  # the pool is what is looked at; nothing is sent
        workers = 2

    push = PipelinedPush(OciStore(tmp_path / "s"), "localhost:5000/x/y:1", client=NoRegistry(), nice=9,  # type: ignore[arg-type]
                         processes=0)  # threads only, on any host (transfer processes need a real client)
    try:
        got = {push._pool.submit(thread_nice).result() for _ in range(4)}
    finally:
        push.close()
    assert got == {max(9, thread_nice())}
    plain = ThreadPoolExecutor(1)
    assert plain.submit(thread_nice).result() == thread_nice()
    plain.shutdown()


@pytest.mark.parametrize(("name", "var", "default", "other"), [("store_nice", "GPUSNAP_STORE_NICE", 10, 0), ("push_nice", "GPUSNAP_PUSH_NICE", None, 19)])
def test_nice_settings(tmp_path: Path, name: str, var: str, default: int | None, other: int) -> None:
    absent = tmp_path / "none.toml"
    assert getattr(load_settings(env={}, config_file=absent), name) == default  # push_nice None: the store's
    assert getattr(load_settings(env={var: str(other)}, config_file=absent), name) == other
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"{name} = 15\n")
    assert getattr(load_settings(env={}, config_file=cfg), name) == 15
    for bad in ("20", "-1", "high"):
        with pytest.raises(UsageError, match=f"{name} must be a nice value from 0 to 19"):
            load_settings(env={var: bad}, config_file=absent)
    if name == "push_nice":
        assert load_settings(env={var: "auto"}, config_file=absent).push_nice is None


def test_checkpoint_preload_thread_gives_way_and_the_caller_keeps_its_priority() -> None:
    """The imports a checkpoint loads beside the dump (orchestrate._preload) run at the store's
    nice value, on their own thread only."""
    from gpusnap.engines import orchestrate

    mine = thread_nice()

    def preload() -> tuple[bool, int]:
        return orchestrate._preload("json", nice=mine + 7), thread_nice()

    ok, nice = _in_thread(preload)
    assert ok and nice == min(mine + 7, 19)
    assert thread_nice() == mine
    assert _in_thread(lambda: orchestrate._preload("gpusnap_no_such_module", nice=mine + 3)) is False
