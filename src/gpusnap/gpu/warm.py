"""Loading the NVIDIA driver's libraries on a thread while the runtime does its other work.

A checkpoint or restore through the runtime needs the CUDA driver (``import cuda.bindings``,
``cuInit``) and NVML before its first GPU step; loading them took a few hundred milliseconds on
the H100 hosts, in series with the spec modifiers, the CRIU lookup and runc's state. cuInit and
nvmlInit release the interpreter lock, so they go on beside that work. The thread only warms
what :class:`gpusnap.gpu.nvidia.NvidiaBackend` loads again (imports are cached, both inits are
reference counted): any error is left for that load to report in its own words.
"""

from __future__ import annotations

import threading


def _load_driver() -> None:
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
    except Exception:  # noqa: BLE001 - the backend's own load reports it
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - likewise
        pass


def start_driver_warmup(gpu_backend: str) -> threading.Thread | None:
    """Start loading the NVIDIA driver when ``gpu_backend`` may use it (``auto``, ``nvidia``);
    None for the stand-in and ``none``. A daemon thread: it never holds up the process's exit."""
    if gpu_backend not in ("auto", "nvidia"):
        return None
    thread = threading.Thread(target=_load_driver, name="gpusnap-driver-warmup", daemon=True)
    thread.start()
    return thread
