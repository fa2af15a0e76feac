"""A transfer process of a restore from a registry: downloads the blobs it is given and writes
their pieces into the image directory's files, which it inherited open from the fetch.

Why processes: one interpreter streams, hashes and writes at most about 1.9 GB/s on a 16-core
host however many threads it runs (the interpreter lock, taken back after every socket read,
hash and write), while four processes together reached 4.4 GB/s on the same host
(bench/results/gpu-h100-pull-2026-11-25). The work of a blob is the same code as in the fetching
process (fetch._Fetch.stream into fetch._BlobRouter); only where it runs differs.

Protocol, one JSON object per line: the fetch writes an ``init`` line, then one line per blob
(``{"id", "blob"}``), and closes stdin when there is no more work. The worker answers
``{"n": bytes}`` as data arrives (progress), and ``{"id", "ok": true}`` or ``{"id", "error",
"message"}`` per blob. stdout carries nothing else. The worker dies with the fetching process
(PR_SET_PDEATHSIG), so a kill -9 of gpusnap leaves no writer behind in the directory the next
run sweeps.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from gpusnap.errors import GpusnapError
from gpusnap.packaging import layout as lay
from gpusnap.packaging.auth import Credentials
from gpusnap.packaging.fetch import FileMaps, _Fetch, make_router
from gpusnap.packaging.fetch_procs import Aborted
from gpusnap.packaging.registry import RegistryClient

PR_SET_PDEATHSIG = 1
REPORT_EVERY = 8 << 20  # progress bytes sent at a time


class _Channel:
    """The answers to the fetching process, whole lines from any thread."""

    def __init__(self, out: IO[str]) -> None:
        self.out, self.lock = out, threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message) + "\n"
        with self.lock:
            self.out.write(line)
            self.out.flush()


class _Reporter:
    """fetch._Fetch's progress: received bytes, sent on in batches (a line per read would
    cost more than the read)."""

    def __init__(self, channel: _Channel) -> None:
        self.channel, self.lock, self.pending = channel, threading.Lock(), 0

    def advance(self, n: int) -> None:
        with self.lock:
            self.pending += n
            if abs(self.pending) < REPORT_EVERY:
                return
            n, self.pending = self.pending, 0
        self.channel.send({"n": n})

    def add_total(self, n: int) -> None:  # a server that ignored Range: the fetch's total was an estimate
        self.channel.send({"total": n})

    def flush(self) -> None:
        with self.lock:
            n, self.pending = self.pending, 0
        if n:
            self.channel.send({"n": n})


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def client_from_wire(init: dict[str, Any]) -> RegistryClient:
    creds = Credentials(**init["credentials"]) if init.get("credentials") else None
    client = RegistryClient(init["registry"], insecure=bool(init["insecure"]), credentials=creds, retries=int(init["retries"]),
                            backoff_s=float(init["backoff_s"]), timeout_s=float(init["timeout_s"]))
    client.adopt_auth(init.get("auth") or {})
    return client


def serve(init: dict[str, Any], jobs: IO[str], out: IO[str]) -> None:
    """Run the jobs read from ``jobs`` on ``init["threads"]`` threads until it ends."""
    channel = _Channel(out)
    reporter = _Reporter(channel)
    fetch = _Fetch(client_from_wire(init), init["repository"], reporter)  # type: ignore[arg-type]
    fds: dict[str, int] = {path: int(fd) for path, fd in init["fds"].items()}
    # init["map"]: the image directory has room reserved for the whole image (fetch.FileMaps).
    maps = FileMaps(fds) if init.get("map") else None

    def run(job: dict[str, Any]) -> None:
        try:
            bp = lay.BlobPlan.from_wire(job["blob"])
            fetch.stream(bp.descriptor, make_router(bp, fds, maps))
            reporter.flush()
            channel.send({"id": job["id"], "ok": True})
        except Aborted:
            channel.send({"id": job["id"], "error": "Aborted", "message": "stopped"})
        except GpusnapError as exc:
            reporter.flush()
            channel.send({"id": job["id"], "error": type(exc).__name__, "message": str(exc)})
        except Exception as exc:  # noqa: BLE001 - reported to the fetch, which raises it there
            reporter.flush()
            channel.send({"id": job["id"], "error": "GpusnapError", "message": f"a transfer process failed: {exc!r}"})

    with ThreadPoolExecutor(max_workers=max(1, int(init["threads"]))) as pool:
        for line in jobs:
            pool.submit(run, json.loads(line))


def main() -> int:
    _die_with_parent()
    try:
        init = json.loads(sys.stdin.readline())
    except ValueError:  # the fetch is gone (stdin closed before a word was said)
        return 1
    if os.getppid() != int(init["parent"]):  # it died before PR_SET_PDEATHSIG took effect
        return 1
    serve(init, sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
