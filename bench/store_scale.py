#!/usr/bin/env python3
"""Store throughput and peak RSS of ``store_checkpoint`` on a large synthetic CRIU image directory.

    .venv/bin/python bench/store_scale.py --gib 4 --src /dev/shm/gs-scale --store /var/tmp/gs-scale-store
    .venv/bin/python bench/store_scale.py --gib 16 --src /var/tmp/gs-scale --store /var/tmp/gs-scale-store --rss-only

The directory holds what a CRIU dump of a GPU process looks like to the store: a pagemap with
many ranges at page-aligned addresses and one large ``pages-1.img``, of which ~70 % unique data
(every page different, so nothing dedups by accident), ~18 % zero pages (a GPU server's share)
and ~12 % pages repeated inside the checkpoint. It is generated, not random-read from the
kernel: 1 GiB takes ~1 s. ``--workers 16`` sizes the store's pools as on a 16-core host (memory
is what it shows there; time is this machine's). Each store runs in a fresh process (``--child``) whose own peak RSS
(VmHWM, not ru_maxrss: a vforked child inherits its parent's high-water mark there) is reported
with its time and CPU seconds per GB (user + system: on a shared machine the steadier figure). Runs: the first store into an empty store, then a second store of the same
directory (everything known: what a checkpoint of unchanged memory costs).
The source is made once and kept (``--keep``) so that before/after runs read the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from criu_images import present_pagemap  # noqa: E402

PAGE = 4096
MIB = 1 << 20
GIB = 1 << 30
BLOCK = 64 * MIB  # generated in blocks of this size
RANGE_PAGES = 2048  # 8 MiB mappings, 2 MiB apart in the address space








def make_source(path: Path, size: int) -> None:
    """Write the synthetic image directory (see the module doc)."""
    if (path / "pages-1.img").is_file() and (path / "pages-1.img").stat().st_size == size:
        return
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    rng = np.random.default_rng(12)
    base = rng.integers(0, 2**63, BLOCK // 8, dtype=np.uint64).reshape(-1, PAGE // 8)
    shared = rng.integers(0, 2**63, 8 * MIB // 8, dtype=np.uint64).tobytes()  # repeated inside the checkpoint
    pages_total = size // PAGE
    with open(path / "pages-1.img", "wb") as f:
        for blk in range(0, pages_total, BLOCK // PAGE):
            n = min(BLOCK // PAGE, pages_total - blk)
            k = blk // (BLOCK // PAGE)
            kind = k % 17
            if kind in (3, 9, 14):  # ~18 % zero
                f.write(bytes(n * PAGE))
            elif kind in (6, 12):  # ~12 % repeated data
                f.write((shared * (BLOCK // len(shared)))[: n * PAGE])
            else:
                a = base[:n].copy()
                a[:, 0] = np.arange(blk, blk + n, dtype=np.uint64)  # every page unique
                a[:, 1] ^= np.uint64(k)
                f.write(a.tobytes())
    entries = [(0x7F0000000000 + i * (RANGE_PAGES * PAGE + 2 * MIB), min(RANGE_PAGES, pages_total - i))
               for i in range(0, pages_total, RANGE_PAGES)]
    entries = [(0x7F0000000000 + j * (RANGE_PAGES * PAGE + 2 * MIB), n) for j, (_, n) in enumerate(entries)]
    (path / "pagemap-1.img").write_bytes(present_pagemap(1, entries))
    (path / "pstree.img").write_bytes(b"")
    (path / "core-1.img").write_bytes(b"core")
    (path / "inventory.img").write_bytes(b"inv")


def hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


VARIANTS = {
    "": "as shipped",
    "no-kick": "no sync_file_range after each write (the kernel writes back on its own until the packs' fdatasync)",
    "packN": "packs of N MiB (e.g. pack64, pack128) instead of 32 MiB",
    "per-piece": "each new piece handed to its lane as its own view (hashed in its own call), as before the "
                 "fourteenth session, instead of one view per run of adjacent pieces",
    "pack-sync": "each pack fdatasynced as it is sealed (before the fourteenth session) instead of all at the "
                 "store's publish",
    "sync-at-end": "packs made durable at the store's publish with one syncfs (instead of fdatasyncs on 16 threads)",
    "lanesN": "N packs filled at once (e.g. lanes4, lanes8) instead of pack.LANES (the packs differ; the pieces do not)",
    "zstdN": "pieces compressed at zstd level N (e.g. zstd1, zstd3), as `checkpoint --compress` does at level 3, "
             "where a piece's frame saves at least a tenth",
    "sha256": "pieces keyed by SHA-256 (a GSPIECE2 table, as before the seventeenth session) instead of BLAKE3",
}


def parse_variants(text: str) -> list[str]:
    """A comma list of variants as the child takes them ('as-is' is ''); ValueError names the
    first unknown one."""
    out = []
    for v in text.split(",") if text else []:
        v = "" if v == "as-is" else v
        if v not in VARIANTS and not any(v.startswith(k[:-1]) and v[len(k) - 1:].isdigit() for k in VARIANTS if k.endswith("N")):
            raise ValueError(f"unknown variant {v!r}; one of as-is, {', '.join(k for k in VARIANTS if k)}")
        out.append(v)
    return out


def child(src: Path, store: Path, ref: str, workers: int | None, push: str = "", switch: float = 0.0,
          variant: str = "") -> None:
    import dataclasses
    import inspect
    import resource

    if switch:
        sys.setswitchinterval(switch)
    # Variants for a diagnosis of the store's disk writes, patched into this process only.
    compress = False
    if variant == "no-kick":
        from gpusnap.packaging import store as store_mod

        store_mod._sync_file_range = None
    elif variant.startswith("pack") and variant[4:].isdigit():
        from gpusnap.packaging import pack

        # The store makes its parameters with PackParams(): a subclass whose default differs.
        @dataclasses.dataclass(frozen=True)
        class PackN(pack.PackParams):
            pack_target: int = int(variant[4:]) << 20

        pack.PackParams = PackN  # type: ignore[misc]
    elif variant == "pack-sync":
        from gpusnap.packaging import store as store_mod

        real = store_mod.OciStore.placed_writer
        store_mod.OciStore.placed_writer = lambda self, sync=False, kick=True: real(self, sync=True)  # type: ignore[method-assign]
    elif variant == "sync-at-end":
        from gpusnap.packaging import store as store_mod

        store_mod.SYNC_PARALLEL_MAX = 0  # type: ignore[misc]
    elif variant == "per-piece":
        from gpusnap.packaging import pack

        class PerPiece(pack._Piece):  # type: ignore[name-defined]
            def __post_init__(self) -> None:
                self.at = -1  # "not in a window": never merged with its neighbour

        pack._Piece = PerPiece  # type: ignore[misc]
    elif variant.startswith("lanes") and variant[5:].isdigit():
        from gpusnap.packaging import pack

        pack.LANES = int(variant[5:])  # type: ignore[misc]
    elif variant.startswith("zstd") and variant[4:].isdigit():
        from gpusnap.packaging import pack

        @dataclasses.dataclass(frozen=True)
        class Zstd(pack.PackParams):
            compress_level: int = int(variant[4:])

        pack.PackParams = Zstd  # type: ignore[misc]
        compress = True
    elif variant == "sha256":
        from gpusnap.packaging import layout as lay

        lay.PIECE_DIGEST = lay.DIGEST_SHA256  # type: ignore[misc]  # read by each PackWriter as it starts
    elif variant:
        raise SystemExit(f"unknown variant {variant!r}; one of {', '.join(v for v in VARIANTS if v)}")  # noqa

    from gpusnap.packaging import api

    kw: dict[str, object] = {"workers": workers} if workers and "workers" in inspect.signature(api.store_checkpoint).parameters else {}
    if workers and not kw:
        os.cpu_count = lambda: workers  # type: ignore[assignment]  # a gpusnap without the parameter sizes its pool by this
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    pipeline = api.start_push(store, push, insecure=True) if push else None
    if pipeline is not None:
        kw["on_blob"] = pipeline.on_blob  # checkpoint --push: each blob goes up as soon as it is stored
    if compress:
        kw["compress"] = True
    st = api.store_checkpoint(store, src, form="criu-dir", ref=ref, **kw)
    store_s = time.perf_counter() - t0
    if pipeline is not None:
        pipeline.finish(ref)
    secs = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    on_disk = sum(f.stat().st_size for f in Path(store).rglob("*") if f.is_file())  # compressed, where a variant compresses
    print(json.dumps({"seconds": secs, "store_s": store_s, "cpu_s": cpu, "hwm": hwm(), "new_bytes": st.new_bytes, "size": st.size,
                      "store_bytes": on_disk}))


class DiskSampler:
    """Sectors written to one block device (/proc/diskstats), sampled every 20 ms while a store
    runs: when the disk starts and stops taking the store's writes, and how fast meanwhile."""

    def __init__(self, dev: str) -> None:
        import threading

        self.dev, self.samples = dev, []  # (seconds, bytes written so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _written(self) -> int:
        for line in Path("/proc/diskstats").read_text().splitlines():
            f = line.split()
            if f[2] == self.dev:
                return int(f[9]) * 512
        raise SystemExit(f"no block device {self.dev} in /proc/diskstats")

    def _run(self) -> None:
        t0, b0 = time.perf_counter(), self._written()
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - t0, self._written() - b0))
            self._stop.wait(0.02)
        self.samples.append((time.perf_counter() - t0, self._written() - b0))

    def __enter__(self) -> "DiskSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        total = self.samples[-1][1]
        if not total:
            return {"disk_gb": 0.0}
        first = next(t for t, b in self.samples if b > 0.01 * total)
        last = next(t for t, b in self.samples if b >= 0.99 * total)
        best = 0.0  # the fastest 0.5 s
        j = 0
        for t, b in self.samples:
            while self.samples[j][0] < t - 0.5:
                j += 1
            if t - self.samples[j][0] >= 0.45:
                best = max(best, (b - self.samples[j][1]) / (t - self.samples[j][0]))
        return {"disk_gb": round(total / 1e9, 3), "disk_first_s": round(first, 2), "disk_last_s": round(last, 2),
                "disk_gbps_between": round(0.98 * total / max(last - first, 1e-3) / 1e9, 3), "disk_gbps_best_0.5s": round(best / 1e9, 3)}


