#!/usr/bin/env python3
"""End to end: gpusnap's user paths next to the floors and the by-hand checkpoint, in one run.

    sudo .venv/bin/python bench/e2e.py                 CPU containers (this machine)
    sudo python3 bench/e2e.py --gpu [--workloads server,train]   GPU machine

Floors, measured first in the same run: memcpy, SHA-256 (one core, and all cores at once),
disk write with fsync (the store's filesystem), loopback HTTP to a real local docker-registry
(one stream and parallel streams, both ways).

For each workload (CPU: a python process holding random, zero and constant memory; GPU: an
inference server, GPT-2 large fp32 loaded from safetensors and compiled with torch.compile, and
GPT-2 124M AdamW training holding ~20 GB):

1. by hand: the workload in a plain runc container, ``runc checkpoint --leave-running`` (on a
   GPU, around it the CUDA driver's checkpoint API on the container's process: lock,
   checkpoint, and after the dump restore + unlock), ``runc delete``, ``runc restore`` (+ driver
   restore, unlock) to the first line the workload prints after it;
2. the user's paths, all through the ``gpusnap`` CLI: ``gpusnap run NAME --rootfs-overlay /``
   (cold start: to the first step/token), ``gpusnap checkpoint --leave-running --push`` with an
   empty store and an empty registry (store and push as its own timings say), a second one 3 s
   later (what it adds to the registry's disk and to the store, as % of the first),
   ``gpusnap restore REF`` from the local store, and ``gpusnap restore REMOTE`` with an empty
   store, each timed to the first line the workload prints after it, with every printed value
   compared with the other runs' at the same step (the workloads are deterministic);
3. ``python -m gpusnap.packaging.ckdiff`` between the two checkpoints (what changed, what a
   page-level dedup would send).

Where the bytes go: gpusnap's CRIU images (GPUSNAP_STATE_DIR, --state-dir) and the by-hand
images on tmpfs (/dev/shm), the stores on disk (--work; the disk floor is measured there), the
registry's storage under --work or --registry-dir (tmpfs on the GPU machine, whose 64 GB disk
cannot hold a 20 GB checkpoint three times).

Every gpusnap command's peak RSS: its own VmHWM (sampled) and the largest of it and the
children it waited for (wait4). Prints each stage's GB/s, each ratio against its floor or by-hand
peer, and the issue's targets with PASS/FAIL; writes e2e.json and e2e.log to
bench/results/<host>-<date>/ (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = REPO / "bench" / "workloads"
sys.path.insert(0, str(REPO / "tests"))

from stack.registry import REGISTRY_BIN, Registry  # noqa: E402

E2E_PORTS = range(5460, 5490)  # apart from the suites' ranges (tests/stack/registry.py)
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NVIDIA_DIR = Path("/usr/local/nvidia")
NVIDIA_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
STEP_RE = re.compile(r"^step (\d+) (\S+) t=([\d.]+)$")
GIB = 1 << 30
MIB = 1 << 20

LOG: list[str] = []


def say(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    LOG.append(line)


# -- processes -----------------------------------------------------------------------------------

@dataclass
class Cmd:
    argv: list[str]
    rc: int
    seconds: float
    start: float  # epoch
    stdout: str
    stderr: str
    rss_own: int  # the process's own VmHWM, sampled every 20 ms
    rss_tree: int  # wait4's ru_maxrss: the largest of it and the children it waited for

    def json(self) -> dict[str, Any]:
        # Only the lines of the JSON document: a profiler wrapping the command (--py-spy)
        # prints its own lines on stdout around it.
        text = "\n".join(line for line in self.stdout.splitlines() if not line.startswith("py-spy> "))
        try:
            return json.loads(text)
        except ValueError:
            return {}

    def check(self) -> "Cmd":
        if self.rc != 0:
            raise RuntimeError(f"{' '.join(self.argv)} exited {self.rc}: {self.stderr.strip()[-1500:]}")
        return self


def _hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(argv: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> Cmd:
    """Run ``argv`` to its end: wall time, output, and peak RSS (see :class:`Cmd`)."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    start = time.time()
    t0 = time.perf_counter()
    # preexec_fn keeps subprocess from using vfork: a vforked child's ru_maxrss starts at the
    # parent's high-water mark.
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, preexec_fn=lambda: None)
    peak, rc, rusage = 0, None, None
    while rc is None:
        peak = max(peak, _hwm(proc.pid))
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            rc, rusage = os.waitstatus_to_exitcode(status), ru
            proc.returncode = rc
            break
        if time.perf_counter() - t0 > timeout:
            proc.kill()
        time.sleep(0.02)
    secs = time.perf_counter() - t0
    out.seek(0)
    err.seek(0)
    return Cmd(argv, rc, secs, start, out.read().decode(errors="replace"), err.read().decode(errors="replace"), peak,
               rusage.ru_maxrss * 1024 if rusage else 0)


