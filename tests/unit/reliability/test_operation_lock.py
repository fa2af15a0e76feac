"""The per-container operation lock: a live holder refuses others; a holder killed with SIGKILL
leaves it free (the kernel drops flocks), which is what lets the next checkpoint heal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap.checkpoint.recovery import lock_path, operation_lock
from gpusnap.config import load_settings
from gpusnap.errors import CheckpointError, RestoreError

HOLDER = """
import sys, time
from pathlib import Path
from gpusnap.config import load_settings
from gpusnap.checkpoint.recovery import operation_lock
s = load_settings(env={}, config_file=Path('/nonexistent'), run_dir=sys.argv[1])
with operation_lock(s, 'gs-rel-c1'):
    print('held', flush=True)
    time.sleep(60)
"""


def test_live_holder_refuses_then_sigkill_frees(tmp_path: Path) -> None:
    settings = load_settings(env={}, config_file=tmp_path / "none", run_dir=tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match="another gpusnap checkpoint or restore of gs-rel-c1 is running"):
            with operation_lock(settings, "gs-rel-c1"):
                pass
        with pytest.raises(RestoreError):
            with operation_lock(settings, "gs-rel-c1", error=RestoreError):
                pass
        with operation_lock(settings, "gs-rel-other"):  # other containers are not affected
            pass
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        with operation_lock(settings, "gs-rel-c1"):
            pass
    finally:
        if holder.poll() is None:
            holder.kill()
    assert lock_path(settings, "gs-rel-c1").stat().st_mode & 0o077 == 0
