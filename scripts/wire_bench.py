#!/usr/bin/env python3
"""Registry data path on this machine: checkpoint --push and restore from a registry, the way
they were (store then push; pull then materialize) and the way they are (pipelined push;
direct fetch into the image directory), against the loopback HTTP floor (curl PUT and GET of
one blob of the same size on the same registry).

    sudo .venv/bin/python scripts/wire_bench.py [--gib 2] [--root /dev/shm/wire-bench] [--json OUT]

Everything lives under ``--root`` (a tmpfs by default: the figures are CPU and HTTP, not
disk). Each phase runs in its own process; its peak RSS is that process's ru_maxrss (wait4).
The registry's storage is emptied before each push, so nothing is skipped. A development
measurement for issue 12 (items 2-3); bench/e2e.py is the benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def make_source(path: Path, gib: float) -> int:
    """A CRIU-like directory: pages files of pseudo-random memory (incompressible, as GPU
    state mostly is) with a zero run, and small control files."""
    path.mkdir(parents=True)
    rnd = random.Random(12)
    total = int(gib * (1 << 30))
    block = 64 << 20
    with open(path / "pages-1.img", "wb") as f:
        left = total - (64 << 20)
        while left > 0:
            n = min(block, left)
            f.write(rnd.randbytes(n))
            left -= n
        f.write(bytes(64 << 20))
    (path / "pstree.img").write_bytes(b"\x19\x43\x56\x54\x30\x30\x27\x50")
    for i in range(20):
        (path / f"core-{i}.img").write_bytes(rnd.randbytes(4096))
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def phase(name: str, root: Path, remote: str) -> dict[str, float]:
    from gpusnap.packaging import api

    src = root / "src"
    t0 = time.monotonic()
    out: dict[str, float] = {}
    if name in ("push-before", "push-seq"):
        api.store_checkpoint(root / "store-a", src, form="criu-dir", ref="bench/wire")
        out["store_s"] = time.monotonic() - t0
        api.push(root / "store-a", "bench/wire", remote, insecure=True)
    elif name == "push-after":
        pipe = api.start_push(root / "store-b", remote, insecure=True)
        try:
            api.store_checkpoint(root / "store-b", src, form="criu-dir", ref="bench/wire", on_blob=pipe.on_blob)
        except BaseException:
            pipe.cancel()
            raise
        out["store_s"] = time.monotonic() - t0
        pipe.finish("bench/wire")
    elif name in ("pull-before", "pull-seq"):
        ref = api.pull(root / "store-c", remote, insecure=True)
        out["pull_s"] = time.monotonic() - t0
        api.materialize_checkpoint(root / "store-c", ref, root / "out-before", form="criu-dir")
    elif name == "pull-after":
        rc = api.open_remote(remote, insecure=True)
        api.fetch_into(root / "store-d", rc, root / "out-after")
    else:
        raise SystemExit(f"unknown phase {name}")
    out["seconds"] = time.monotonic() - t0
    return out


def run_phase(name: str, root: Path, remote: str, src: Path | None = None) -> dict[str, float]:
    """``src``: the gpusnap source tree to run the phase with (the "before" code), else this one."""
    env = {**os.environ, "PYTHONPATH": str(src)} if src is not None else None
    proc = subprocess.Popen([sys.executable, __file__, "--phase", name, "--root", str(root), "--remote", remote],
                            stdout=subprocess.PIPE, text=True, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    out = proc.stdout.read() if proc.stdout else ""
    if status != 0:
        raise SystemExit(f"phase {name} failed ({status})")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_mib"] = usage.ru_maxrss / 1024
    return result


def curl_floor(reg_host: str, blob: Path) -> dict[str, float]:
    """One PUT (monolithic upload) and one GET of ``blob`` with curl: the loopback HTTP floor."""
    import hashlib

    import requests

    h = hashlib.sha256()
    with open(blob, "rb") as f:
        while data := f.read(8 << 20):
            h.update(data)
    digest = "sha256:" + h.hexdigest()
    r = requests.post(f"http://{reg_host}/v2/bench/floor/blobs/uploads/", timeout=30)
    loc = r.headers["Location"]
    loc = loc if loc.startswith("http") else f"http://{reg_host}{loc}"
    url = loc + ("&" if "?" in loc else "?") + f"digest={digest}"
    t0 = time.monotonic()
    subprocess.run(["curl", "-sf", "-X", "PUT", "-H", "Content-Type: application/octet-stream", "-T", str(blob), url, "-o", "/dev/null"],
                   check=True)
    put_s = time.monotonic() - t0
    t0 = time.monotonic()
    subprocess.run(["curl", "-sf", "-o", "/dev/null", f"http://{reg_host}/v2/bench/floor/blobs/{digest}"], check=True)
    get_s = time.monotonic() - t0
    return {"put_s": put_s, "get_s": get_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--root", type=Path, default=Path("/dev/shm/wire-bench"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--before-src", type=Path, help="src/ of the gpusnap to measure as 'before' (e.g. a main checkout); "
                    "default: this tree's old paths (store then push, pull then materialize)")
    ap.add_argument("--phase")
    ap.add_argument("--remote")
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.root, args.remote)))
        return

    from stack.registry import PKG_PORTS, Registry

    root: Path = args.root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    size = make_source(root / "src", args.gib)
    gb = size / 1e9
    results: dict[str, list[dict[str, float]]] = {}
    reg = Registry(root / "registry", PKG_PORTS).start()
    try:
        remote = f"{reg.host}/bench/wire:v1"
        for _ in range(args.rounds):
            # Each variant pulls what its own push made (the "before" code may not read the
            # format the "after" code writes).
            # before: the --before-src code (store then push; pull then materialize); seq: this
            # code on those old paths (isolates the pipelined push and the direct fetch); after.
            for variant in (("before", "seq", "after") if args.before_src else ("before", "after")):
                code = args.before_src if variant == "before" else None
                for d in ("store-a", "store-b", "store-c", "store-d", "out-before", "out-after"):
                    shutil.rmtree(root / d, ignore_errors=True)
                reg.kill()
                shutil.rmtree(reg.root / "data", ignore_errors=True)
                reg.start()
                results.setdefault(f"push-{variant}", []).append(run_phase(f"push-{variant}", root, remote, code))
                for d in ("store-a", "store-b"):  # tmpfs space for the pull
                    shutil.rmtree(root / d, ignore_errors=True)
                results.setdefault(f"pull-{variant}", []).append(run_phase(f"pull-{variant}", root, remote, code))
            for d in ("store-a", "store-b", "store-c", "store-d", "out-before", "out-after"):
                shutil.rmtree(root / d, ignore_errors=True)
            results.setdefault("curl-floor", []).append(curl_floor(reg.host, root / "src" / "pages-1.img"))
    finally:
        reg.kill()
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in results.items() if k != "curl-floor"}
    floor = {k: min(r[k] for r in results["curl-floor"]) for k in ("put_s", "get_s")}
    lines = [f"checkpoint {size / (1 << 30):.2f} GiB ({size} bytes), {os.cpu_count()} cores, root {root}",
             f"curl PUT {floor['put_s']:.2f} s ({gb / floor['put_s']:.2f} GB/s), GET {floor['get_s']:.2f} s ({gb / floor['get_s']:.2f} GB/s)"]
    for name in ("push-before", "push-seq", "push-after", "pull-before", "pull-seq", "pull-after"):
        if name not in best:
            continue
        r = best[name]
        ref = floor["put_s"] if name.startswith("push") else floor["get_s"]
        extra = "".join(f", {k} {v:.2f} s" for k, v in r.items() if k not in ("seconds", "peak_rss_mib"))
        lines.append(f"{name:12s} {r['seconds']:6.2f} s  {gb / r['seconds']:.2f} GB/s  {r['seconds'] / ref:.2f}x curl  "
                     f"peak RSS {r['peak_rss_mib']:.0f} MiB{extra}")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"bytes": size, "results": results, "summary": lines}, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
