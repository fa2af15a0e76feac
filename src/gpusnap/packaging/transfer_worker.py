"""A transfer process: moves the blobs it is given between a registry and this host.

Two roles, named in the ``init`` line:

- ``fetch`` (a restore from a registry): downloads each blob and writes its pieces into the
  image directory's files, which it inherited open from the fetch.
- ``push``: puts each blob of the local store on the registry (HEAD, mount, upload), reading
  it from the store, whose root it is given.

Why processes: one interpreter streams, hashes and writes at most about 1.9 GB/s on a 16-core
host however many threads it runs (the interpreter lock, taken back after every socket read,
hash and write), while four processes together reached 4.4 GB/s on the same host
(bench/results/gpu-h100-pull-2026-11-25). A ``checkpoint --push`` has the store hashing and
writing the dump's pages in its own process while the uploads go: those share that lock unless
the uploads run here. The work of a blob is the same code as in the parent (fetch._Fetch.stream
into fetch._BlobRouter; registry.put_blob); only where it runs differs.

Protocol, one JSON object per line: the parent writes an ``init`` line, then one line per blob
(``{"id", "blob"}`` to fetch, ``{"id", "push", "mount"}`` to push), and closes stdin when there
is no more work. The worker answers ``{"n": bytes}`` as data moves (progress), ``{"total": n}``
when more is to move than first said, and ``{"id", "ok": true[, "how"]}`` or ``{"id", "error",
"message"}`` per blob. stdout carries nothing else. The worker ends the moment its parent
process does (:func:`_die_with_parent`), so a kill -9 of gpusnap leaves no writer behind in the
directory the next run sweeps, and no upload going on.
"""

from __future__ import annotations

import json
import os
import select
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from gpusnap.errors import GpusnapError
from gpusnap.packaging.auth import Credentials
from gpusnap.packaging.registry import RegistryClient
from gpusnap.packaging.transfer_procs import Aborted

REPORT_EVERY = 8 << 20  # progress bytes sent at a time


class _Channel:
    """The answers to the parent process, whole lines from any thread."""

    def __init__(self, out: IO[str]) -> None:
        self.out, self.lock = out, threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message) + "\n"
        with self.lock:
            self.out.write(line)
            self.out.flush()


class _Reporter:
    """The transfers' progress (fetch._Fetch's, or an upload's): bytes moved, sent on in
    batches (a line per read would cost more than the read)."""

    def __init__(self, channel: _Channel) -> None:
        self.channel, self.lock, self.pending = channel, threading.Lock(), 0

    def advance(self, n: int) -> None:
        with self.lock:
            self.pending += n
            if abs(self.pending) < REPORT_EVERY:
                return
            n, self.pending = self.pending, 0
        self.channel.send({"n": n})

    def add_total(self, n: int) -> None:  # a blob to upload, or a server that ignored Range
        self.channel.send({"total": n})

    def close(self) -> None:  # the Progress protocol; the parent's bar is the one that closes
        pass

    def flush(self) -> None:
        with self.lock:
            n, self.pending = self.pending, 0
        if n:
            self.channel.send({"n": n})


def _die_with_parent(parent: int) -> None:
    """End this process as soon as the process ``parent`` ends, however it ends.

    Not PR_SET_PDEATHSIG: that signal follows the *thread* that started this process, and
    ``checkpoint --push`` starts its workers from a thread that ends long before the push does.
    A pidfd of the parent becomes readable when the whole process is gone; where there is none
    (a kernel before 5.3), the parent's pid is polled instead."""
    try:
        fd: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while os.getppid() == parent:
                time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="gpusnap-parent-watch", daemon=True).start()


