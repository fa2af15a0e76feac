"""Copies a runc-direct container's output from a pipe into its log file.

Containers get pipes for stdio, never host files: CRIU cannot dump a file opened from the host's
mount namespace, while runc declares the stdio pipes external and reconnects new ones at restore.
This process holds the read end of the pipe and outlives the ``gpusnap`` command that started
the container; it ends when the container's last writer closes the pipe.

Usage: ``python -m gpusnap.engines.logcopy LOGFILE`` with the pipe as standard input.
Standard library only, unbuffered, so ``gpusnap logs`` sees every line as soon as it is written.
"""

from __future__ import annotations

import os
import signal
import sys


def copy(src_fd: int, dest_path: str) -> None:
    out = os.open(dest_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    try:
        while True:
            chunk = os.read(src_fd, 65536)
            if not chunk:
                return
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view) :]
    finally:
        os.close(out)


def main() -> None:
    # Detached from the terminal that started it: a Ctrl-C there must not cut the log.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    copy(0, sys.argv[1])


if __name__ == "__main__":
    main()
