"""CPU priority of gpusnap's background threads.

A checkpoint stored (and pushed) while CRIU dumps runs its hashing, compression, writes and
uploads on a pool of threads beside the dump, on the same cores as CRIU and the process it
dumps. The dump is what the user waits for; the store can catch up afterwards. So those threads
give way: their nice value is raised, which on Linux is per thread (each thread is a task with
its own priority), so the thread that starts CRIU, and CRIU itself, keep theirs. Raising a nice
value needs no privilege, and threads or processes started from such a thread inherit it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

MAX_NICE = 19


def yield_cpu(nice: int) -> None:
    """Raise the calling thread's nice value to ``nice`` (0: leave it). Best effort: a host
    without per-thread priorities only loses the preference, never the work."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, min(nice, MAX_NICE))
    except OSError:
        pass


def yielding_pool(max_workers: int, thread_name_prefix: str, nice: int) -> ThreadPoolExecutor:
    """A thread pool whose threads run at nice value ``nice`` (0: the caller's)."""
    lower = {"initializer": yield_cpu, "initargs": (nice,)} if nice > 0 else {}
    return ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name_prefix, **lower)


def thread_nice(tid: int | None = None) -> int:
    """The nice value of thread ``tid`` (default: the calling thread)."""
    return os.getpriority(os.PRIO_PROCESS, tid if tid is not None else threading.get_native_id())