def client_from_wire(init: dict[str, Any]) -> RegistryClient:
    creds = Credentials(**init["credentials"]) if init.get("credentials") else None
    sizes = {k: int(init[k]) for k in ("monolithic_limit", "patch_size") if k in init}  # an upload's request sizes
    client = RegistryClient(init["registry"], insecure=bool(init["insecure"]), credentials=creds, retries=int(init["retries"]),
                            backoff_s=float(init["backoff_s"]), timeout_s=float(init["timeout_s"]), **sizes)
    client.adopt_auth(init.get("auth") or {})
    client.reached = bool(init.get("reached"))  # the parent's client had an answer: a refusal now is a restart
    return client


def _fetcher(init: dict[str, Any], reporter: _Reporter) -> Callable[[dict[str, Any]], str | None]:
    # Imported by the role that needs them: a push worker starts without the fetch's modules.
    from gpusnap.packaging import layout as lay
    from gpusnap.packaging.fetch import FileMaps, _Fetch, make_router

    fetch = _Fetch(client_from_wire(init), init["repository"], reporter)  # type: ignore[arg-type]
    fds: dict[str, int] = {path: int(fd) for path, fd in init["fds"].items()}
    # init["map"]: the image directory has room reserved for the whole image (fetch.FileMaps).
    maps = FileMaps(fds) if init.get("map") else None

    def one(job: dict[str, Any]) -> str | None:
        bp = lay.BlobPlan.from_wire(job["blob"])
        fetch.stream(bp.descriptor, make_router(bp, fds, maps))
        return None

    return one


def _pusher(init: dict[str, Any], reporter: _Reporter) -> Callable[[dict[str, Any]], str | None]:
    from gpusnap.packaging.registry import put_blob
    from gpusnap.packaging.store import Descriptor, OciStore

    client, store, repo = client_from_wire(init), OciStore(Path(init["store"])), str(init["repository"])

    def one(job: dict[str, Any]) -> str | None:
        return put_blob(store, client, repo, Descriptor.from_dict(job["push"]), job.get("mount"), reporter)  # type: ignore[arg-type]

    return one


def serve(init: dict[str, Any], jobs: IO[str], out: IO[str]) -> None:
    """Run the jobs read from ``jobs`` on ``init["threads"]`` threads until it ends."""
    channel = _Channel(out)
    reporter = _Reporter(channel)
    if init.get("nice"):
        from gpusnap.host.priority import yield_cpu

        yield_cpu(int(init["nice"]))  # before the pool: its threads inherit this thread's value
    one = _pusher(init, reporter) if init.get("role") == "push" else _fetcher(init, reporter)

    def run(job: dict[str, Any]) -> None:
        try:
            how = one(job)
            reporter.flush()
            channel.send({"id": job["id"], "ok": True, **({"how": how} if how is not None else {})})
        except Aborted:
            channel.send({"id": job["id"], "error": "Aborted", "message": "stopped"})
        except GpusnapError as exc:
            reporter.flush()
            channel.send({"id": job["id"], "error": type(exc).__name__, "message": str(exc)})
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it there
            reporter.flush()
            channel.send({"id": job["id"], "error": "GpusnapError", "message": f"a transfer process failed: {exc!r}"})

    with ThreadPoolExecutor(max_workers=max(1, int(init["threads"]))) as pool:
        for line in jobs:
            pool.submit(run, json.loads(line))


def main() -> int:
    parent = os.getppid()
    _die_with_parent(parent)
    try:
        init = json.loads(sys.stdin.readline())
    except ValueError:  # the parent is gone (stdin closed before a word was said)
        return 1
    if parent != int(init["parent"]):  # it died before this process was watching it
        return 1
    serve(init, sys.stdin, sys.stdout)
    return 0


def run() -> None:
    """main, then the end of the process without the interpreter's teardown (the parent waits
    for that: ~35 ms of a push's tail on the VM; gpusnap.process_exit says why). Every blob is
    answered by then, serve's pool joined; the thread watching the parent is the only other."""
    code = main()
    try:
        sys.stdout.flush()
    except OSError:  # the parent is gone: nothing to tell it
        pass
    os._exit(code)


if __name__ == "__main__":
    run()
