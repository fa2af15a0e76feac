#!/usr/bin/env python3
"""The read side of the data path, without containers: materialize a stored checkpoint into an
image directory, and fetch one from a real local registry into an image directory.

    .venv/bin/python bench/restore_path.py --gib 3 [--dest /dev/shm/x] [--registry] [--upper-mib 256 --staged]

Builds a synthetic CRIU-like directory (pages-1.img: random pages, zero runs, a constant run,
with its pagemap-1.img) of ``--gib`` GiB, stores it (``store_checkpoint``), then times
``materialize_checkpoint`` into ``--dest`` (each in a fresh child process, whose peak RSS is
its VmHWM); with ``--registry`` also pushes it to a docker-registry started here and times
``fetch_into`` with an empty store. Prints seconds, GB/s and peak RSS per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from criu_images import present_pagemap  # noqa: E402

PAGE = 4096
MIB = 1 << 20






def make_checkpoint(path: Path, gib: float, seed: int = 1, upper_mib: int = 0) -> int:
    """Random pages (90 %), zero runs (5 %) and a constant run (5 %), in 64 MiB mappings; with
    ``upper_mib``, a random rootfs-upper.tar of that size (an overlay container's writable
    layer: chunked like the pages when large, but needed before CRIU starts)."""
    path.mkdir(parents=True)
    rng = random.Random(seed)
    total = int(gib * (1 << 30)) // (64 * MIB) * (64 * MIB)
    entries = []
    va = 0x7F0000000000
    with open(path / "pages-1.img", "wb") as out:
        written = 0
        while written < total:
            k = (written // (64 * MIB)) % 20
            n = 64 * MIB
            if k == 7:
                out.seek(n, os.SEEK_CUR)  # zeros (CRIU writes them; a hole reads the same)
            elif k == 13:
                out.write(b"\x5a" * n)
            else:
                for _ in range(n // (8 * MIB)):
                    out.write(rng.randbytes(8 * MIB))
            entries.append((va, n // PAGE))
            va += n + (1 << 30)
            written += n
        out.truncate(total)
    (path / "pagemap-1.img").write_bytes(present_pagemap(1, entries))
    (path / "pstree.img").write_bytes(b"pstree")
    (path / "core-1.img").write_bytes(b"core" * 1000)
    (path / "mm-1.img").write_bytes(rng.randbytes(300_000))
    if upper_mib:
        with open(path / "rootfs-upper.tar", "wb") as out:
            for _ in range(upper_mib):
                out.write(rng.randbytes(MIB))
    return total + upper_mib * MIB


def _child(stage: str, args: dict) -> None:
    sys.path.insert(0, str(REPO / "src"))
    from gpusnap.packaging import api

    t = time.perf_counter()
    out: dict = {}
    # As a restore writes it (orchestrate.restore): every file but the pages first, then the
    # pages; "staged_s" is when the first stage was in place (the engine starts preparing then).
    staged = (lambda: out.setdefault("staged_s", time.perf_counter() - t)) if args.get("staged") else None
    if stage == "materialize":
        kw = {"staged": staged} if staged else {}
        if args.get("workers"):  # the pool's size (default: one thread per core): does pwrite into one file scale?
            from gpusnap.packaging import artifact as fmt
            from gpusnap.packaging.store import OciStore

            store = OciStore(Path(args["store"]))
            art = fmt.load(store, store.resolve(args["ref"]).digest)
            fmt.write_directory_pieced(store, art, None, Path(args["dest"]), workers=int(args["workers"]), **kw)
        else:
            api.materialize_checkpoint(Path(args["store"]), args["ref"], Path(args["dest"]), form="criu-dir", **kw)
    elif stage == "fetch":
        from gpusnap.packaging import fetch
        from gpusnap.packaging.store import OciStore

        # Exploration knobs (what limits the pull on a many-core host): the transfer count and
        # the interpreter's GIL switch interval.
        if args.get("fetch_workers"):
            fetch.fetch_workers = lambda _n, k=int(args["fetch_workers"]): k  # type: ignore[assignment]
        if args.get("switch_interval"):
            sys.setswitchinterval(float(args["switch_interval"]))

        rc = fetch.open_remote(args["remote"], insecure=True)
        assert rc.direct, "not fetchable directly"
        kw: dict = {"staged": staged} if staged else {}
        if "processes" in args:
            kw["processes"] = int(args["processes"])
        if args.get("map_files"):  # the transfer processes receive into the files' mappings (a restore's own tmpfs)
            kw["map_files"] = True
        kw["timings"] = out.setdefault("phases", {})
        fetch.fetch_into(OciStore(Path(args["store"])), rc, Path(args["dest"]), **kw)
    elif stage == "write-floor":
        _write_floor(Path(args["dest"]), int(args["bytes"]), int(args["threads"]), args["mode"])
    elif stage == "store":
        if args.get("piece_digest"):  # e.g. sha256: a checkpoint as gpusnap stored it before BLAKE3 piece digests
            from gpusnap.packaging import layout as lay

            lay.PIECE_DIGEST = lay.digest_algorithm(args["piece_digest"])
        api.store_checkpoint(Path(args["store"]), Path(args["src"]), form="criu-dir", ref=args["ref"])
    elif stage == "push":
        api.push(Path(args["store"]), args["ref"], args["remote"], insecure=True)
    out["seconds"] = time.perf_counter() - t
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["rss_mib"] = ru.ru_maxrss / 1024
    out["cpu_s"] = ru.ru_utime + ru.ru_stime
    print(json.dumps(out))


def _write_floor(dest: Path, total: int, threads: int, mode: str) -> None:
    """Writing ``total`` bytes into ``dest`` on ``threads`` threads, 2 MiB at a time, no
    network, hashing or decompression: what the image directory's filesystem takes.
    ``files``: each thread pwrites its own file; ``one``: all pwrite disjoint ranges of one file
    (as a restore's pages file is written); ``single``: one thread writes all of one file; ``mmap``: all copy into one shared mapping of one
    file with preadv from a source file (the kernel copies, the interpreter lock is released)."""
    import mmap
    import threading

    dest.mkdir(parents=True, exist_ok=True)
    block = os.urandom(2 * MIB)
    per = total // threads // len(block)
    src = dest / "src"
    src.write_bytes(block)
    sfd = os.open(src, os.O_RDONLY)
    one = dest / "one"
    fd1 = os.open(one, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd1, per * threads * len(block))
    mm = mmap.mmap(fd1, per * threads * len(block)) if mode == "mmap" else None

    def work(i: int) -> None:
        if mode == "files":
            fd = os.open(dest / f"floor-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for k in range(per):
                    os.pwrite(fd, block, k * len(block))
            finally:
                os.close(fd)
        elif mode == "single":  # one thread writes the whole file
            for k in range(per * threads):
                os.pwrite(fd1, block, k * len(block))
        elif mode == "one":
            for k in range(per):
                os.pwrite(fd1, block, (i * per + k) * len(block))
        else:
            view = memoryview(mm)  # type: ignore[arg-type]
            for k in range(per):
                at = (i * per + k) * len(block)
                os.preadv(sfd, [view[at:at + len(block)]], 0)
            view.release()

    ts = [threading.Thread(target=work, args=(i,)) for i in range(1 if mode == "single" else threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if mm is not None:
        mm.close()
    os.close(fd1)
    os.close(sfd)


def _profiled_child(stage: str, args: dict) -> None:
    """BENCH_PROFILE=DIR: the child under cProfile (all threads' time is the main thread's wait,
    so it mostly tells single-worker runs apart), stats written to DIR/<stage>.prof."""
    import cProfile

    where = os.environ.get("BENCH_PROFILE")
    if not where:
        _child(stage, args)
        return
    cProfile.runctx("_child(stage, args)", globals(), {"stage": stage, "args": args}, str(Path(where) / f"{stage}.prof"))


def run(stage: str, prefix: list[str] | None = None, **kw: str) -> dict:
    p = subprocess.run([*(prefix or []), sys.executable, __file__, "--child", stage, json.dumps(kw)], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{stage} failed: {p.stderr[-3000:]}")
    return json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])  # py-spy prints too


def _staged(r: dict) -> str:
    return f", all but the pages in place after {r['staged_s']:.2f} s" if "staged_s" in r else ""


def drop(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=3)
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/gpusnap-restore-bench"), help="source dir and store (disk)")
    ap.add_argument("--dest", type=Path, default=Path("/dev/shm/gpusnap-restore-bench"), help="where images are written")
    ap.add_argument("--registry", action="store_true", help="also fetch from a local docker-registry (its storage on --work)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=0, help="materialize on this many threads (default: one per core)")
    ap.add_argument("--upper-mib", type=int, default=0, help="also a random rootfs-upper.tar of this size (an overlay container's)")
    ap.add_argument("--staged", action="store_true", help="write as a restore does: all but the pages, then the pages (prints when "
                    "the first stage was in place)")
    ap.add_argument("--fetch-variants", default="", help="more fetch rounds, comma-separated: wN (N transfers), sS (GIL switch "
                    "interval S seconds), pN (N transfer processes; p0: none), m (receive into the files' mappings), joined with '+', "
                    "e.g. 'w8,p0,p4,p8,p4+m'")
    ap.add_argument("--parallel-fetches", default="", help="also K fetch processes at once (comma-separated Ks, e.g. '2,4'), each "
                    "into its own directory with 16/K transfers: does the pull scale with processes (an in-process limit) or not?")
    ap.add_argument("--piece-digest", default="", help="store the pieces with this digest (sha256: as before BLAKE3; "
                    "default: what gpusnap uses), to compare what materialize and fetch spend verifying them")
    ap.add_argument("--write-floor", action="store_true", help="also time plain 2 MiB pwrites of the same size into --dest (16 threads)")
    ap.add_argument("--profile-fetch", type=Path, help="run the first fetch under py-spy (where installed): --gil samples, "
                    "collapsed stacks in this folder (what holds the interpreter lock, and how much of the time)")
    ap.add_argument("--huge-tmpfs", action="store_true", help="write the images into a huge-page tmpfs mounted under --dest, "
                    "as a restore does (engines/imagedir.mount_tmpfs; root)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("child_args", nargs="?", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _profiled_child(a.child, json.loads(a.child_args))
        return 0
    drop(a.work)
    drop(a.dest)
    a.work.mkdir(parents=True)
    a.dest.mkdir(parents=True)
    src, store = a.work / "src", a.work / "store"
    size = make_checkpoint(src, a.gib, upper_mib=a.upper_mib)
    gb = size / 1e9
    mounted = None
    if a.huge_tmpfs:
        sys.path.insert(0, str(REPO / "src"))
        from gpusnap.engines import imagedir

        mounted = imagedir.mount_tmpfs(a.dest, size)
        if mounted is None:
            raise SystemExit(f"cannot mount a huge-page tmpfs under {a.dest} (root needed)")
        print(f"images on a huge-page tmpfs: {mounted}", flush=True)
        a.dest = mounted
    r = run("store", store=str(store), src=str(src), ref="bench/ck:1", piece_digest=a.piece_digest)
    print(f"store {gb:.2f} GB: {r['seconds']:.2f} s, peak RSS {r['rss_mib']:.0f} MiB", flush=True)
    drop(src)  # the page cache keeps the store's blobs, as after a checkpoint
    res: dict = {"gb": gb, "materialize": [], "fetch": []}
    for i in range(a.rounds):
        dest = a.dest / f"m{i}"
        r = run("materialize", store=str(store), ref="bench/ck:1", dest=str(dest), staged=a.staged, workers=a.workers)
        res["materialize"].append(r)
        print(f"materialize -> {a.dest}: {r['seconds']:.2f} s ({gb / r['seconds']:.2f} GB/s){_staged(r)}, CPU {r['cpu_s']:.2f} s, "
              f"peak RSS {r['rss_mib']:.0f} MiB", flush=True)
        drop(dest)
    if a.registry:
        sys.path.insert(0, str(REPO / "tests"))
        from stack.registry import Registry

        with Registry(a.work / "registry", range(5490, 5499)) as reg:
            remote = f"{reg.host}/bench/ck:1"
            r = run("push", store=str(store), ref="bench/ck:1", remote=remote)
            print(f"push: {r['seconds']:.2f} s", flush=True)
            rounds: list[dict[str, str]] = [{} for _ in range(a.rounds)]
            for v in filter(None, a.fetch_variants.split(",")):
                knobs: dict[str, str] = {}
                for part in v.split("+"):
                    knobs[{"w": "fetch_workers", "s": "switch_interval", "p": "processes", "m": "map_files"}[part[0]]] = part[1:] or "1"
                rounds.append(knobs)
            for i, knobs in enumerate(rounds):
                empty = Path(tempfile.mkdtemp(dir=a.work, prefix="empty-store-"))
                dest = a.dest / f"f{i}"
                prefix = None
                if i == 0 and a.profile_fetch and shutil.which("py-spy"):
                    a.profile_fetch.mkdir(parents=True, exist_ok=True)
                    prefix = ["py-spy", "record", "--gil", "--threads", "--rate", "250", "--format", "raw", "--nonblocking",
                              "-o", str(a.profile_fetch / "fetch-gil.txt"), "--"]
                r = run("fetch", prefix, store=str(empty), remote=remote, dest=str(dest), staged=a.staged, **knobs)
                if prefix:
                    r["profiled"] = True
                r["knobs"] = knobs
                res["fetch"].append(r)
                print(f"fetch -> {a.dest}{' ' + str(knobs) if knobs else ''}: {r['seconds']:.2f} s ({gb / r['seconds']:.2f} GB/s)"
                      f"{_staged(r)}, CPU {r['cpu_s']:.2f} s, peak RSS {r['rss_mib']:.0f} MiB, phases {r.get('phases')}", flush=True)
                drop(dest)
                drop(empty)
    if a.registry and a.parallel_fetches:
        with Registry(a.work / "registry", range(5490, 5499)) as reg:
            remote = f"{reg.host}/bench/ck:1"
            for k in (int(x) for x in a.parallel_fetches.split(",")):
                procs, empties = [], []
                t0 = time.perf_counter()
                for j in range(k):
                    empty = Path(tempfile.mkdtemp(dir=a.work, prefix="empty-store-"))
                    empties.append(empty)
                    kw = {"store": str(empty), "remote": remote, "dest": str(a.dest / f"p{j}"), "fetch_workers": str(max(1, 16 // k))}
                    procs.append(subprocess.Popen([sys.executable, __file__, "--child", "fetch", json.dumps(kw)], stdout=subprocess.PIPE, text=True))
                outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
                secs = time.perf_counter() - t0
                res[f"parallel_{k}"] = {"seconds": secs, "children": outs}
                print(f"{k} fetch processes at once -> {a.dest}: {secs:.2f} s ({k * gb / secs:.2f} GB/s together), CPU "
                      f"{sum(o['cpu_s'] for o in outs):.2f} s", flush=True)
                for j in range(k):
                    drop(a.dest / f"p{j}")
                for e in empties:
                    drop(e)
    if a.write_floor:
        for mode in ("files", "one", "single", "mmap"):
            dest = a.dest / "floor"
            r = run("write-floor", dest=str(dest), bytes=str(size), threads="16", mode=mode)
            res[f"write_floor_{mode}"] = r
            print(f"write floor ({mode}) -> {a.dest}: {r['seconds']:.2f} s ({gb / r['seconds']:.2f} GB/s), CPU {r['cpu_s']:.2f} s, "
                  "16 threads, 2 MiB at a time", flush=True)
            drop(dest)
    print(json.dumps(res))
    drop(a.work)
    if mounted is not None:
        subprocess.run(["umount", str(mounted)], check=False)
        a.dest = mounted.parent
    drop(a.dest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
