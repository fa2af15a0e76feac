"""How gpusnap's processes end (gpusnap.process_exit.leave, the CLI's console script run): the same status and output as a
normal exit, exit handlers run, and other threads still waited for; only the interpreter's
teardown is skipped. Each case runs in a child interpreter (leave ends the process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from gpusnap.errors import ExitCode


def _child(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"GPUSNAP_RUN_DIR": str(tmp_path / "run"), "GPUSNAP_STATE_DIR": str(tmp_path / "state"),
           "GPUSNAP_CONFIG": str(tmp_path / "none.toml"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, env=env)


def test_run_keeps_exit_codes_and_output(tmp_path: Path) -> None:
    ok = _child("import sys; sys.argv = ['gpusnap', '--version']; from gpusnap.cli.main import run; run()", tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("gpusnap ")
    usage = _child("import sys; sys.argv = ['gpusnap', 'no-such-command']; from gpusnap.cli.main import run; run()", tmp_path)
    assert usage.returncode == 2 and "No such command" in usage.stderr
    missing = _child("import sys; sys.argv = ['gpusnap', 'logs', 'gs-nosuch']; from gpusnap.cli.main import run; run()", tmp_path)
    assert missing.returncode == ExitCode.NOT_FOUND
    assert missing.stderr.strip() == "gpusnap: error: no runc-direct container gs-nosuch; `gpusnap ps` lists them"


def test_leave_runs_exit_handlers_and_flushes_buffered_output(tmp_path: Path) -> None:
    done = _child(f"""
        import atexit, sys
        from gpusnap.process_exit import leave
        atexit.register(lambda: open({str(tmp_path / "handler")!r}, "w").write("ran"))
        sys.stdout.write("buffered, no newline")
        leave(3)
    """, tmp_path)
    assert done.returncode == 3 and done.stdout == "buffered, no newline"
    assert (tmp_path / "handler").read_text() == "ran"
    message = _child("from gpusnap.process_exit import leave; leave('what went wrong')", tmp_path)
    assert message.returncode == 1 and message.stderr.strip() == "what went wrong"


def test_leave_waits_for_a_thread_still_running(tmp_path: Path) -> None:
    done = _child(f"""
        import threading, time
        from gpusnap.process_exit import leave
        def late():
            time.sleep(0.3)
            open({str(tmp_path / "late")!r}, "w").write("written")
        threading.Thread(target=late).start()
        leave(0)
    """, tmp_path)
    assert done.returncode == 0
    assert (tmp_path / "late").read_text() == "written"