def disk_of(path: Path) -> str:
    """The block device (as /proc/diskstats names it) holding ``path``'s filesystem; '' if none."""
    st = os.stat(path)
    link = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return link.resolve().name if link.exists() else ""


def run_store(src: Path, store: Path, ref: str, size: int, workers: int | None, push: str = "",
              profile: Path | None = None, switch: float = 0.0, gil: Path | None = None, variant: str = "",
              disk: str = "") -> dict[str, float]:
    """One store of ``src`` (a CRIU image directory) into ``store`` in a child process; its
    speed, CPU, peak RSS and (``disk``: a block device name) how the disk took its writes."""
    cmd = [sys.executable, __file__, "--child", "--src", str(src), "--store", str(store), "--ref", ref,
           "--workers", str(workers or 0), "--push", push, "--switch-interval", str(switch), "--variant", variant]
    if gil is not None:
        # Only the samples of the thread that holds the interpreter lock: what of the store is serial.
        gil.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["py-spy", "record", "--gil", "--threads", "--rate", "200", "--format", "raw", "-o", str(gil), "--", *cmd]
    elif profile is not None:
        # py-spy samples every thread, idle ones too: where the store and the uploads wait.
        profile.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["py-spy", "record", "--threads", "--idle", "--rate", "200", "--format", "raw", "-o", str(profile), "--", *cmd]
    if disk:
        os.sync()  # what came before is not this store's to write
    import contextlib

    sampler = DiskSampler(disk) if disk else None
    with sampler or contextlib.nullcontext():
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    r = json.loads([line for line in out.stdout.strip().splitlines() if line.startswith("{")][-1])
    return {"seconds": round(r["seconds"], 2), "store_s": round(r.get("store_s", r["seconds"]), 2),
            "gb_s": round(size / r["seconds"] / 1e9, 3), "cpu_s_per_gb": round(r["cpu_s"] / (size / 1e9), 3),
            "peak_rss_mib": round(r["hwm"] / MIB, 1), "new_gb": round(r["new_bytes"] / 1e9, 3),
            "store_gb": round(r.get("store_bytes", 0) / 1e9, 3), **(sampler.summary() if sampler else {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--src", type=Path, default=Path("/var/tmp/gs-store-scale-src"))
    ap.add_argument("--store", type=Path, default=Path("/var/tmp/gs-store-scale-store"))
    ap.add_argument("--ref", default="scale:1")
    ap.add_argument("--rss-only", action="store_true", help="one store only (no second, deduped one)")
    ap.add_argument("--workers", default="0", help="the store's worker threads (default: one per core); "
                    "e.g. 16 to see the memory of a 16-core host on a small one; a comma list (1,4,16) runs "
                    "the first store once per count")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="the store process's sys.setswitchinterval (seconds; 0: Python's 0.005)")
    ap.add_argument("--gil", type=Path, default=None,
                    help="py-spy --gil raw profile of the first store (one worker count) into this folder")
    ap.add_argument("--keep", action="store_true", help="keep the source directory for the next run")
    ap.add_argument("--push", default="", help=argparse.SUPPRESS)  # the child's: host:port/repo:tag
    ap.add_argument("--with-push", action="store_true",
                    help="also store while pushing to a local docker-registry (checkpoint --push's pipeline), "
                         "registry storage on /dev/shm, next to the store alone in the same run")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy raw profiles of each store into this folder")
    ap.add_argument("--variant", default="", help="a comma list of store variants run in turn, each as a first store "
                    "('' = as shipped): " + "; ".join(f"{k or 'as-is'}: {v}" for k, v in VARIANTS.items()))
    ap.add_argument("--disk", default="", help="block device to sample while each store runs (e.g. vda): when it "
                    "writes and how fast, and before the stores the disk floor of bench/e2e.py")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    counts = [int(w) for w in str(a.workers).split(",")]
    if a.child:
        child(a.src, a.store, a.ref, counts[0] or None, a.push, a.switch_interval, a.variant)
        return 0
    try:
        variants = parse_variants(a.variant)
    except ValueError as exc:
        raise SystemExit(f"store_scale: {exc}") from None
    size = int(a.gib * GIB) // PAGE * PAGE
    t0 = time.perf_counter()
    make_source(a.src, size)
    print(f"source {a.src}: {size / GIB:.1f} GiB ({time.perf_counter() - t0:.1f} s to make); {os.cpu_count()} cores", flush=True)
    shutil.rmtree(a.store, ignore_errors=True)
    prof = (lambda name: a.profile / f"{name}.txt") if a.profile else (lambda name: None)
    workers = counts[-1] or None
    if a.disk:
        sys.path.insert(0, str(REPO / "bench"))
        from e2e import floor_disk

        a.store.parent.mkdir(parents=True, exist_ok=True)
        print(f"disk floor ({a.store.parent}): {json.dumps(floor_disk(size, str(a.store.parent)))}", flush=True)
    try:
        for v in variants:
            row = run_store(a.src, a.store, "scale:1", size, workers, variant=v, disk=a.disk, switch=a.switch_interval)
            print(f"first store, variant {v or 'as-is'}: {json.dumps(row)}", flush=True)
            shutil.rmtree(a.store, ignore_errors=True)
        for n in counts[:-1]:  # the scaling rows: each a first store into an empty store
            row = run_store(a.src, a.store, "scale:1", size, n or None, switch=a.switch_interval, disk=a.disk)
            print(f"first store, {n} workers:      {json.dumps(row)}", flush=True)
            shutil.rmtree(a.store, ignore_errors=True)
        first = run_store(a.src, a.store, "scale:1", size, workers, profile=prof("store"), switch=a.switch_interval,
                          gil=a.gil / "store-gil.txt" if a.gil else None, disk=a.disk)
        print(f"first store (empty store{f', {workers} workers' if workers else ''}): {json.dumps(first)}", flush=True)
        if not a.rss_only:
            second = run_store(a.src, a.store, "scale:2", size, workers, switch=a.switch_interval)
            print(f"second store (all pieces known): {json.dumps(second)}", flush=True)
        if a.with_push:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from stack.registry import Registry

            shutil.rmtree(a.store, ignore_errors=True)
            with Registry(Path("/dev/shm/gs-store-scale-registry"), range(5480, 5500)) as reg:
                pushed = run_store(a.src, a.store, "scale:1", size, workers, push=f"{reg.host}/scale/push:1",
                                   profile=prof("store-push"), switch=a.switch_interval)
            shutil.rmtree("/dev/shm/gs-store-scale-registry", ignore_errors=True)
            print(f"store + pipelined push (empty store and registry): {json.dumps(pushed)}; "
                  f"store {pushed['store_s'] / first['seconds']:.2f}x the store alone", flush=True)
    finally:
        shutil.rmtree(a.store, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(a.src, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
