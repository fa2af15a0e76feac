"""Pools are sized by the cores this process may run on, not the host's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.host.cores import usable_cores


def test_usable_cores_is_the_affinity_mask() -> None:
    assert usable_cores() == len(os.sched_getaffinity(0)) >= 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_process_pinned_to_one_core_sizes_every_pool_to_it(tmp_path: Path) -> None:
    """As under `taskset -c 0` or a pod's cpuset on a many-core host: the store's workers, the
    follower beside a dump, a restore's fetch threads and transfer processes all count one core."""
    probe = (
        "import os, sys\n"
        "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "from pathlib import Path\n"
        "from gpusnap.host.cores import usable_cores\n"
        "from gpusnap.packaging import fetch, follow, pack, transfer_procs\n"
        "from gpusnap.packaging.store import OciStore\n"
        "w = pack.PackWriter(OciStore(Path(sys.argv[1])), compress=False)\n"
        "print(usable_cores(), w.workers, follow.beside_dump_workers(), transfer_procs.auto_processes(8 << 30), "
        "transfer_procs.push_processes(8 << 30))\n"
        "w.abort()\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "store")], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "1", "1", "0", "0"]