class Pressure:
    """What the host went through while something ran: the kernel's pressure-stall totals
    (/proc/pressure: seconds in which some task, or every task, waited for memory, I/O or CPU),
    the reclaim counters (/proc/vmstat: pages the allocating tasks had to scan and free
    themselves, and kswapd's) and, sampled every 0.1 s, the lowest MemAvailable and the most
    dirty and under-writeback page cache. Tells whether CRIU's dump beside the store and the
    uploads slowed because memory ran short (direct reclaim), the disk or the CPU.

    What none of those counters sees is memory bandwidth: a canary copies CANARY bytes every
    0.1 s (a light load: ~0.16 GB/s) and keeps each copy's GB/s; its median while a command
    runs, against its median with nothing running (:meth:`idle_canary`), says how much of the
    memory bus the command's processes took."""

    CANARY = 16 * 1024 * 1024

    VMSTAT = ("allocstall_normal", "allocstall_movable", "allocstall_dma32", "pgscan_direct", "pgsteal_direct",
              "pgscan_kswapd", "pgsteal_kswapd", "compact_stall")

    def __init__(self) -> None:
        self.low_avail, self.high_dirty = float("inf"), 0
        self.canary: list[float] = []
        self._src, self._dst = bytearray(os.urandom(1024)) * (self.CANARY // 1024), bytearray(self.CANARY)
        self._dst[:] = self._src  # its pages faulted in now, not in the first sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0
        self._start: dict[str, int] = {}
        self.summary: dict[str, float] = {}

    @staticmethod
    def _counters() -> dict[str, int]:
        out: dict[str, int] = {}
        for kind in ("memory", "io", "cpu"):
            try:
                for line in Path(f"/proc/pressure/{kind}").read_text().splitlines():
                    f = line.split()
                    out[f"{kind}_{f[0]}"] = int(f[-1].split("=")[1])  # total=microseconds
            except (OSError, IndexError, ValueError):
                pass
        try:
            for line in Path("/proc/vmstat").read_text().splitlines():
                k, _, v = line.partition(" ")
                if k in Pressure.VMSTAT:
                    out[k] = int(v)
        except OSError:
            pass
        return out

    @staticmethod
    def _meminfo() -> dict[str, int]:
        out = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("MemAvailable", "Dirty", "Writeback"):
                out[k] = int(v.split()[0]) * 1024
        return out

    def _copy_gbps(self) -> float:
        t = time.perf_counter()
        self._dst[:] = self._src  # one memcpy
        return self.CANARY / (time.perf_counter() - t) / 1e9

    def _run(self) -> None:
        while not self._stop.is_set():
            m = self._meminfo()
            self.low_avail = min(self.low_avail, m.get("MemAvailable", self.low_avail))
            self.high_dirty = max(self.high_dirty, m.get("Dirty", 0) + m.get("Writeback", 0))
            self.canary.append(self._copy_gbps())
            self._stop.wait(0.1)

    @classmethod
    def idle_canary(cls, seconds: float = 3.0) -> float:
        """The canary's median GB/s with nothing else running (the baseline for its medians)."""
        p = cls()
        got = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            got.append(p._copy_gbps())
            time.sleep(0.1)
        return statistics.median(got)

    def __enter__(self) -> "Pressure":
        self._start, self._t0 = self._counters(), time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        end, secs = self._counters(), time.perf_counter() - self._t0
        d = {k: end[k] - self._start[k] for k in end if k in self._start}
        page = os.sysconf("SC_PAGE_SIZE")
        s: dict[str, float] = {"seconds": round(secs, 2)}
        for k in ("memory_some", "memory_full", "io_some", "io_full", "cpu_some"):
            if k in d:
                s[f"{k}_s"] = round(d[k] / 1e6, 2)
        s["direct_reclaim_gb"] = round(d.get("pgsteal_direct", 0) * page / 1e9, 2)
        s["direct_scan_gb"] = round(d.get("pgscan_direct", 0) * page / 1e9, 2)
        s["kswapd_reclaim_gb"] = round(d.get("pgsteal_kswapd", 0) * page / 1e9, 2)
        s["allocstalls"] = sum(d.get(k, 0) for k in self.VMSTAT if k.startswith("allocstall"))
        s["compact_stalls"] = d.get("compact_stall", 0)
        if self.low_avail != float("inf"):
            s["min_available_gb"] = round(self.low_avail / 1e9, 1)
        s["max_dirty_gb"] = round(self.high_dirty / 1e9, 2)
        if self.canary:
            s["canary_gbps_median"] = round(statistics.median(self.canary), 2)
            s["canary_gbps_p10"] = round(sorted(self.canary)[len(self.canary) // 10], 2)
        self.summary = s


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def gb(n: float) -> float:
    return n / 1e9


# -- floors (each in its own process: the parent's memory stays small for wait4's figures) -----------

def floor_memcpy(size: int) -> dict[str, float]:
    src = bytearray(random.Random(1).randbytes(64 * MIB)) * (size // (64 * MIB))
    dst = bytearray(len(src))
    dst[:] = src  # first touch
    best = min(_timed(lambda: dst.__setitem__(slice(None), src)) for _ in range(3))
    return {"memcpy_gbps": gb(len(src)) / best}


def floor_sha256(size: int) -> dict[str, float]:
    buf = random.Random(2).randbytes(64 * MIB) * 4
    reps = max(1, size // len(buf))

    def work() -> None:
        for _ in range(reps):
            hashlib.sha256(buf).digest()

    one = _timed(work)
    cores = os.cpu_count() or 1
    threads = [threading.Thread(target=work) for _ in range(cores)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    allc = time.perf_counter() - t0
    per_core = gb(len(buf) * reps) / one
    return {"sha256_gbps_1core": per_core, "sha256_gbps_x_cores": per_core * cores, "sha256_gbps_all_cores_measured": gb(len(buf) * reps * cores) / allc,
            "cores": cores}


def floor_disk(size: int, directory: str, writers: tuple[int, ...] = (1, 4)) -> dict[str, float]:
    """Buffered writes of ``size`` random bytes, each writer to its own file, then fdatasync, after
    a sync: what the store's disk takes, as the store writes (packs side by side, each synced).
    One writer, then several; then as many again, each asking the kernel to start writing every
    block back as soon as it is written (sync_file_range, as the store does): without that the
    disk idles while the page cache fills, and a store that keeps it busy beat the plain floor
    (bench/results/gpu-h100-e2e-2026-11-27-thirteenth-server, store-probe). The GPU hosts' virtio
    disk took 1.16 GB/s from one plain writer and 2.01 from four (O_DIRECT no better:
    1.22-1.62). ``disk_write_gbps`` is the best of them, the floor the store is held to."""
    from gpusnap.packaging.store import _start_writeback

    block = random.Random(3).randbytes(8 * MIB)
    out: dict[str, float] = {}
    for n, kick in [*((w, False) for w in writers), (max(writers), True)]:
        os.sync()  # what others left dirty is not this case's to write
        paths = [Path(directory) / f"e2e-floor-{os.getpid()}-{i}" for i in range(n)]

        def write(path: Path, blocks: int) -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for i in range(blocks):
                    os.write(fd, block)
                    if kick:
                        _start_writeback(fd, i * len(block), len(block))
                os.fdatasync(fd)
            finally:
                os.close(fd)

        blocks = max(1, size // len(block) // n)
        threads = [threading.Thread(target=write, args=(p, blocks)) for p in paths]
        t0 = time.perf_counter()
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            secs = time.perf_counter() - t0
        finally:
            for p in paths:
                p.unlink(missing_ok=True)
        out[f"disk_write_gbps_{n}_writer{'s' if n > 1 else ''}{'_writeback' if kick else ''}"] = gb(blocks * n * len(block)) / secs
    out["disk_write_gbps"] = max(out.values())
    return out


def floor_python(gpusnap: str, runs: int = 7) -> dict[str, float]:
    """What each of the two Python processes of a checkpoint (the CLI, the runtime shim) pays
    before its first line: this interpreter's start as installed (site, .pth files), without
    site (-I -S), and `gpusnap --version` (the CLI's imports and typer's app). Medians, seconds."""
    def median_of(argv: list[str]) -> float:
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return {"python_start_s": median_of([sys.executable, "-c", "pass"]),
            "python_start_no_site_s": median_of([sys.executable, "-I", "-S", "-c", "pass"]),
            "gpusnap_version_s": median_of([gpusnap, "--version"])}


def floor_http(size: int, host: str, streams: int, registry_pid: int = 0) -> dict[str, float]:
    """Blob uploads (monolithic PUT) and downloads against the registry: one stream, then
    ``streams`` at once, each its own connection; digests computed before the clock starts.
    Plain http.client, sending and reading 8 MiB / 1 MiB at a time: the least a Python client
    can cost. With ``registry_pid``, also the registry process's CPU seconds per GB received and
    sent (what a push or pull to a registry on this host costs its cores whoever the client)."""

    block = random.Random(4).randbytes(8 * MIB)

    def blob(i: int, n: int) -> tuple[bytes, str]:
        head = f"e2e-floor-{i}-{time.time()}".encode().ljust(4096, b"\0")
        h = hashlib.sha256(head)
        for _ in range(n):
            h.update(block)
        return head, "sha256:" + h.hexdigest()

    import http.client
    from urllib.parse import urlsplit

    def upload(i: int, n: int, head: bytes, digest: str) -> None:
        conn = http.client.HTTPConnection(host, timeout=600)
        conn.request("POST", "/v2/e2e/floor/blobs/uploads/")
        r = conn.getresponse()
        r.read()
        if r.status != 202:
            raise RuntimeError(f"upload start: HTTP {r.status}")
        loc = urlsplit(r.getheader("Location", ""))
        path = loc.path + "?" + (loc.query + "&" if loc.query else "") + f"digest={digest}"
        conn.putrequest("PUT", path)
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(len(head) + n * len(block)))
        conn.endheaders()
        conn.send(head)
        for _ in range(n):
            conn.send(block)
        r = conn.getresponse()
        r.read()
        conn.close()
        if r.status != 201:
            raise RuntimeError(f"upload: HTTP {r.status}")

    def download(digest: str, expect: int) -> None:
        conn = http.client.HTTPConnection(host, timeout=600)
        conn.request("GET", f"/v2/e2e/floor/blobs/{digest}")
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"download: HTTP {r.status}")
        buf = bytearray(1 * MIB)
        got = 0
        while k := r.readinto(buf):
            got += k
        conn.close()
        if got != expect:
            raise RuntimeError(f"downloaded {got} bytes of {digest}, expected {expect}")

    def run(parallel: int) -> tuple[float, float, float, float]:
        """Upload and download GB/s, and the registry's CPU seconds per GB for each."""
        n = max(1, size // len(block) // parallel)
        blobs = [blob(i, n) for i in range(parallel)]
        total = parallel * (n * len(block) + 4096)

        def many(fn, args_list):  # type: ignore[no-untyped-def]
            errors: list[BaseException] = []

            def guarded(*a):  # type: ignore[no-untyped-def]
                try:
                    fn(*a)
                except BaseException as exc:  # noqa: BLE001 - raised in the caller below
                    errors.append(exc)

            ts = [threading.Thread(target=guarded, args=a) for a in args_list]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if errors:
                raise errors[0]
            return time.perf_counter() - t0

        c0 = pid_cpu_s(registry_pid)
        up = many(upload, [(i, n, h, d) for i, (h, d) in enumerate(blobs)])
        c1 = pid_cpu_s(registry_pid)
        down = many(download, [(d, n * len(block) + 4096) for _, d in blobs])
        return gb(total) / up, gb(total) / down, (c1 - c0) / gb(total), (pid_cpu_s(registry_pid) - c1) / gb(total)

    up1, down1, _, _ = run(1)
    upn, downn, cpu_up, cpu_down = run(streams)
    out = {"http_up_gbps_1": up1, "http_down_gbps_1": down1, f"http_up_gbps_{streams}": upn, f"http_down_gbps_{streams}": downn, "http_streams": streams}
    if registry_pid:
        out |= {"registry_cpu_s_per_gb_up": cpu_up, "registry_cpu_s_per_gb_down": cpu_down}
    return out


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_floor(name: str, **kw: Any) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--floor", name, "--floor-args", json.dumps(kw)]
    c = measure(argv, timeout=600)
    if c.rc != 0:
        say(f"floor {name} failed: {c.stderr.strip()[-500:]}")
        return {}
    res = json.loads(c.stdout.strip().splitlines()[-1])
    say(f"floor {name}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()))
    return res


# -- workload output -------------------------------------------------------------------------------

def parse_steps(text: str) -> list[tuple[int, str, float]]:
    out = []
    for line in text.splitlines():
        m = STEP_RE.match(line.strip())
        if m:
            out.append((int(m.group(1)), m.group(2), float(m.group(3))))
    return out


@dataclass
class Values:
    """step → value over every run of one workload; a restored run must agree with the others."""

    rel_tol: float = 0.0  # numbers within this relative distance count as equal (0: exact text)
    seen: dict[int, str] = field(default_factory=dict)

    def equal(self, a: str, b: str) -> bool:
        if a == b:
            return True
        if not self.rel_tol:
            return False
        try:
            x, y = float(a), float(b)
        except ValueError:
            return False
        return abs(x - y) <= self.rel_tol * max(abs(x), abs(y))

    def compare(self, steps: list[tuple[int, str, float]]) -> tuple[int, int]:
        same = differ = 0
        for n, v, _ in steps:
            if n in self.seen:
                if self.equal(self.seen[n], v):
                    same += 1
                else:
                    differ += 1
            else:
                self.seen[n] = v
        return same, differ


# -- the by-hand peer --------------------------------------------------------------------------------

class CudaDriver:
    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        (err,) = cu.cuInit(0)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        self.cu = cu

    def _ok(self, res: Any, what: str) -> None:
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise RuntimeError(f"{what}: {err}")

    def lock_checkpoint(self, pid: int) -> None:
        args = self.cu.CUcheckpointLockArgs()
        args.timeoutMs = 10_000
        self._ok(self.cu.cuCheckpointProcessLock(pid, args), "cuCheckpointProcessLock")
        self._ok(self.cu.cuCheckpointProcessCheckpoint(pid, None), "cuCheckpointProcessCheckpoint")

    def restore_unlock(self, pid: int) -> None:
        self._ok(self.cu.cuCheckpointProcessRestore(pid, None), "cuCheckpointProcessRestore")
        self._ok(self.cu.cuCheckpointProcessUnlock(pid, None), "cuCheckpointProcessUnlock")


class Reader:
    """Collects a container's stdout (a pipe) line by line in a thread."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                self.text += data.decode(errors="replace")


class BareContainer:
    """The workload in a plain runc container (overlay of / like gpusnap's), by-hand steps."""

    def __init__(self, work: Path, argv: list[str], gpu: bool, runc: str) -> None:
        self.dir = work / "bare"
        self.name = f"e2e-bare-{os.getpid()}"
        self.argv, self.gpu, self.runc = argv, gpu, runc
        self.root = self.dir / "runc-root"
        self.bundle = self.dir / "bundle"
        self.readers: list[Reader] = []
        self.fds: list[int] = []
        self.parts: dict[str, float] = {}
        self.log_dir: Path | None = None  # --criu-logs: each runc checkpoint's dump.log copied here
        self.dumps = 0
        self.mounted = False

    def _runc(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.runc, "--root", str(self.root), *args], capture_output=True, text=True, timeout=900, **kw)

    def _pipes(self) -> dict[str, int]:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        self.fds += [in_r, in_w, out_r, out_w]
        self.readers.append(Reader(out_r))
        return {"stdin": in_r, "stdout": out_w, "stderr": out_w}

    def start(self) -> None:
        rootfs = self.bundle / "rootfs"
        for d in (rootfs, self.root, self.dir / "upper", self.dir / "ovl-work"):
            d.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir=/,upperdir={self.dir / 'upper'},workdir={self.dir / 'ovl-work'}", str(rootfs)], check=True)
        self.mounted = True
        subprocess.run([self.runc, "spec"], cwd=self.bundle, check=True)
        spec = json.loads((self.bundle / "config.json").read_text())
        env = [f"PATH={os.path.dirname(self.argv[0])}:{HOST_PATH}", "HOME=/root", "PYTHONUNBUFFERED=1", "HF_HUB_OFFLINE=1", "HF_HUB_DISABLE_PROGRESS_BARS=1", "TRANSFORMERS_VERBOSITY=error"]
        spec["process"].update(terminal=False, args=self.argv, env=env, cwd="/")
        spec["root"] = {"path": "rootfs", "readonly": False}
        # No network namespace: CRIU then needs no network lock (the GPU machine has no iptables).
        spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
        if self.gpu:
            env.append(f"LD_LIBRARY_PATH={NVIDIA_DIR / 'lib64'}")
            if NVIDIA_DIR.is_dir():
                spec["mounts"].append({"destination": str(NVIDIA_DIR), "source": str(NVIDIA_DIR), "type": "bind", "options": ["rbind", "ro"]})
            for node in [*NVIDIA_CONTROL_NODES, *sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))]:
                if not os.path.exists(node):
                    continue
                st = os.stat(node)
                major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
                spec["linux"].setdefault("devices", []).append({"path": node, "type": "c", "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0})
                spec["linux"].setdefault("resources", {}).setdefault("devices", []).append({"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"})
        conf = self.dir / "criu.conf"
        conf.write_text("link-remap\n")  # what gpusnap's runtime gives its containers, by hand
        spec.setdefault("annotations", {})["org.criu.config"] = str(conf)
        (self.bundle / "config.json").write_text(json.dumps(spec, indent=1))
        subprocess.run([self.runc, "--root", str(self.root), "run", "-d", "--bundle", str(self.bundle), self.name], check=True, timeout=300, **self._pipes())

    def output(self) -> str:
        return "".join(r.text for r in self.readers)

    def pid(self) -> int:
        st = json.loads(self._runc("state", self.name).stdout)
        return int(st["pid"])

    def running(self) -> bool:
        p = self._runc("state", self.name)
        return p.returncode == 0 and json.loads(p.stdout).get("status") == "running"

    def checkpoint(self, images: Path, cuda: CudaDriver | None) -> float:
        """Leave-running checkpoint, as ``gpusnap checkpoint --leave-running`` does it; its parts
        in ``self.parts``."""
        pid = self.pid()
        t0 = time.perf_counter()
        if cuda:
            cuda.lock_checkpoint(pid)
        t1 = time.perf_counter()
        p = self._runc("checkpoint", "--leave-running", "--image-path", str(images), "--work-path", str(self.dir / "criu-work"), self.name)
        t2 = time.perf_counter()
        if cuda:
            cuda.restore_unlock(pid)
        secs = time.perf_counter() - t0
        self.parts = {"lock, GPU to host": round(t1 - t0, 3), "runc checkpoint": round(t2 - t1, 3), "host to GPU, unlock": round(t0 + secs - t2, 3)}
        if p.returncode:
            raise RuntimeError(f"runc checkpoint: {p.stderr.strip()[-1500:]}")
        if self.log_dir is not None:  # --criu-logs: beside gpusnap's (GPUSNAP_CRIU_LOG_DIR)
            self.dumps += 1
            self.log_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.dir / "criu-work" / "dump.log", self.log_dir / f"by-hand-{self.dir.parent.name}-{self.dumps}-dump.log")
        return secs

    def restore(self, images: Path, cuda: CudaDriver | None) -> tuple[float, float]:
        """runc restore (+ driver restore, unlock); (seconds of the commands, epoch started)."""
        self._runc("delete", "--force", self.name)
        start = time.time()
        t0 = time.perf_counter()
        p = subprocess.run([self.runc, "--root", str(self.root), "restore", "-d", "--bundle", str(self.bundle), "--image-path", str(images),
                            "--work-path", str(self.dir / "criu-work-r"), self.name], timeout=900, **self._pipes())
        if p.returncode:
            raise RuntimeError(f"runc restore exited {p.returncode}: {self.output()[-1500:]}")
        if cuda:
            cuda.restore_unlock(self.pid())
        return time.perf_counter() - t0, start

    def cleanup(self) -> None:
        self._runc("delete", "--force", self.name)
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.bundle / "rootfs")], check=False)
            self.mounted = False
        shutil.rmtree(self.dir, ignore_errors=True)


def measured_package(gpusnap: str) -> tuple[str, str] | str:
    """(interpreter, package directory) of the gpusnap that the command ``gpusnap`` runs (its
    script's #! line), or why it cannot be told."""
    try:
        first = Path(gpusnap).read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return f"{gpusnap} unreadable"
    python = first[2:].strip().split()[0] if first.startswith("#!") else sys.executable
    where = subprocess.run([python, "-c", "import gpusnap, os; print(os.path.dirname(gpusnap.__file__))"], capture_output=True, text=True)
    if where.returncode:
        return f"{python} cannot import gpusnap"
    return python, where.stdout.strip()


def byte_compile(found: tuple[str, str] | str) -> str:
    """Write the bytecode of the gpusnap package the measured commands import, as a pip install
    does: an editable install, or a wheel installed with --no-compile, under
    PYTHONDONTWRITEBYTECODE=1 (set on this project's machines) compiles every module from source
    in every gpusnap, gpusnap-runtime and gpusnap-hook process (~0.15 s a command on the 2-core
    VM), which no installed gpusnap pays. ``found``: :func:`measured_package`. Returns what
    was done, for the log."""
    if isinstance(found, str):
        return f"not compiled ({found})"
    python, pkg = found
    done = subprocess.run([python, "-m", "compileall", "-q", pkg], capture_output=True, text=True)
    return f"compiled {pkg} with {python}" if done.returncode == 0 else f"compileall failed: {done.stderr.strip()[-200:]}"


def wait_until(pred, timeout: float, what: str, interval: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = pred()
        if res:
            return res
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


# -- one workload ------------------------------------------------------------------------------------

@dataclass
class Workload:
    name: str
    argv: list[str]
    gpu: bool
    ready_timeout: float
    warm_steps: int  # steps to wait for before the first checkpoint
    diff: bool = True  # run ckdiff between the two checkpoints
    second_checkpoint: bool = True
    bare_rounds: int = 2  # by-hand checkpoint + restore cycles; the restore figure is their mean
    # Leave-running by-hand checkpoints of the running process before those cycles, the first not
    # counted; with 2 or more, they (not the cycles' checkpoints) are the by-hand checkpoint
    # figure. gpusnap's measured checkpoint is the third leave-running dump of a process that was
    # never restored; the cycles' first dump is the first on the host and the second that of a
    # restored process, and in 24 of 26 server runs the first was slower (by 0.9 s on average).
    bare_running: int = 0
    store_only: bool = True  # a checkpoint without --push first, for the store's own speed
    # Training's losses may differ in the last digits between runs where a kernel has no
    # deterministic variant (use_deterministic_algorithms warns only); a restore that went
    # wrong is off by far more (every step draws other data).
    rel_tol: float = 0.0
    growth_target: float | None = None  # second checkpoint, % of the first push's registry bytes
    cold_start_target: float | None = None  # cold start / restore


@dataclass
class Env:
    args: argparse.Namespace
    work: Path
    gpusnap: list[str]
    runc: str
    registry: Registry
    cuda: CudaDriver | None
    deadline: float
    results: dict[str, Any]
    alt_registry: Registry | None = None  # --ab-registry: a second registry program, beside the first

    def cli_env(self, store: Path) -> dict[str, str]:
        logs = self.criu_log_dir()
        return {**os.environ, "GPUSNAP_STORE": str(store), "GPUSNAP_RUN_DIR": str(self.work / "run"),
                "GPUSNAP_STATE_DIR": str(self.args.state_dir), "GPUSNAP_CONFIG": "/nonexistent/gpusnap.toml",
                **({"GPUSNAP_CRIU_LOG_DIR": str(logs)} if logs is not None else {})}

    def criu_log_dir(self) -> Path | None:
        """--criu-logs: where every CRIU dump.log of the run goes, by hand and gpusnap's."""
        return self.work / "criu-logs" if self.args.criu_logs else None

    def left(self) -> float:
        return self.deadline - time.time() if self.deadline else 1e9


def rss_row(what: str, c: Cmd) -> dict[str, Any]:
    return {"command": what, "seconds": round(c.seconds, 3), "rss_own_mib": round(c.rss_own / MIB, 1), "rss_tree_mib": round(c.rss_tree / MIB, 1)}


def last_steps(env: Env, name: str, store: Path) -> list[tuple[int, str, float]]:
    c = measure([*env.gpusnap, "logs", name], env=env.cli_env(store), timeout=120)
    return parse_steps(c.stdout) if c.rc == 0 else []


def container_status(env: Env, name: str, store: Path) -> str:
    c = measure([*env.gpusnap, "ps", "--json"], env=env.cli_env(store), timeout=120)
    try:
        return next((str(x.get("status")) for x in json.loads(c.stdout) if x.get("name") == name), "gone")
    except ValueError:
        return "unknown"


def first_step_after(env: Env, name: str, store: Path, since: float, timeout: float) -> tuple[int, str, float]:
    polls = [0]

    def probe():  # type: ignore[no-untyped-def]
        later = [s for s in last_steps(env, name, store) if s[2] > since]
        if later:
            return later[0]
        polls[0] += 1
        if polls[0] % 5 == 0 and container_status(env, name, store) not in ("running", "unknown"):
            logs = measure([*env.gpusnap, "logs", name, "--tail", "15"], env=env.cli_env(store), timeout=60)
            raise RuntimeError(f"{name} is not running after restore; its last output: {logs.stdout[-1500:]!r}")
        return None

    return wait_until(probe, timeout, f"{name} to print a step after {since:.3f}", interval=0.3)


def store_scale() -> Any:
    """bench/store_scale.py, beside this script: imported only where a run asks for it (it
    brings numpy and the tests' CRIU image helpers)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import store_scale as module

    return module


def store_variants(env: Env, w: Workload, images: Path, r: dict[str, Any], variants: str, key: str = "store_variants") -> None:
    """The by-hand dump's CRIU images (the real workload's) stored into an empty store on the
    stores' disk once per variant of bench/store_scale.py, in the given order: an A/B of the
    store's own code on this host's real image (``key`` says when: nothing else running, or
    beside gpusnap's running workload right after its store-only checkpoint)."""
    ss = store_scale()
    store, size, rows = env.work / "store-variants", tree_bytes(images), []
    dev = ss.disk_of(env.work)
    for v in ss.parse_variants(variants):
        shutil.rmtree(store, ignore_errors=True)
        row = {"variant": v or "as-is", **ss.run_store(images, store, "variant:1", size, None, variant=v, disk=dev)}
        rows.append(row)
        say(f"{w.name}: store of the by-hand image ({gb(size):.2f} GB), variant {row['variant']}: {json.dumps(row)}")
    shutil.rmtree(store, ignore_errors=True)
    r[key] = rows


def run_workload(env: Env, w: Workload) -> dict[str, Any]:
    r: dict[str, Any] = {"workload": w.name, "argv": w.argv, "rss": [], "skipped": [], "growth_target": w.growth_target,
                         "cold_start_target": w.cold_start_target, "rel_tol": w.rel_tol}
    values = Values(w.rel_tol)
    work = env.work / w.name
    work.mkdir(parents=True, exist_ok=True)
    store_b, store_c = work / "store-b", work / "store-c"
    images = env.args.state_dir / "bare-images"  # where gpusnap's own CRIU dumps go (its state dir's tmp/)
    name = f"e2e-{w.name}"
    remote = f"{env.registry.host}/e2e/{w.name}"
    reg_data = env.registry.root / "data"

    # 1. by hand
    bare = BareContainer(work, w.argv, w.gpu, env.runc)
    bare.log_dir = env.criu_log_dir()
    stage = "start"
    try:
        say(f"{w.name}: by hand: starting a runc container")
        t_start = time.time()
        bare.start()
        wait_until(lambda: len(parse_steps(bare.output())) >= w.warm_steps, w.ready_timeout, f"{w.name} (by hand) to reach step {w.warm_steps}", 0.1)
        first = parse_steps(bare.output())[0]
        r["bare_cold_start_s"] = first[2] - t_start
        r["ready_line"] = next((l for l in bare.output().splitlines() if l.startswith("ready")), "")
        say(f"{w.name}: by hand: first step {first[2] - t_start:.1f} s after start; {r['ready_line']}")
        if w.gpu:
            r["gpu_memory_gb"] = gpu_memory_gb(bare.pid())

        def dump(parts_key: str) -> tuple[float, int]:
            """A by-hand leave-running checkpoint into ``images``; (seconds, the step it was taken
            at), once the workload has gone a few steps past it (so that a restored run's steps
            can be compared)."""
            shutil.rmtree(images, ignore_errors=True)
            with Pressure() as pressure:
                secs = bare.checkpoint(images, env.cuda)
            r.setdefault(parts_key, []).append(bare.parts)
            r.setdefault(parts_key.replace("parts", "pressure"), []).append(pressure.summary)
            say(f"{w.name}: by hand, while it ran: {pressure_text(pressure.summary)}")
            r["image_bytes"] = tree_bytes(images)
            step = parse_steps(bare.output())[-1][0]
            wait_until(lambda: parse_steps(bare.output())[-1][0] >= step + 3, 120, f"{w.name} (by hand) to go on after the checkpoint", 0.05)
            return secs, step

        running = []
        for rnd in range(w.bare_running):
            stage = "checkpoint"
            running.append(dump("bare_running_parts")[0])
            say(f"{w.name}: by hand, leave-running checkpoint {rnd + 1} of the running process{' (not counted)' if rnd == 0 else ''}: {running[-1]:.2f} s")
        r["bare_running_checkpoint_s"] = running
        cks, rss_, conts = [], [], []
        for rnd in range(w.bare_rounds):  # a second round (on the restored container) evens out noise
            stage = "checkpoint"
            secs, at = dump("bare_checkpoint_parts")
            cks.append(secs)
            stage = "restore"
            secs, started = bare.restore(images, env.cuda)
            stage = "output after restore"

            def restored_step():  # type: ignore[no-untyped-def]
                got = next((s for s in parse_steps(bare.readers[-1].text) if s[2] > started), None)
                if got is None and not bare.running():
                    raise RuntimeError(f"the restored workload exited; its output: {bare.readers[-1].text[-1500:]!r}")
                return got

            nxt = wait_until(restored_step, after_timeout(r), f"{w.name} (by hand) output after restore; its output: {bare.readers[-1].text[-800:]!r}", 0.05)
            rss_.append(nxt[2] - started)
            time.sleep(2)
            same, differ = values.compare(parse_steps(bare.output()))
            conts.append({"checkpoint_step": at, "first_step_after_restore": nxt[0], "same": same, "differ": differ})
            say(f"{w.name}: by hand, round {rnd + 1}: checkpoint {cks[-1]:.2f} s ({gb(r['image_bytes']):.2f} GB), restore to first step {rss_[-1]:.2f} s "
                f"(commands {secs:.2f} s); step {at} -> {nxt[0]}; {same} steps equal to the runs before, {differ} differ")
        counted = running[1:] if len(running) >= 2 else cks
        r["bare_checkpoint_s"], r["bare_restore_s"] = sum(counted) / len(counted), sum(rss_) / len(rss_)
        r["bare_rounds"] = {"checkpoint_s": cks, "restore_s": rss_}
        r["bare_continuation"] = {"same": sum(c["same"] for c in conts), "differ": sum(c["differ"] for c in conts), "rounds": conts}
    except Exception as exc:  # recorded; gpusnap's paths are measured all the same
        r["bare_error"] = f"{stage}: {type(exc).__name__}: {exc}"
        say(f"{w.name}: by hand FAILED at {r['bare_error']}; output: {bare.output()[-1500:]}")
    finally:
        bare.cleanup()
        if env.args.store_variants and images.is_dir():
            store_variants(env, w, images, r, env.args.store_variants)
        if not (env.args.store_variants_beside and w.store_only):
            shutil.rmtree(images, ignore_errors=True)
    argv = w.argv
    if "bare_error" in r and stage in ("checkpoint", "restore", "output after restore") and "cudagraphs=on" in r.get("ready_line", "") and "--compile" in argv:
        # CUDA graphs did not come back from the driver's checkpoint: measure gpusnap's paths
        # on the same server compiled without them (what a user would do), and say so.
        argv = [*argv[:argv.index("--compile") + 1], "default", *argv[argv.index("--compile") + 2:]]
        r["cuda_graphs_fallback"] = f"by-hand {stage} failed with CUDA graphs on: gpusnap paths measured with --compile default"
        say(f"{w.name}: {r['cuda_graphs_fallback']}")

    # 2. the user's paths
    e_b = env.cli_env(store_b)
    run_argv = [*env.gpusnap, "run", name, "--rootfs-overlay", "/", "--env", "PYTHONUNBUFFERED=1", "--env", "HF_HUB_OFFLINE=1",
                "--env", "HF_HUB_DISABLE_PROGRESS_BARS=1", "--env", "TRANSFORMERS_VERBOSITY=error", "--env", "HOME=/root", "--env", f"PATH={os.path.dirname(w.argv[0])}:{HOST_PATH}"]
    if w.gpu:
        run_argv += ["--env", "NVIDIA_VISIBLE_DEVICES=all"]
    try:
        say(f"{w.name}: gpusnap run")
        c = measure([*run_argv, "--", *argv], env=e_b)
        r["rss"].append(rss_row("run", c))
        c.check()
        wait_until(lambda: len(last_steps(env, name, store_b)) >= w.warm_steps, w.ready_timeout, f"{name} to reach step {w.warm_steps}", 1.0)
        steps = last_steps(env, name, store_b)
        r["cold_start_s"] = steps[0][2] - c.start
        say(f"{w.name}: cold start (gpusnap run to the first step) {r['cold_start_s']:.1f} s")

        r.setdefault("image_bytes", 0)
        if w.store_only:
            # The store alone (no --push: a pipelined push overlaps the uploads with the store,
            # so --push's own store step is not the store's speed), into a store of its own,
            # after the dump (GPUSNAP_STORE_WHILE_DUMPING=0: stored while CRIU writes, the
            # store step would only be the tail the dump left).
            need(env, 30 + 8 * gb(r["image_bytes"]) * 2, "the store-only checkpoint (and the pushed ones)")
            store_a = work / "store-a"
            say(f"{w.name}: gpusnap checkpoint --leave-running (store only, empty store)")
            ss = store_scale()
            with ss.DiskSampler(ss.disk_of(env.work)) as disk0, Pressure() as p0:  # when the disk took the store's writes, and how fast
                c0 = measure([*profiler(env, f"checkpoint-store-after-dump-{w.name}"), *env.gpusnap, "checkpoint", name, "--leave-running", "--json"],
                             env={**env.cli_env(store_a), "GPUSNAP_STORE_WHILE_DUMPING": "0"})
            r["rss"].append(rss_row("checkpoint (store only)", c0))
            c0.check()
            j0 = c0.json()
            r["ck0"] = {"seconds": c0.seconds, "timings_s": j0.get("timings_s", {}), "size": j0.get("size"), "store_bytes": tree_bytes(store_a),
                        "disk": disk0.summary(), "pressure": p0.summary}
            say(f"{w.name}: checkpoint (store only) {c0.seconds:.2f} s {j0.get('timings_s')}; disk {r['ck0']['disk']}")
            shutil.rmtree(store_a, ignore_errors=True)
            if env.args.store_variants_beside and images.is_dir():
                # The same by-hand image as before, stored now, the workload running again after
                # gpusnap's checkpoint: whether the store above is slower than the variants
                # before it because of its process or because of what runs beside it now.
                store_variants(env, w, images, r, env.args.store_variants_beside, "store_variants_beside")
            shutil.rmtree(images, ignore_errors=True)
            # The same, stored while CRIU writes (the default): what a checkpoint without
            # --push costs end to end, and how much the dump slows with a store beside it.
            say(f"{w.name}: gpusnap checkpoint --leave-running (store only, while CRIU writes, empty store)")
            with Pressure() as p0f:
                c0f = measure([*env.gpusnap, "checkpoint", name, "--leave-running", "--json"], env=env.cli_env(store_a))
            r["rss"].append(rss_row("checkpoint (store only, while CRIU writes)", c0f))
            c0f.check()
            j0f = c0f.json()
            r["ck0f"] = {"seconds": c0f.seconds, "timings_s": j0f.get("timings_s", {}), "size": j0f.get("size"),
                         "stored_while_dumping": j0f.get("stored_while_dumping", 0), "pressure": p0f.summary}
            say(f"{w.name}: checkpoint (store only, while CRIU writes) {c0f.seconds:.2f} s {j0f.get('timings_s')}; "
                f"{gb(j0f.get('stored_while_dumping', 0)):.2f} GB stored before the dump ended")
            shutil.rmtree(store_a, ignore_errors=True)
        need(env, 30 + 8 * gb(r["image_bytes"]), "the checkpoints")
        reg0 = tree_bytes(reg_data)
        say(f"{w.name}: gpusnap checkpoint --leave-running --push {remote}:1 (empty store, empty repository)")
        cpu0 = registry_cpu_s(env.registry)
        with Pressure() as p1:
            c1 = measure([*env.gpusnap, "checkpoint", name, "--leave-running", "--push", f"{remote}:1", "--insecure", "--json"], env=e_b)
        reg_cpu = registry_cpu_s(env.registry) - cpu0
        r["rss"].append(rss_row("checkpoint --push (1st)", c1))
        c1.check()
        reg1, st1 = tree_bytes(reg_data), tree_bytes(store_b)
        j1 = c1.json()
        r["image_bytes"] = r["image_bytes"] or int(j1.get("size") or 0)
        r["ck1"] = {"seconds": c1.seconds, "timings_s": j1.get("timings_s", {}), "size": j1.get("size"), "ref": j1.get("ref"),
                    "registry_bytes": reg1 - reg0, "store_bytes": st1, "stored_while_dumping": j1.get("stored_while_dumping", 0),
                    "pressure": p1.summary, "registry_cpu_s": reg_cpu}
        say(f"{w.name}: checkpoint --push {c1.seconds:.2f} s {j1.get('timings_s')}; registry +{gb(reg1 - reg0):.2f} GB "
            f"(its process: {reg_cpu:.1f} CPU s), store {gb(st1):.2f} GB")
        say(f"{w.name}: checkpoint --push, while it ran: {pressure_text(p1.summary)}")
        last_ref, last_remote, j2 = j1.get("ref"), f"{remote}:1", {}
        if w.second_checkpoint:
            time.sleep(3)
            need(env, 30 + 8 * gb(r["image_bytes"]) + 30 + 5 * gb(r["image_bytes"]), "the second checkpoint (and then a restore)")
            say(f"{w.name}: second checkpoint --leave-running --push {remote}:2")
            c2 = measure([*env.gpusnap, "checkpoint", name, "--leave-running", "--push", f"{remote}:2", "--insecure", "--json"], env=e_b)
            r["rss"].append(rss_row("checkpoint --push (2nd)", c2))
            c2.check()
            reg2, st2 = tree_bytes(reg_data), tree_bytes(store_b)
            j2 = c2.json()
            r["ck2"] = {"seconds": c2.seconds, "timings_s": j2.get("timings_s", {}), "size": j2.get("size"), "ref": j2.get("ref"),
                        "registry_bytes": reg2 - reg1, "store_bytes": st2 - st1}
            say(f"{w.name}: 2nd checkpoint --push {c2.seconds:.2f} s {j2.get('timings_s')}; registry +{gb(reg2 - reg1):.3f} GB "
                f"({(reg2 - reg1) / max(reg1 - reg0, 1):.1%} of the first), store +{gb(st2 - st1):.3f} GB")
            last_ref, last_remote = j2.get("ref"), f"{remote}:2"
        else:
            r["skipped"].append("second checkpoint (not asked for this workload)")
        for knob in CK_AB_KNOBS:
            if getattr(env.args, f"ab_{knob}"):
                r[f"checkpoint_ab_{knob}"] = ab_checkpoints(env, name, remote, 30 + 8 * gb(r["image_bytes"]), knob)
        if env.alt_registry is not None:
            r["checkpoint_ab_registry"] = ab_registries(env, name, w.name, 30 + 8 * gb(r["image_bytes"]))
        if env.args.ab_dump_beside:
            r["checkpoint_ab_dump_beside"] = ab_dump_beside(env, name, remote, 30 + 8 * gb(r["image_bytes"]))
        wait_until(lambda: len(last_steps(env, name, store_b)) > len(steps) + 3, 300, "steps after the last checkpoint", 1.0)
        values.compare(last_steps(env, name, store_b))
        measure([*env.gpusnap, "delete", name], env=e_b).check()

        if env.args.skip_ckdiff:
            r["skipped"].append("ckdiff (--skip-ckdiff)")
        elif w.diff and j1.get("ref") and j2.get("ref"):
            if env.left() > 60 + 15 * gb(r["image_bytes"]):
                say(f"{w.name}: ckdiff first vs second checkpoint")
                d = measure([sys.executable, "-m", "gpusnap.packaging.ckdiff", "--store", str(store_b), "--tmp", str(work), "--top", "12",
                             "--json", str(env.args.out / f"ckdiff-{w.name}.json"), j1["ref"], j2["ref"]], env=e_b, timeout=900)
                (env.args.out / f"ckdiff-{w.name}.txt").write_text(d.stdout + d.stderr)
                say(f"{w.name}: ckdiff ({d.seconds:.1f} s, rc {d.rc}):\n" + "\n".join(
                    l for l in d.stdout.splitlines() if l.startswith(("pages of B", "  whole", "  fixed", "  ideal"))))
                r["ckdiff_s"] = d.seconds
            else:
                r["skipped"].append("ckdiff (time)")

        # restore from the local store (time for it and the registry's)
        if env.left() > 60 + 10 * gb(r["image_bytes"]):
            say(f"{w.name}: gpusnap restore {last_ref} (local store)")
            c3 = measure([*profiler(env, f"restore-local-{w.name}"), *env.gpusnap, "restore", str(last_ref), "--json"], env=e_b,
                         timeout=180 if env.args.py_spy else 900)
            r["rss"].append(rss_row("restore (local store)", c3))
            c3.check()
            nxt = first_step_after(env, name, store_b, c3.start, after_timeout(r))
            r["restore_local_s"] = nxt[2] - c3.start
            r["restore_local_cmd_s"] = c3.seconds
            r["restore_local_timings_s"] = c3.json().get("timings_s", {})
            time.sleep(2)
            after = [s for s in last_steps(env, name, store_b) if s[2] > c3.start]
            same, differ = values.compare(after)
            r["restore_local_continuation"] = {"first_step": nxt[0], "same": same, "differ": differ}
            say(f"{w.name}: restore (local) to first step {r['restore_local_s']:.2f} s (command {c3.seconds:.2f} s); "
                f"step {nxt[0]}; {same} steps equal to other runs', {differ} differ")
            measure([*env.gpusnap, "delete", name], env=e_b).check()
        else:
            r["skipped"].append("restore from the local store (time)")
        shutil.rmtree(store_b, ignore_errors=True)

        # restore from the registry, nothing in the local store
        need(env, 30 + 5 * gb(r["image_bytes"]), "the restore from the registry")
        e_c = env.cli_env(store_c)
        say(f"{w.name}: gpusnap restore {last_remote} (empty local store)")
        cpu0 = registry_cpu_s(env.registry)
        c4 = measure([*profiler(env, f"restore-registry-{w.name}"), *env.gpusnap, "restore", last_remote, "--insecure", "--json"], env=e_c,
                     timeout=180 if env.args.py_spy else 900)
        r["rss"].append(rss_row("restore (registry)", c4))
        c4.check()
        nxt = first_step_after(env, name, store_c, c4.start, after_timeout(r))
        r["restore_registry_s"] = nxt[2] - c4.start
        r["restore_registry_cmd_s"] = c4.seconds
        r["restore_registry_timings_s"] = c4.json().get("timings_s", {})
        r["restore_registry_registry_cpu_s"] = registry_cpu_s(env.registry) - cpu0
        time.sleep(2)
        after = [s for s in last_steps(env, name, store_c) if s[2] > c4.start]
        same, differ = values.compare(after)
        r["restore_registry_continuation"] = {"first_step": nxt[0], "same": same, "differ": differ}
        say(f"{w.name}: restore (registry) to first step {r['restore_registry_s']:.2f} s (command {c4.seconds:.2f} s; the registry's "
            f"process {r['restore_registry_registry_cpu_s']:.1f} CPU s) {r['restore_registry_timings_s']}; step {nxt[0]}; {same} steps equal to other runs', {differ} differ")
        measure([*env.gpusnap, "delete", name], env=e_c).check()
        for knob in AB_KNOBS:
            if getattr(env.args, f"ab_{knob}"):
                r[f"restore_registry_ab_{knob}"] = ab_restores(env, name, last_remote, values, after_timeout(r), 30 + 5 * gb(r["image_bytes"]), knob)
    except Exception as exc:  # record, clean up, go on with the next workload
        if isinstance(exc, OutOfTime):  # the --budget the caller gave ran out: a skip, not a failure
            r["skipped"].append(f"{exc}, and every stage after it")
            say(f"{w.name}: {exc}, and every stage after it")
        else:
            r["error"] = f"{type(exc).__name__}: {exc}"
            say(f"{w.name}: FAILED: {r['error']}")
        for store in (store_b, store_c):
            logs = measure([*env.gpusnap, "logs", name], env=env.cli_env(store), timeout=60)
            if logs.rc == 0 and "error" in r:
                (env.args.out / f"{w.name}-container.log").write_text(logs.stdout)
            measure([*env.gpusnap, "delete", name], env=env.cli_env(store), timeout=120)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return r


def profiler(env: Env, what: str) -> list[str]:
    """``py-spy record`` (--py-spy): a timeline (chrometrace) of every Python thread of the gpusnap
    command, sampled without stopping it; nothing without the option."""
    if not env.args.py_spy:
        return []
    # Not --subprocesses: following children reaches the processes CRIU restores, and a run on
    # the H100 hung so. The transfer processes and the runtime are not in the profile.
    return [env.args.py_spy, "record", "--nonblocking", "--idle", "--threads", "--rate", "250",
            "--format", "chrometrace", "-o", str(env.args.out / f"{what}.chrometrace.json"), "--"]


AB_KNOBS = {
    # option key -> (environment variable, values in turn, label in the table)
    "criu_before_pages": ("GPUSNAP_CRIU_BEFORE_PAGES", ("1", "0", "1"), ("CRIU started before the pages", "CRIU after the pages")),
    "lazy_pages": ("GPUSNAP_LAZY_PAGES", ("1", "0", "1", "0"), ("lazy pages (gpusnap's page server)", "eager pages (CRIU copies them)")),
}


CK_AB_KNOBS = {
    # as AB_KNOBS, for `checkpoint --push` of the running workload
    "store_nice": ("GPUSNAP_STORE_NICE", ("0", "10", "0", "10"), ("store and push beside the dump at nice 10", "at the command's own priority")),
    "push_nice": ("GPUSNAP_PUSH_NICE", ("10", "19", "10", "19"), ("uploads beside the dump at nice 19 (the store at 10)", "uploads at the store's nice 10")),
    "push_processes": ("GPUSNAP_PUSH_PROCESSES", ("0", "2", "0", "2"), ("uploads in 2 transfer processes", "uploads on threads of the storing process")),
}


def ab_checkpoints(env: Env, name: str, remote: str, cost: float, knob: str) -> list[dict[str, Any]]:
    """``checkpoint --leave-running --push`` of the running workload with the setting ``knob``
    in turn (CK_AB_KNOBS), each into an empty store and a repository of its own (nothing
    dedups), after the measured ones: an A/B of that setting on this host."""
    var, order, _ = CK_AB_KNOBS[knob]
    rounds: list[dict[str, Any]] = []
    on_value = order[1]
    for i, val in enumerate(order):
        if env.left() < cost:
            break
        store = env.work / f"store-abck-{knob}-{i}"
        e = {**env.cli_env(store), var: val}
        c = measure([*env.gpusnap, "checkpoint", name, "--leave-running", "--push", f"{remote}-ab{i}:1", "--insecure", "--json"], env=e)
        c.check()
        t = c.json().get("timings_s", {})
        rounds.append({knob: val == on_value, "value": val, "seconds": c.seconds, "timings_s": t})
        say(f"A/B checkpoint --push, {knob}={val}: {c.seconds:.2f} s, of which checkpoint {t.get('checkpoint', 0):.2f} s; {t}")
        shutil.rmtree(store, ignore_errors=True)
    return rounds


def ab_registries(env: Env, name: str, workload: str, cost: float) -> list[dict[str, Any]]:
    """``checkpoint --leave-running --push`` of the running workload to the run's registry and to
    the --ab-registry one in turn (A B A B), each into an empty store and a repository of its own:
    how much of the push's cost on this host is the registry program beside the dump. Each
    round records the CPU seconds of the registry it pushed to."""
    assert env.alt_registry is not None
    rounds: list[dict[str, Any]] = []
    for i, alt in enumerate((False, True, False, True)):
        if env.left() < cost:
            break
        reg = env.alt_registry if alt else env.registry
        store = env.work / f"store-abreg-{i}"
        blobs_before = registry_blobs(reg)
        cpu0 = registry_cpu_s(reg)
        c = measure([*env.gpusnap, "checkpoint", name, "--leave-running", "--push", f"{reg.host}/e2e/{workload}-abreg{i}:1",
                     "--insecure", "--json"], env=env.cli_env(store))
        cpu = registry_cpu_s(reg) - cpu0
        c.check()
        t = c.json().get("timings_s", {})
        rounds.append({"alt": alt, "seconds": c.seconds, "registry_cpu_s": cpu, "timings_s": t})
        which = "--ab-registry" if alt else "the run's registry"
        program = env.results["versions"].get("ab_registry" if alt else "registry", "?")  # its --version, read once at the start
        say(f"A/B registry, {which} ({program}): checkpoint --push {c.seconds:.2f} s, "
            f"its registry {cpu:.1f} CPU s; " + ", ".join(f"{k.split(': ')[-1]} {t.get(k, 0):.2f}" for k in DUMP_TIMINGS))
        shutil.rmtree(store, ignore_errors=True)
        # Each round pushes the whole image again (a repository of its own, an empty store); the
        # registries keep their storage in memory on the GPU machine, so what the round added goes.
        for blob in registry_blobs(reg) - blobs_before:
            shutil.rmtree(blob, ignore_errors=True)
        shutil.rmtree(reg.root / "data" / REGISTRY_REPOS / "e2e" / f"{workload}-abreg{i}", ignore_errors=True)
    return rounds


# Where a filesystem-driver registry (distribution 2.x and 3.x alike) keeps blobs and repositories.
REGISTRY_BLOBS = Path("docker/registry/v2/blobs")
REGISTRY_REPOS = Path("docker/registry/v2/repositories")


def registry_blobs(reg: Registry) -> set[Path]:
    """The blob directories of ``reg``'s storage (blobs/sha256/XX/DIGEST)."""
    return set((reg.root / "data" / REGISTRY_BLOBS).glob("*/*/*"))


# What slows CRIU's dump when the store and the uploads run beside it (--ab-dump-beside): each
# condition's store directory (None: the run's own, on --work's disk) and settings.
DUMP_BESIDE: dict[str, tuple[str | None, dict[str, str], str]] = {
    "default": (None, {}, ("stored beside the dump (the default of the gpusnap that ran: since the fifteenth session 2 threads "
                            "while CRIU dumps, then one per core; before, a quarter of the cores, at least 4)")),
    "after": (None, {"GPUSNAP_STORE_WHILE_DUMPING": "0"}, "stored after the dump, nothing beside it"),
    "cores": (None, {"GPUSNAP_STORE_WORKERS": str(os.cpu_count() or 1)}, "stored beside the dump, a thread per core"),
    "tmpfs": ("/dev/shm", {}, "stored beside the dump, store on tmpfs (no disk writes)"),
    # the first run's (thirteenth session), when the default was a thread per core
    "disk": (None, {}, "stored beside the dump, a thread per core, store on the disk"),
    "workers4": (None, {"GPUSNAP_STORE_WORKERS": "4"}, "stored beside the dump by 4 threads, store on the disk"),
    "workers2": (None, {"GPUSNAP_STORE_WORKERS": "2"}, "stored beside the dump by 2 threads (the rest beside the GPU restore)"),
}
# The conditions a run compares by default (--ab-dump-beside A,B,... picks others; all of
# DUMP_BESIDE can be read back by --report).
DUMP_BESIDE_RUN = ("default", "after", "cores")
DUMP_TIMINGS = ("checkpoint: runtime: runc checkpoint", "checkpoint: runtime: gpu_checkpoint", "checkpoint: runtime: gpu_restore",
                "checkpoint", "store the checkpoint", "push the checkpoint")


def ab_dump_beside(env: Env, name: str, remote: str, cost: float) -> list[dict[str, Any]]:
    """``checkpoint --leave-running --push`` of the running workload under each DUMP_BESIDE
    condition in turn, twice, each into an empty store and a repository of its own: which of
    the work beside CRIU (disk writes, threads, or nothing) costs the dump its time."""
    rounds: list[dict[str, Any]] = []
    for i, cond in enumerate([*env.args.ab_dump_beside.split(",")] * 2):
        if env.left() < cost:
            break
        where, extra, _ = DUMP_BESIDE[cond]
        store = Path(where or env.work) / f"store-abdump-{i}"
        e = {**env.cli_env(store), **extra}
        c = measure([*env.gpusnap, "checkpoint", name, "--leave-running", "--push", f"{remote}-abdump{i}:1", "--insecure", "--json"], env=e)
        c.check()
        t = c.json().get("timings_s", {})
        rounds.append({"condition": cond, "seconds": c.seconds, "timings_s": t})
        say(f"A/B dump beside, {cond}: {c.seconds:.2f} s; " + ", ".join(f"{k.split(': ')[-1]} {t.get(k, 0):.2f}" for k in DUMP_TIMINGS))
        shutil.rmtree(store, ignore_errors=True)
    return rounds


def ab_restores(env: Env, name: str, remote: str, values: "Values", timeout: float, cost: float, knob: str) -> list[dict[str, Any]]:
    """Restores from the registry (each into an empty store) with the setting ``knob`` on and
    off in turn (AB_KNOBS), after the measured one above (which ran with the default): an A/B of
    that setting on this host."""
    var, order, _ = AB_KNOBS[knob]
    rounds: list[dict[str, Any]] = []
    for i, on in enumerate(order):
        if env.left() < cost:
            break
        store = env.work / f"store-ab-{knob}-{i}"
        e = {**env.cli_env(store), var: on}
        c = measure([*env.gpusnap, "restore", remote, "--insecure", "--json"], env=e)
        server_log = env.work / "run" / "engine" / "containers" / name / "lazy-pages.log"
        if server_log.is_file():  # the page server's own account, kept whatever follows
            shutil.copy(server_log, env.args.out / f"{name}-ab-{i}-lazy-pages.log")
        c.check()
        nxt = first_step_after(env, name, store, c.start, timeout)
        time.sleep(1)
        same, differ = values.compare([s for s in last_steps(env, name, store) if s[2] > c.start])
        t = c.json().get("timings_s", {})
        rounds.append({knob: on == "1", "first_step_s": nxt[2] - c.start, "cmd_s": c.seconds, "timings_s": t, "same": same, "differ": differ})
        detail = {k: v for k, v in t.items() if "runc restore" in k or "lazy" in k or "CRIU waited" in k or k == "restore: runtime: total"}
        say(f"A/B restore (registry), {knob}={on}: first step {nxt[2] - c.start:.2f} s (command {c.seconds:.2f} s); {detail}; "
            f"{same} steps equal, {differ} differ")
        measure([*env.gpusnap, "delete", name], env=e).check()
        shutil.rmtree(store, ignore_errors=True)
    return rounds


def after_timeout(r: dict[str, Any]) -> float:
    """How long a restored workload may take to print its next step: a workload that died on
    restore (CUDA graphs the driver did not bring back, say) must not eat the whole budget."""
    return 120 + 10 * gb(r.get("image_bytes") or 0)


class OutOfTime(Exception):
    pass


def need(env: Env, seconds: float, what: str) -> None:
    if env.left() < seconds:
        raise OutOfTime(f"{what} skipped: {env.left():.0f} s left of the budget, about {seconds:.0f} s needed")


def gpu_memory_gb(pid: int) -> float:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True)
    total = 0
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[1].isdigit():
            total += int(parts[1])  # the container's PID namespace hides its PIDs from nvidia-smi here: all of them
    return total * MIB / 1e9


def pid_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (0.0 for none or gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() if pid else []
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def registry_pid(reg: Registry) -> int:
    """The registry's process id (0 when it is not running)."""
    return reg.proc.pid if reg.proc is not None else 0


def registry_cpu_s(reg: Registry) -> float:
    """A local registry's CPU seconds so far: what an upload or a download costs on this host's
    cores beside gpusnap's own work (0.0 if it is not running)."""
    return pid_cpu_s(registry_pid(reg))


# -- report ---------------------------------------------------------------------------------------------

def pressure_text(s: dict[str, float]) -> str:
    """A :class:`Pressure` summary in a few words (a report row)."""
    return (f"memory stall {s.get('memory_some_s', '?')} s, I/O stall {s.get('io_some_s', '?')} s, CPU wait {s.get('cpu_some_s', '?')} s, "
            f"direct reclaim {s.get('direct_reclaim_gb', '?')} GB ({s.get('allocstalls', '?')} stalls), kswapd {s.get('kswapd_reclaim_gb', '?')} GB, "
            f"MemAvailable >= {s.get('min_available_gb', '?')} GB, dirty <= {s.get('max_dirty_gb', '?')} GB, "
            f"16 MiB memcpy {s.get('canary_gbps_median', '?')} GB/s (p10 {s.get('canary_gbps_p10', '?')})")


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def report(res: dict[str, Any], gpu: bool) -> list[str]:
    f = res["floors"]
    lines = ["", f"== floors ({res['host']}, {f.get('cores', os.cpu_count())} cores)", "| floor | GB/s |", "|---|---:|"]
    for k, v in f.items():
        if k.endswith("gbps") or "_gbps_" in k:
            lines.append(f"| {k.replace('_gbps', '').replace('_', ' ')} | {v:.2f} |")
        elif k.startswith("registry_cpu_s_per_gb_"):
            lines.append(f"| the registry's own CPU, {k.rsplit('_', 1)[1]}loads | {v:.2f} s per GB |")
        elif k.endswith("_s") and isinstance(v, float):
            lines.append(f"| {k[:-2].replace('_', ' ')} | {v:.3f} s |")
    alt = f.get("ab_registry") or {}
    if alt:  # --ab-registry: the same HTTP floor against the second registry program
        name = res.get("versions", {}).get("ab_registry", "--ab-registry")
        for k, v in alt.items():
            if "_gbps_" in k:
                lines.append(f"| {name}: {k.replace('_gbps', '').replace('_', ' ')} | {v:.2f} |")
            elif k.startswith("registry_cpu_s_per_gb_"):
                lines.append(f"| {name}: its own CPU, {k.rsplit('_', 1)[1]}loads | {v:.2f} s per GB |")
    store_target = 2.0 if gpu else 0.8
    io_floor = min(f.get("sha256_gbps_x_cores", 1e9), f.get("disk_write_gbps", 1e9))
    http = max((v for k, v in f.items() if k.startswith("http_up_gbps")), default=0)
    http_down = max((v for k, v in f.items() if k.startswith("http_down_gbps")), default=0)
    for w in res["workloads"]:
        size = w.get("image_bytes", 0)
        rows: list[tuple[str, str, str, str, str]] = []

        def row(what: str, secs: float | None, ratio: str = "", target: str = "", ok: bool | None = None, rate_bytes: int = size) -> None:
            if secs is None:
                return
            rows.append((what, f"{secs:.2f}", f"{gb(rate_bytes) / secs:.2f}" if secs and rate_bytes else "", ratio + (f" (target {target})" if target else ""), verdict(ok) if target else ""))

        bare_ck, bare_rs = w.get("bare_checkpoint_s"), w.get("bare_restore_s")
        n = len(w.get("bare_rounds", {}).get("checkpoint_s", [])) or 1
        running = w.get("bare_running_checkpoint_s", [])
        if len(running) >= 2:
            row(f"by hand: checkpoint (leave running) of the running process, mean of {len(running) - 1} after a first of {running[0]:.2f} s", bare_ck)
            cycles = w.get("bare_rounds", {}).get("checkpoint_s", [])
            if cycles:
                rows.append(("  not counted: the checkpoint + restore cycles' checkpoints (of the running process, then of a restored one): "
                             + ", ".join(f"{x:.2f}" for x in cycles) + " s", "", "", "", ""))
        else:
            row(f"by hand: checkpoint (leave running){f', mean of {n}' if n > 1 else ''}", bare_ck)
        row(f"by hand: restore, to first step{f', mean of {n}' if n > 1 else ''}", bare_rs)
        ck1 = w.get("ck1", {})
        t1 = ck1.get("timings_s", {})
        if ck1:
            r = ck1["seconds"] / bare_ck if bare_ck else None
            row("checkpoint --push, end to end", ck1["seconds"], f"{r:.2f}x by hand" if r else "", "<= 1.3x", r is not None and r <= 1.3)
            shared = f.get("registry_on_the_stores_disk", True)  # older reports: the VM's layout
            written = ck1.get("store_bytes", 0) + (ck1.get("registry_bytes", 0) if shared else 0)
            disk = f.get("disk_write_gbps")
            if written and disk:
                # What reaches the stores' disk durably: the store's bytes, and the registry's
                # where it shares that disk. Nothing is done sooner than those bytes take.
                floor = gb(written) / disk
                who = "the store and the registry write" if shared else "the store writes (the registry is on another filesystem)"
                row(f"  floor: {who} {gb(written):.2f} GB to one disk", floor,
                    f"end to end = {ck1['seconds'] / max(floor, bare_ck or 0):.2f}x max(this, by hand)", rate_bytes=0)
            row("  of which checkpoint (CRIU + GPU)", t1.get("checkpoint"), f"{t1['checkpoint'] / bare_ck:.2f}x by hand" if bare_ck and t1.get("checkpoint") else "")
            for key, secs in t1.items():  # the engine's and the runtime's own parts, beside the by-hand parts
                if key.startswith(("checkpoint: engine: ", "checkpoint: runtime: ")):
                    row(f"    {key[len('checkpoint: '):]}", secs, rate_bytes=0)
            for i, parts in enumerate(w.get("bare_running_parts", [])):
                rows.append((f"    by hand, running process, checkpoint {i + 1}{' (not counted)' if i == 0 else ''}: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()), "", "", "", ""))
            for i, parts in enumerate(w.get("bare_checkpoint_parts", [])):
                rows.append((f"    by hand, round {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()), "", "", "", ""))
            # The host while each ran: did the dump beside the store and uploads wait for memory?
            if ck1.get("pressure"):
                rows.append((f"    while it ran: {pressure_text(ck1['pressure'])}", "", "", "", ""))
            if ck1.get("registry_cpu_s"):  # the local registry's share of the host's cores beside the dump
                rows.append((f"    the local registry's process meanwhile: {ck1['registry_cpu_s']:.1f} CPU s "
                             f"({ck1['registry_cpu_s'] / max(gb(ck1.get('registry_bytes') or size), 1e-9):.2f} per GB received)", "", "", "", ""))
            for i, pr in enumerate(w.get("bare_running_pressure", []) or w.get("bare_checkpoint_pressure", [])):
                rows.append((f"    by hand, checkpoint {i + 1}, while it ran: {pressure_text(pr)}", "", "", "", ""))
            st = t1.get("store the checkpoint")
            early = int(ck1.get("stored_while_dumping") or 0)
            if early:
                rows.append((f"  of which stored and pushed while CRIU wrote: {gb(early):.2f} GB of {gb(size):.2f}", "", "", "", ""))
                if st:
                    row("  of which store and push of the rest, after the dump", st)
            elif st:
                row("  of which store (with the uploads a pipelined push overlaps)", st, f"{gb(size) / st / io_floor:.2f}x min(SHA-256 x cores, disk)")
            for key, secs in t1.items():
                if key.startswith("store the checkpoint: "):
                    row(f"    {key[len('store the checkpoint: '):]}", secs, rate_bytes=0)
            ps = t1.get("push the checkpoint")
            sent = ck1.get("registry_bytes") or size
            if ps and early:  # the packs went up during the dump: this step is the last uploads and the manifest
                row(f"  of which the last uploads and the manifest ({gb(sent):.2f} GB sent in all)", ps, rate_bytes=0)
            elif ps:
                row(f"  of which push ({gb(sent):.2f} GB sent; GB/s of those)", ps, f"{gb(sent) / ps / http:.2f}x HTTP upload floor" if http else "", rate_bytes=sent)
            for key, secs in t1.items():
                if key.startswith("push the checkpoint: "):
                    row(f"    {key[len('push the checkpoint: '):]}", secs, rate_bytes=0)
            for key in ("start-up and imports", "find the container, check the host", "remove the work dir"):  # before and after the steps
                if key in t1:
                    row(f"  of which {key}", t1[key], rate_bytes=0)
            rest = "exit" if "start-up and imports" in t1 else "start-up, exit"
            row(f"  command total minus its stages ({rest})", ck1["seconds"] - sum(v for k, v in t1.items() if ": " not in k), rate_bytes=0)
        ck0f = w.get("ck0f")
        if ck0f:
            t0f = ck0f["timings_s"]
            row("checkpoint without --push (stored while CRIU writes), end to end", ck0f["seconds"],
                f"{ck0f['seconds'] / bare_ck:.2f}x by hand" if bare_ck else "")
            row("  of which checkpoint (CRIU + GPU, the store beside it)", t0f.get("checkpoint"),
                f"{t0f['checkpoint'] / bare_ck:.2f}x by hand" if bare_ck and t0f.get("checkpoint") else "")
            row("  of which store of the rest, after the dump", t0f.get("store the checkpoint"))
            if ck0f.get("pressure"):
                rows.append((f"  while it ran: {pressure_text(ck0f['pressure'])}", "", "", "", ""))
        ck0 = w.get("ck0")
        if ck0:
            row("checkpoint without --push (stored after the dump), end to end", ck0["seconds"], f"{ck0['seconds'] / bare_ck:.2f}x by hand" if bare_ck else "")
            st0 = ck0["timings_s"].get("store the checkpoint")
            if st0:
                row("  of which store", st0, f"{gb(size) / st0 / io_floor:.2f}x min(SHA-256 x cores, disk write)", f">= {store_target} GB/s", gb(size) / st0 >= store_target)
                wrote, disk = ck0.get("store_bytes", 0), f.get("disk_write_gbps")
                if wrote and disk:
                    # The target counts the image's bytes; the disk takes only what is new and not zero.
                    row(f"    its writes: {gb(wrote):.2f} GB into the store", st0, f"{gb(wrote) / st0 / disk:.2f}x disk write", rate_bytes=wrote)
        d0 = (ck0 or {}).get("disk", {})
        if d0.get("disk_gb"):
            rows.append((f"    the disk took {d0['disk_gb']:.2f} GB, from {d0['disk_first_s']:.2f} s to {d0['disk_last_s']:.2f} s of the command, at",
                         "", f"{d0['disk_gbps_between']:.2f}", f"best 0.5 s: {d0.get('disk_gbps_best_0.5s', 0):.2f} GB/s", ""))
        for when, v in [*(("", v) for v in w.get("store_variants", [])),
                        *((", the workload running", v) for v in w.get("store_variants_beside", []))]:
            rows.append((f"  store of the by-hand image{when}, variant {v['variant']} ({v['new_gb']:.2f} GB new, {v.get('store_gb', 0):.2f} GB in the store, disk took it at "
                         f"{v.get('disk_gbps_between', 0):.2f} GB/s)", f"{v['store_s']:.2f}", f"{v['gb_s']:.2f}", "", ""))
        def stage_rows(timings: dict[str, float], first_step: float, cmd: float) -> None:
            """The command's own stage timings (orchestrate.restore), then what follows its restore
            step: to the workload's first line, and the command's clean-up after it."""
            for stage, secs in timings.items():
                rate = size if stage in ("materialize", "pull into the image directory", "background: materialize",
                                         "background: pull into the image directory") else 0
                sub = stage.startswith("restore: ")  # the engine's own steps, inside "restore"
                if stage.startswith("background: "):  # not a lap: overlapped with the stages around it
                    row(f"  beside them, on its own thread: {stage[len('background: '):]}", secs, rate_bytes=rate)
                    continue
                row(f"    {stage[len('restore: '):]}" if sub else f"  of which {stage}", secs, rate_bytes=rate)
            if timings:
                top = sum(v for k, v in timings.items() if not k.startswith(("restore: ", "background: ")))
                rest = "clean-up, exit" if "start-up and imports" in timings else "start-up, clean-up"
                row(f"  command total minus its stages ({rest})", cmd - top, rate_bytes=0)
                row("  first step after the command's start", first_step, rate_bytes=0)

        rl = w.get("restore_local_s")
        if rl:
            row("restore from the local store, to first step", rl, f"{rl / bare_rs:.2f}x by hand" if bare_rs else "")
            stage_rows(w.get("restore_local_timings_s", {}), rl, w.get("restore_local_cmd_s", 0))
        rr = w.get("restore_registry_s")
        if rr:
            r = rr / bare_rs if bare_rs else None
            row("restore from the registry (empty store), to first step", rr, f"{r:.2f}x by hand" if r else "", "<= 1.3x", r is not None and r <= 1.3)
            stage_rows(w.get("restore_registry_timings_s", {}), rr, w.get("restore_registry_cmd_s", 0))
            got = ck1.get("registry_bytes") or size  # what the registry holds for it (the 2nd push added little)
            rt = w.get("restore_registry_timings_s", {})
            background = rt.get("background: pull into the image directory")
            if background:
                # The pull ran on its own thread beside the engine's preparation: its own time.
                row(f"  pull alone, on its thread (~{gb(got):.2f} GB fetched)", background,
                    f"{gb(got) / background / http_down:.2f}x HTTP download floor" if http_down else "", rate_bytes=got)
            else:
                # What the command spent besides its own restore step: pulling and writing the image.
                pull = w.get("restore_registry_cmd_s", 0) - rt.get("restore", 0)
                if pull > 0:
                    row(f"  of which pull, command minus its restore step (~{gb(got):.2f} GB fetched)", pull,
                        f"{gb(got) / pull / http_down:.2f}x HTTP download floor" if http_down else "", rate_bytes=got)
            if w.get("restore_registry_registry_cpu_s"):
                rows.append((f"  the local registry's process meanwhile: {w['restore_registry_registry_cpu_s']:.1f} CPU s", "", "", "", ""))
        for knob, (_, _, labels) in CK_AB_KNOBS.items():
            ab = w.get(f"checkpoint_ab_{knob}") or []
            for on, label in zip((True, False), labels):
                got = [x for x in ab if x.get(knob) == on]
                if got:
                    med = statistics.median(x["seconds"] for x in got)
                    med_ck = statistics.median(x["timings_s"].get("checkpoint", 0) for x in got)
                    med_st = statistics.median(x["timings_s"].get("store the checkpoint", 0) for x in got)
                    extra = (f"{med / bare_ck:.2f}x by hand; its checkpoint step {med_ck:.2f} s = {med_ck / bare_ck:.2f}x; "
                             f"store after it {med_st:.2f} s" if bare_ck else "")
                    row(f"A/B: checkpoint --push, {label} ({len(got)} rounds, median)", med, extra)
        abreg = w.get("checkpoint_ab_registry") or []
        for alt, label in ((False, "the run's registry"), (True, f"--ab-registry ({res.get('versions', {}).get('ab_registry', '?')})")):
            got = [x for x in abreg if x["alt"] == alt]
            if got:
                med = statistics.median(x["seconds"] for x in got)
                dump = statistics.median(x["timings_s"].get("checkpoint: runtime: runc checkpoint", 0) for x in got)
                cpu = statistics.median(x["registry_cpu_s"] for x in got)
                row(f"A/B registry: checkpoint --push to {label} ({len(got)} rounds, median)", med,
                    (f"{med / bare_ck:.2f}x by hand; " if bare_ck else "") + f"dump {dump:.2f} s; the registry {cpu:.1f} CPU s "
                    f"({cpu / max(gb(w.get('image_bytes', 0)), 1e-9):.2f} per GB of the image)")
        beside = w.get("checkpoint_ab_dump_beside") or []
        for cond, (_, _, label) in DUMP_BESIDE.items():
            got = [x for x in beside if x["condition"] == cond]
            if got:
                med = {k: statistics.median(x["timings_s"].get(k, 0) for x in got) for k in DUMP_TIMINGS}
                row(f"A/B dump beside: checkpoint --push, {label} ({len(got)} rounds, median)",
                    statistics.median(x["seconds"] for x in got),
                    (f"{statistics.median(x['seconds'] for x in got) / bare_ck:.2f}x by hand; " if bare_ck else "")
                    + "; ".join(f"{k.split(': ')[-1]} {v:.2f}" for k, v in med.items()))
        for knob, (_, _, labels) in AB_KNOBS.items():
            # e2e.json files before AB_KNOBS kept the criu_before_pages rounds under "restore_registry_ab" (--report reads them).
            legacy = w.get("restore_registry_ab") if knob == "criu_before_pages" else None
            ab = w.get(f"restore_registry_ab_{knob}") or legacy or []
            for on, label in zip((True, False), labels):
                secs = [x["first_step_s"] for x in ab if x.get(knob) == on]
                if secs:
                    med = statistics.median(secs)
                    extra = f"{med / bare_rs:.2f}x by hand" if bare_rs else ""
                    if cs_all := w.get("cold_start_s"):
                        extra += f"; cold start / this = {cs_all / med:.1f}x"
                    row(f"A/B: restore from the registry, {label} ({len(secs)} rounds, median)", med, extra)
        cs = w.get("cold_start_s")
        if cs:
            for label, val in (("local store", rl), ("registry", rr)):
                if val:
                    ratio = cs / val
                    target = w.get("cold_start_target")
                    rows.append((f"cold start / restore from the {label}", f"{cs:.2f} / {val:.2f}", "", f"{ratio:.1f}x" + (f" (target >= {target:g}x)" if target else ""),
                                 verdict(ratio >= target) if target else ""))
        ck2 = w.get("ck2")
        if ck2 and ck1.get("registry_bytes"):
            pct = 100 * ck2["registry_bytes"] / ck1["registry_bytes"]
            target = w.get("growth_target")
            rows.append(("2nd checkpoint: registry growth, % of the 1st push", f"{ck2['seconds']:.2f}", "", f"{pct:.2f} % ({gb(ck2['registry_bytes']):.3f} GB)" + (f" (target <= {target:g} %)" if target else ""),
                         verdict(pct <= target) if target else ""))
            spct = 100 * ck2["store_bytes"] / max(ck1["store_bytes"], 1)
            rows.append(("2nd checkpoint: store growth, % of the 1st", "", "", f"{spct:.2f} % ({gb(ck2['store_bytes']):.3f} GB)", ""))
        peak = max((x["rss_own_mib"] for x in w["rss"]), default=0)
        peak_tree = max((x["rss_tree_mib"] for x in w["rss"]), default=0)
        if w["rss"]:
            rows.append(("peak RSS of a gpusnap command (own / with children)", "", "", f"{peak:.0f} / {peak_tree:.0f} MiB (target <= 512)", verdict(peak <= 512)))
        for key in ("bare_continuation", "restore_local_continuation", "restore_registry_continuation"):
            if key in w:
                c = w[key]
                rows.append((f"continuation: {key.replace('_continuation', '').replace('_', ' ')}", "", "", f"{c['same']} steps equal, {c['differ']} differ" + (f" (numbers within {w['rel_tol']:g} relative)" if w.get("rel_tol") else ""), verdict(c["differ"] == 0 and c["same"] > 0)))
        lines += ["", f"== {w['workload']}: image {gb(size):.2f} GB" + (f", GPU memory {w['gpu_memory_gb']:.1f} GB" if w.get("gpu_memory_gb") else "")
                  + (f"; {w['ready_line']}" if w.get("ready_line") else ""),
                  "| stage | s | GB/s | ratio | target |", "|---|---:|---:|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
        if "cudagraphs=on" in w.get("ready_line", ""):
            def survived(key: str) -> str:
                c = w.get(key)
                return "not run" if c is None else ("yes (same tokens after restore)" if c["same"] and not c["differ"] else "no")

            lines.append(f"CUDA graphs (torch.compile reduce-overhead) after checkpoint/restore: by hand {survived('bare_continuation')}, "
                         f"gpusnap from the store {survived('restore_local_continuation')}, from the registry {survived('restore_registry_continuation')}"
                         + (f"; {w['cuda_graphs_fallback']}" if w.get("cuda_graphs_fallback") else ""))
        if w.get("bare_error"):
            lines.append(f"by hand FAILED: {w['bare_error'][:600]}")
        if w.get("skipped"):
            lines.append(f"skipped: {', '.join(w['skipped'])}")
        if w.get("error"):
            lines.append(f"ERROR: {w['error']}")
        lines.append("gpusnap commands (s, peak RSS own/tree MiB): " + "; ".join(f"{x['command']} {x['seconds']:.1f} s {x['rss_own_mib']:.0f}/{x['rss_tree_mib']:.0f}" for x in w["rss"]))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="GPU workloads (inference server, training) on a GPU machine")
    ap.add_argument("--workloads", help="comma-separated, of cpu, server, train (default: cpu; with --gpu: server,train)")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/gpusnap-e2e"), help="the stores (the disk-write floor is measured here), workload copies, weights")
    ap.add_argument("--registry-dir", type=Path, help="the registry's storage (default: under --work)")
    ap.add_argument("--state-dir", type=Path, default=Path("/dev/shm/gpusnap-e2e-state"),
                    help="GPUSNAP_STATE_DIR: where gpusnap (and the by-hand steps) write CRIU images before storing them / after pulling them")
    ap.add_argument("--out", type=Path, help="results directory (default bench/results/<host>-<date>)")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run; optional stages are skipped past it (0: none)")
    ap.add_argument("--cpu-random-mib", type=int, default=1024)
    ap.add_argument("--cpu-zero-mib", type=int, default=256)
    ap.add_argument("--cpu-const-mib", type=int, default=256)
    ap.add_argument("--workload-python", help="interpreter of the workloads (default: this one); it needs torch and transformers for server/train")
    ap.add_argument("--train-batch", type=int, default=16)
    ap.add_argument("--train-second-checkpoint", action="store_true", help="also a second checkpoint of the training run")
    ap.add_argument("--train-store-only", action="store_true", help="also a checkpoint without --push of the training run (the store's own speed)")
    ap.add_argument("--server-compile", default="reduce-overhead", choices=["reduce-overhead", "default", "none"])
    ap.add_argument("--server-keep-compile-workers", action="store_true",
                    help="the server leaves inductor's compile processes running (in every checkpoint) instead of stopping them once warm")
    ap.add_argument("--floor-gib", type=float, default=0, help="bytes for each floor (default 1 GiB CPU, 4 GiB GPU)")
    ap.add_argument("--ab-criu-before-pages", action="store_true",
                    help="after the restore from the registry, three more: CRIU started before the pages are whole (GPUSNAP_CRIU_BEFORE_PAGES=1), not, and again")
    ap.add_argument("--ab-lazy-pages", action="store_true",
                   help="after the restore from the registry, four more: lazy pages served by gpusnap (GPUSNAP_LAZY_PAGES=1), eager, lazy, eager")
    ap.add_argument("--ab-store-nice", action="store_true",
                    help="also checkpoint --push the running workload with the store's threads at nice 0 and 10 in turn (GPUSNAP_STORE_NICE)")
    ap.add_argument("--ab-push-nice", action="store_true",
                    help="also checkpoint --push the running workload with its uploads at nice 10 and 19 in turn, the store at 10 (GPUSNAP_PUSH_NICE)")
    ap.add_argument("--ab-push-processes", action="store_true",
                    help="also checkpoint --push the running workload with its uploads on the storing process's threads and in 2 transfer processes in turn (GPUSNAP_PUSH_PROCESSES)")
    ap.add_argument("--ab-dump-beside", nargs="?", const=",".join(DUMP_BESIDE_RUN), default="", metavar="CONDITIONS",
                    help="also checkpoint --push the running workload twice under each condition, interleaved (what the "
                         "store beside it costs CRIU's dump); default " + ",".join(DUMP_BESIDE_RUN) + "; any of " + ", ".join(
                             f"{k} ({v[2]})" for k, v in DUMP_BESIDE.items()))
    ap.add_argument("--ab-registry", metavar="BIN",
                    help="a second registry program (e.g. a distribution v3 build: bench/build_registry.sh): its HTTP floor, and "
                         "checkpoint --push of the running workload to the run's registry and to it in turn, A B A B")
    ap.add_argument("--criu-logs", action="store_true",
                    help="keep CRIU's dump.log of every checkpoint, by hand and gpusnap's (GPUSNAP_CRIU_LOG_DIR); "
                         "writes criu-phases.txt (bench/criu_log_phases.py over them, in the order they ran) and criu-logs.tar.xz")
    ap.add_argument("--store-variants", default="",
                    help="a comma list of bench/store_scale.py variants ('as-is' = as shipped): the by-hand CRIU image stored "
                         "into an empty store once per entry, in that order, after the by-hand rounds")
    ap.add_argument("--store-variants-beside", default="",
                    help="the same, again right after the store-only checkpoint, gpusnap's workload running (the by-hand image is kept till then)")
    ap.add_argument("--skip-ckdiff", action="store_true", help="no ckdiff between the two checkpoints (its diagnosis is in earlier runs; saves ~30 s on the GPU host)")
    ap.add_argument("--py-spy", help="py-spy binary: record the CLI timelines of the checkpoint stored after the dump and of both "
                    "restores (a diagnosis: they run slower so)")
    ap.add_argument("--source-digest", action="store_true", help="print the digest of the gpusnap sources the gpusnap command runs, and exit")
    ap.add_argument("--report", type=Path, help="print the tables of a saved e2e.json again and exit")
    ap.add_argument("--floor", help=argparse.SUPPRESS)
    ap.add_argument("--floor-args", help=argparse.SUPPRESS)
    args = ap.parse_args()
    bad = [c for c in args.ab_dump_beside.split(",") if args.ab_dump_beside and c not in DUMP_BESIDE]
    if bad:
        ap.error(f"--ab-dump-beside: unknown condition {bad[0]!r}; one of {', '.join(DUMP_BESIDE)}")
    for opt, text in (("--store-variants", args.store_variants), ("--store-variants-beside", args.store_variants_beside)):
        if text:
            try:
                store_scale().parse_variants(text)
            except ValueError as exc:
                ap.error(f"{opt}: {exc}")
    if args.floor:
        kw = json.loads(args.floor_args or "{}")
        fn = {"memcpy": floor_memcpy, "sha256": floor_sha256, "disk": floor_disk, "http": floor_http, "python": floor_python}[args.floor]
        print(json.dumps(fn(**kw)))
        return 0

    if args.report:
        saved = json.loads(args.report.read_text())
        print("\n".join(report(saved, bool(saved.get("gpu")))))
        return 0
    gpusnap = shutil.which("gpusnap") or str(Path(sys.executable).parent / "gpusnap")
    package = measured_package(gpusnap)
    if args.source_digest:
        print(source_digest(package))
        return 0
    t_begin = time.time()
    deadline = t_begin + args.budget if args.budget else 0
    if os.geteuid() != 0:
        print("e2e: run as root (it starts containers)", file=sys.stderr)
        return 2
    host = socket.gethostname().split(".")[0]
    args.out = args.out or REPO / "bench" / "results" / f"{'gpu' if args.gpu else 'cpu'}-e2e-{host}-{time.strftime('%Y-%m-%d-%H%M')}"
    args.out.mkdir(parents=True, exist_ok=True)
    compiled = byte_compile(package)
    runc = shutil.which("runc")
    if not runc or not shutil.which("criu"):
        print("e2e: runc and criu must be on PATH", file=sys.stderr)
        return 2
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    shutil.rmtree(args.state_dir, ignore_errors=True)
    # Containers run on an overlay of /: the workload scripts (and weights) must be on the root
    # filesystem, so they are copied into --work, which must be there too.
    if os.stat(args.work).st_dev != os.stat("/").st_dev:
        print(f"e2e: --work {args.work} is not on the root filesystem, which the containers see; pick a directory there", file=sys.stderr)
        return 2
    workloads = args.work / "workloads"
    shutil.copytree(WORKLOADS, workloads)
    reg_root = args.registry_dir or args.work / "registry"
    alt_root = reg_root.with_name(reg_root.name + "-ab")  # --ab-registry's storage, beside the first's
    shutil.rmtree(reg_root, ignore_errors=True)
    if args.ab_registry and not os.access(args.ab_registry, os.X_OK):
        print(f"e2e: --ab-registry {args.ab_registry} is not an executable file; give the path of a registry program", file=sys.stderr)
        return 2
    py = sys.executable
    fsize = int((args.floor_gib or (4 if args.gpu else 1)) * GIB)
    res: dict[str, Any] = {"host": host, "gpu": args.gpu, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_begin)), "cores": os.cpu_count(),
                           "versions": versions(gpusnap, runc, package, args.ab_registry), "workloads": []}
    say(f"e2e on {host}: {os.cpu_count()} cores; {res['versions']}")
    say(f"gpusnap's bytecode: {compiled}")
    cuda = CudaDriver() if args.gpu else None
    with Registry(reg_root, E2E_PORTS) as registry:
        floors: dict[str, Any] = {}
        floors |= run_floor("memcpy", size=fsize)
        floors["canary_idle_gbps"] = Pressure.idle_canary()  # the baseline of Pressure's canary
        floors |= run_floor("sha256", size=fsize)
        floors |= run_floor("disk", size=fsize, directory=str(args.work))
        floors |= run_floor("http", size=fsize, host=registry.host, streams=min(8, os.cpu_count() or 1),
                            registry_pid=registry_pid(registry))
        floors |= run_floor("python", gpusnap=gpusnap)
        if args.ab_registry:
            with Registry(alt_root, E2E_PORTS, binary=args.ab_registry) as alt:
                floors["ab_registry"] = run_floor("http", size=fsize, host=alt.host, streams=min(8, os.cpu_count() or 1),
                                                  registry_pid=registry_pid(alt))
            shutil.rmtree(alt_root, ignore_errors=True)
        # Whether the registry writes to the disk the stores write to (the one-disk floor below);
        # GPU runs keep it on /dev/shm.
        reg_root.mkdir(parents=True, exist_ok=True)
        floors["registry_on_the_stores_disk"] = os.stat(reg_root).st_dev == os.stat(args.work).st_dev
        res["floors"] = floors
    shutil.rmtree(reg_root, ignore_errors=True)
    wpy = args.workload_python or py
    tiny = [] if args.gpu else ["--small"]  # the GPT-2 workloads on a CPU: tiny models, to try the harness
    names = (args.workloads or ("server,train" if args.gpu else "cpu")).split(",")
    weights = args.work / "gpt2-large"
    if "server" in names:
        say("writing GPT-2 large weights (random, seeded) as safetensors")
        c = measure([wpy, str(workloads / "gpt2_server.py"), "setup", str(weights), *tiny], timeout=600)
        say(c.stdout.strip() or c.stderr.strip()[-1000:])
    catalog = {
        "server": Workload("server", [wpy, str(workloads / "gpt2_server.py"), "serve", str(weights), "--compile", args.server_compile,
                                     *(["--keep-compile-workers"] if args.server_keep_compile_workers else [])], args.gpu, 900, 5,
                           growth_target=10.0, cold_start_target=10.0, bare_running=3),
        # Training changes all its state every step: a second checkpoint says nothing new, and its
        # minutes are better spent on the restores within one 10-minute run.
        "train": Workload("train", [wpy, str(workloads / "gpt2_train.py"), "--batch", str(args.train_batch), *tiny], args.gpu, 600, 3, diff=False,
                          second_checkpoint=args.train_second_checkpoint, rel_tol=1e-5, bare_rounds=1,
                          store_only=args.train_store_only),
        "cpu": Workload("cpu", [wpy, str(workloads / "cpu_holder.py"), "--random-mib", str(args.cpu_random_mib), "--zero-mib", str(args.cpu_zero_mib),
                                "--const-mib", str(args.cpu_const_mib)], False, 300, 5, growth_target=2.0, bare_running=3),
    }
    unknown = set(names) - set(catalog)
    if unknown:
        print(f"e2e: unknown workload(s) {', '.join(sorted(unknown))}; pick from {', '.join(catalog)}", file=sys.stderr)
        return 2
    try:
        with Registry(reg_root, E2E_PORTS) as registry, contextlib.ExitStack() as stack:
            alt = stack.enter_context(Registry(alt_root, E2E_PORTS, binary=args.ab_registry)) if args.ab_registry else None
            env = Env(args, args.work, [gpusnap], runc, registry, cuda, deadline, res, alt)
            for n in names:
                if deadline and time.time() > deadline - 60:
                    res["workloads"].append({"workload": n, "rss": [], "skipped": ["all (time)"]})
                    continue
                res["workloads"].append(run_workload(env, catalog[n]))
                # Written after each workload: a run cut short by a time limit keeps what it did.
                (args.out / "e2e.json").write_text(json.dumps(res, indent=1))
    finally:
        if args.criu_logs:
            summarize_criu_logs(args.work / "criu-logs", args.out)
        shutil.rmtree(args.work, ignore_errors=True)
        shutil.rmtree(reg_root, ignore_errors=True)  # on /dev/shm in GPU runs: memory
        shutil.rmtree(alt_root, ignore_errors=True)
        shutil.rmtree(args.state_dir, ignore_errors=True)
        res["seconds"] = time.time() - t_begin
        lines = report(res, args.gpu)
        for line in lines:
            print(line)
        (args.out / "e2e.json").write_text(json.dumps(res, indent=1))
        (args.out / "e2e.log").write_text("\n".join(LOG + lines) + "\n")
        say(f"wrote {args.out}/e2e.json and e2e.log ({res['seconds']:.0f} s)")
    failed = any("error" in w for w in res["workloads"])
    return 1 if failed else 0


def summarize_criu_logs(logs: Path, out: Path) -> None:
    """--criu-logs: the phases of every kept dump.log side by side (criu-phases.txt) and the logs
    themselves, xz-compressed (level 4 logs of a GPU dump run to megabytes)."""
    found = sorted(logs.glob("*.log"), key=lambda p: p.stat().st_mtime) if logs.is_dir() else []
    if not found:
        say("--criu-logs: no CRIU log was kept")
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import criu_log_phases

    text = "\n".join(criu_log_phases.report([criu_log_phases.parse(p) for p in found])) + "\n"
    (out / "criu-phases.txt").write_text(text)
    subprocess.run(["tar", "-C", str(logs), "-cJf", str(out / "criu-logs.tar.xz"), *[p.name for p in found]], check=False)
    say(f"--criu-logs: {len(found)} CRIU logs; phases in {out / 'criu-phases.txt'}")


def source_digest(found: tuple[str, str] | str) -> str:
    """SHA-256 (first 12 hex) over the path and bytes of every .py file of the gpusnap package
    ``found`` (:func:`measured_package`): which code ran, whatever the checkout's git says (a lent
    GPU machine's copy of the tree may carry an older .git). `bench/e2e.py --source-digest`
    prints it."""
    if isinstance(found, str):
        return f"? ({found})"
    root = Path(found[1])
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def versions(gpusnap: str, runc: str, package: tuple[str, str] | str, ab_registry: str | None = None) -> dict[str, str]:
    def first(cmd: list[str]) -> str:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            return (p.stdout or p.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "?"

    staged = REPO / "COMMIT"  # tests/gpu/stage.sh's copy is no git checkout: it says which commit it is
    commit = staged.read_text().strip() if staged.is_file() else first(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    v = {"commit": commit, "source": source_digest(package), "gpusnap": first([gpusnap, "--version"]), "runc": first([runc, "--version"]), "criu": first(["criu", "--version"]), "python": sys.version.split()[0]}
    v["registry"] = first([REGISTRY_BIN, "--version"])
    if ab_registry:
        v["ab_registry"] = first([ab_registry, "--version"])
    if shutil.which("nvidia-smi"):
        v["gpu"] = first(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    return v


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
