"""The driver warm-up thread of the runtime (gpusnap.gpu.warm)."""

from __future__ import annotations

import sys

from gpusnap.gpu.warm import start_driver_warmup


def test_no_thread_for_backends_that_never_load_the_driver() -> None:
    assert start_driver_warmup("none") is None
    assert start_driver_warmup("standin:/tmp/x") is None


def test_warmup_ends_quietly_without_a_driver(monkeypatch) -> None:
    # On a host without cuda-bindings or NVML (CI) the thread finds nothing to load, raises
    # nothing and ends; the backend's own load is what reports a missing driver.
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    thread = start_driver_warmup("auto")
    assert thread is not None and thread.daemon
    thread.join(10)
    assert not thread.is_alive()
