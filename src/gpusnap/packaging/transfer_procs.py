"""The parent's side of transfer processes (gpusnap.packaging.transfer_worker says why they exist).

:class:`TransferProcesses` starts the workers and hands out blobs one at a time to the least
busy one, returning when its transfer is done and raising what the worker raised. Two roles:

- ``fetch`` (a restore from a registry): the workers hold the image directory's files open;
  :meth:`run` returns when a blob is downloaded, written and verified. Called from the fetch's
  own pool threads, so the order of the jobs, the staging and the first-failure-stops-all rule
  stay those of :func:`gpusnap.packaging.fetch._run_all`. Any failure or stop kills them all
  (their half-written pieces are in a directory the fetch removes).
- ``push``: the workers read blobs from the store; :meth:`push` returns once a blob is on the
  registry (asked about, mounted or uploaded) and says how.

A worker that dies fails its blobs with a one-line error; the others carry on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import asdict
from typing import IO, TYPE_CHECKING, Any

from gpusnap import errors
from gpusnap.host.cores import usable_cores
from gpusnap.packaging import layout as lay
from gpusnap.packaging.store import Descriptor

if TYPE_CHECKING:  # registry starts these processes: no import circle
    from gpusnap.packaging.registry import RegistryClient

# Below this many bytes of blobs a fetch stays in its own process: a worker takes a few hundred
# milliseconds to start, which a small pull does not win back.
MIN_BYTES = 512 << 20
# Streams per worker: one interpreter kept 4 streams fed at ~1.9 GB/s, and 4 such processes
# reached 4.4 GB/s together on 16 cores (bench/results/gpu-h100-pull-2026-11-25). One worker per
# 2 cores: receiving into mappings on the H100 host, 8 workers pulled 3.33 GB/s against 2.92 for
# 4 (bench/results/gpu-h100-e2e-2026-11-25b); each adds ~35 MiB of resident interpreter.
THREADS_PER_PROCESS = 4
CORES_PER_PROCESS = 2
MAX_PROCESSES = 8


# A push keeps the registry client's 8 streams (registry.WORKERS) in this many processes
# of 4 threads: enough to take the uploads' interpreter work off the store's process, which
# hashes and writes the pages beside them (bench/results/gpu-h100-e2e-2026-11-27-eleventh-server).
PUSH_PROCESSES = 2
# Below this many cores the cores, not one interpreter's lock, limit a transfer.
MIN_CORES = 4


class WorkerDied(errors.GpusnapError):
    """The transfer process a blob was given to ended before answering (killed, out of memory,
    or it could not start). The blob's transfer may be run again elsewhere: a push does it in
    its own process."""


class Aborted(Exception):
    """The fetch stopped (another transfer failed, or its caller's cancel) while this blob
    was out: not an error of its own."""


def auto_processes(blob_bytes: int, cores: int | None = None) -> int:
    """How many transfer processes a fetch of ``blob_bytes`` uses on its own: none on a small
    pull or a host of under 4 cores (there the cores, not the interpreter lock, are the limit),
    else one per CORES_PER_PROCESS cores (at least 2, at most MAX_PROCESSES)."""
    cores = cores or usable_cores()
    if blob_bytes < MIN_BYTES or cores < MIN_CORES:
        return 0
    return max(2, min(MAX_PROCESSES, cores // CORES_PER_PROCESS))


def push_processes(blob_bytes: int | None, cores: int | None = None) -> int:
    """How many transfer processes a push uses on its own: none on a host of under MIN_CORES
    cores or for under MIN_BYTES of blobs, else PUSH_PROCESSES. ``blob_bytes`` None: not known
    yet (``checkpoint --push`` starts them before the dump, beside the runtime's start, so that
    they are ready when the first pack is)."""
    cores = cores or usable_cores()
    if cores < MIN_CORES or (blob_bytes is not None and blob_bytes < MIN_BYTES):
        return 0
    return PUSH_PROCESSES


class _Worker:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.busy = 0
        self.dead = False
        self.pending: dict[int, Future[Any]] = {}
        self.reader: threading.Thread | None = None


class TransferProcesses:
    """``fds`` (fetch): the image directory's files, by path, open in every worker. ``store``
    (push): the root of the store the blobs are read from. ``nice``: the workers' nice value."""

    def __init__(self, client: RegistryClient, repository: str, fds: dict[str, int], processes: int, *,
                 on_bytes: Callable[[int], None], on_total: Callable[[int], None], stopped: Callable[[], bool],
                 threads: int = THREADS_PER_PROCESS, map_files: bool = False, store: str | None = None,
                 nice: int = 0) -> None:
        self.stopped = stopped
        self.role = "push" if store is not None else "fetch"
        self._on_bytes, self._on_total = on_bytes, on_total
        self._lock = threading.Lock()
        self._next = 0
        self._closed = False
        self.slots = processes * threads
        init = {
            "parent": os.getpid(), "registry": client.registry, "insecure": client.base.startswith("http://"),
            "credentials": asdict(client.creds) if client.creds else None, "auth": client.auth_state(),
            "retries": client.retries, "backoff_s": client.backoff_s, "timeout_s": client.timeout_s,
            "reached": client.reached,
            "monolithic_limit": client.monolithic_limit, "patch_size": client.patch_size,
            "repository": repository, "fds": fds, "threads": threads, "map": map_files,
            "role": self.role, "store": store, "nice": nice,
        }
        self.workers: list[_Worker] = []
        try:
            for _ in range(processes):
                # stderr to /dev/null: a worker says what went wrong on stdout, as one line the
                # parent raises; nothing of it should reach the user's terminal.
                proc = subprocess.Popen([sys.executable, "-m", "gpusnap.packaging.transfer_worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, pass_fds=tuple(fds.values()),
                                        text=True, bufsize=1)
                w = _Worker(proc)
                self.workers.append(w)
                self._send(w, init)
                w.reader = threading.Thread(target=self._read, args=(w,), name="gpusnap-transfer-reader", daemon=True)
                w.reader.start()
        except BaseException:
            self.close(kill=True)
            raise

    def _send(self, w: _Worker, message: dict[str, Any]) -> None:
        stdin: IO[str] = w.proc.stdin  # type: ignore[assignment]
        stdin.write(json.dumps(message) + "\n")
        stdin.flush()

    def _read(self, w: _Worker) -> None:
        stdout: IO[str] = w.proc.stdout  # type: ignore[assignment]
        for line in stdout:
            msg = json.loads(line)
            if "n" in msg:
                self._on_bytes(int(msg["n"]))
            elif "total" in msg:
                self._on_total(int(msg["total"]))
            else:
                with self._lock:
                    fut = w.pending.pop(int(msg["id"]), None)
                if fut is None:
                    continue
                if msg.get("ok"):
                    fut.set_result(msg.get("how"))
                else:
                    fut.set_exception(_error(msg))
        code = w.proc.wait()
        with self._lock:
            w.dead = True
            left, w.pending = list(w.pending.values()), {}
            closed = self._closed
        for fut in left:
            fut.set_exception(Aborted() if closed or self.stopped() else WorkerDied(
                f"a {self._what} transfer process ended unexpectedly (exit status {code}); try again"))

    @property
    def _what(self) -> str:
        return "pull" if self.role == "fetch" else "push"

    def run(self, bp: lay.BlobPlan) -> None:
        """Download and write ``bp`` in a worker; raises what the worker raised, or
        :class:`Aborted` if the fetch stopped meanwhile."""
        self._job({"blob": bp.to_wire()})

    def push(self, desc: Descriptor, mount_from: str | None) -> str:
        """Put the store's blob ``desc`` on the registry from a worker (HEAD, then a mount from
        ``mount_from`` if given, then an upload): "skipped", "mounted" or "uploaded"."""
        return str(self._job({"push": desc.to_dict(), "mount": mount_from}))

    def _job(self, payload: dict[str, Any]) -> Any:
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise Aborted()
            alive = [x for x in self.workers if not x.dead]
            if not alive:
                raise WorkerDied(f"every {self._what} transfer process ended unexpectedly; try again")
            w = min(alive, key=lambda x: x.busy)
            w.busy += 1
            job = self._next
            self._next += 1
            w.pending[job] = fut
        try:
            try:
                self._send(w, {"id": job, **payload})
            except OSError:  # the worker is gone; its reader fails the job
                pass
            while not wait_futures([fut], timeout=0.1).done:
                if self.stopped():
                    self.close(kill=True)  # a stop ends every transfer now, not after its blob
            return fut.result()
        finally:
            with self._lock:
                w.busy -= 1

    def close(self, kill: bool = False) -> None:
        """No more work: let the workers finish and exit (``kill``: end them now)."""
        with self._lock:
            if self._closed and not kill:
                return
            self._closed = True
        for w in self.workers:
            if kill and w.proc.poll() is None:
                w.proc.kill()
            try:
                if w.proc.stdin is not None:
                    w.proc.stdin.close()
            except OSError:
                pass
        for w in self.workers:
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            if w.reader is not None and w.reader is not threading.current_thread():
                w.reader.join(timeout=5)


def _error(msg: dict[str, Any]) -> BaseException:
    name, text = str(msg.get("error")), str(msg.get("message"))
    if name == "Aborted":
        return Aborted()
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.GpusnapError):
        return cls(text)
    return errors.GpusnapError(text)
