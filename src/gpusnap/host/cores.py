"""How many cores gpusnap's pools may use.

``os.cpu_count()`` counts the host's cores. A gpusnap started in a cpuset (a Kubernetes pod with
a static CPU policy, `taskset`, a systemd slice with AllowedCPUs) may run on fewer, and a pool
sized to the host then runs many more threads than cores, every one of them sharing the
interpreter lock and the cores the job and CRIU need. The scheduler's affinity mask is what
the process may actually run on.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)
