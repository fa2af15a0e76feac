#!/usr/bin/env python3
"""Push/pull throughput and peak memory: gpusnap vs skopeo copy vs oras, same data, one run.

    sudo .venv/bin/python bench/push_pull.py [--gib 2] [--port 5140] [--json OUT]

1. Makes a real checkpoint of at least ``--gib`` GiB: a runc container (rootfs an overlay with
   lower=/) running python3 that holds that much pseudo-random memory; ``runc checkpoint``.
2. Stores it in a fresh gpusnap store (timed separately: it is what `gpusnap checkpoint` does).
3. For each tool, against a fresh local registry (empty storage, so nothing is skipped):
   gpusnap push / pull (the chunked artifact), skopeo copy of an OCI layout holding the same
   checkpoint as one uncompressed tar layer, oras push / pull of the checkpoint's files.
   Each runs as its own process; peak RSS is that process's VmHWM (sampled until it exits).
Targets (issue 5): gpusnap at least as fast as the fastest peer, peak RSS < 256 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

HOLDER = """
import os, random, time
rnd = random.Random(11)
data = [rnd.randbytes(64 << 20) for _ in range({chunks})]
open('/ready', 'w').write('1')
while True:
    time.sleep(1)
"""


def sh(*args: str, **kw: object) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=True, capture_output=True, text=True, **kw)  # type: ignore[call-overload]


def _hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one process.

    Peak RSS is the process's own VmHWM, sampled every 20 ms until it exits (VmHWM only grows).
    Not ru_maxrss: a child started with vfork+exec inherits the parent's high-water mark there,
    which made every peer tool report this script's own RSS.
    """
    t0 = time.perf_counter()
    err_file = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file, env=env)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _hwm(proc.pid))
        time.sleep(0.02)
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        err_file.seek(0)
        err = err_file.read().decode(errors="replace")
        raise RuntimeError(f"{' '.join(cmd)} failed: {err[-2000:]}")
    return secs, peak


class Registry:
    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Registry":
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        cfg = self.root / "config.yml"
        cfg.write_text(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {self.root}/data\n"
                       f"http:\n  addr: 127.0.0.1:{self.port}\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
        self.proc = subprocess.Popen(["/usr/bin/docker-registry", "serve", str(cfg)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        for _ in range(200):
            try:
                if requests.get(f"http://127.0.0.1:{self.port}/v2/", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                time.sleep(0.05)
        raise RuntimeError("registry did not start")

    def __exit__(self, *_: object) -> None:
        if self.proc:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"


def make_checkpoint(work: Path, gib: int) -> Path:
    ovl = work / "ovl"
    ovl.mkdir()
    sh("mount", "-t", "tmpfs", "-o", "size=64m", "gs-pkg-bench", str(ovl))
    for d in ("upper", "work", "merged"):
        (ovl / d).mkdir()
    sh("mount", "-t", "overlay", "gs-pkg-bench", "-o", f"lowerdir=/,upperdir={ovl}/upper,workdir={ovl}/work", str(ovl / "merged"))
    (ovl / "upper" / "holder.py").write_text(HOLDER.format(chunks=gib * 16))
    bundle = work / "bundle"
    bundle.mkdir()
    sh("runc", "spec", cwd=str(bundle))
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"].update(terminal=False, args=["/usr/bin/python3", "/holder.py"],
                          rlimits=[{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}])
    cfg["root"] = {"path": str(ovl / "merged"), "readonly": False}
    (work / "criu.conf").write_text("link-remap\n")
    cfg.setdefault("annotations", {})["org.criu.config"] = str(work / "criu.conf")
    (bundle / "config.json").write_text(json.dumps(cfg))
    root, name = str(work / "runc-root"), f"gs-pkg-bench-{os.getpid()}"
    p = subprocess.Popen(["runc", "--root", root, "run", "-d", "--bundle", str(bundle), name],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if p.wait() != 0:
        raise RuntimeError(f"runc run failed: {p.stderr.read().decode() if p.stderr else ''}")
    try:
        for _ in range(600):
            if (ovl / "merged" / "ready").exists():
                break
            time.sleep(0.2)
        image = work / "checkpoint"
        sh("runc", "--root", root, "checkpoint", "--image-path", str(image), "--work-path", str(work / "cwork"), name)
    finally:
        subprocess.run(["runc", "--root", root, "delete", "-f", name], capture_output=True)
        for f in (p.stdin, p.stdout, p.stderr):
            if f:
                f.close()
        subprocess.run(["umount", "-l", str(ovl / "merged")])
        subprocess.run(["umount", "-l", str(ovl)])
    return image


def make_layout(tar: Path, layout: Path) -> None:
    """An OCI image layout with the checkpoint tar as its one layer (what skopeo copies)."""
    from gpusnap.packaging.store import MEDIA_OCI_MANIFEST, Descriptor, OciStore

    store = OciStore(layout)
    w = store.writer()
    with open(tar, "rb") as f:
        while data := f.read(4 << 20):
            w.write(data)
    layer = w.commit()
    size = tar.stat().st_size
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [layer]}}).encode()
    cfg_digest = store.put_bytes(cfg)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MEDIA_OCI_MANIFEST,
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": len(cfg)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer, "size": size}]}).encode()
    digest = store.put_bytes(manifest)
    store.tag("bench", Descriptor(MEDIA_OCI_MANIFEST, digest, len(manifest)))


def free_port(start: int) -> int:
    for port in range(start, 5150):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in gs-pkg's range")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=2)
    ap.add_argument("--port", type=int, default=5140)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; tools alternate within a round, the median is reported")
    args = ap.parse_args()
    py = sys.executable
    work = Path(tempfile.mkdtemp(prefix="gs-pkg-bench-", dir=args.workdir))
    rows: list[dict[str, object]] = []
    try:
        image = make_checkpoint(work, args.gib)
        size = sum(p.stat().st_size for p in image.rglob("*") if p.is_file())
        store = work / "store"
        secs, rss = measure([py, "-c", f"from gpusnap.packaging import api; api.store_checkpoint({str(store)!r}, {str(image)!r}, "
                                       "form='criu-dir', ref='bench')"])
        rows.append({"tool": "gpusnap store (local, not a transfer)", "seconds": secs, "rss": rss})
        # The same checkpoint as one uncompressed tar layer in an OCI layout, for skopeo.
        layout = work / "layout"
        sh("tar", "-C", str(image), "-cf", str(work / "ck.tar"), ".")
        make_layout(work / "ck.tar", layout)
        (work / "ck.tar").unlink()
        port = free_port(args.port)
        env = dict(os.environ, HOME=str(work / "home"))
        (work / "home").mkdir()

        samples: dict[str, list[tuple[float, int]]] = {}

        def run_pair(tool: str, push: list[str], pull: list[str], reg_dir: Path, pulled_dir: Path) -> None:
            shutil.rmtree(pulled_dir, ignore_errors=True)
            pulled_dir.mkdir(parents=True)
            with Registry(reg_dir, port) as reg:  # empty storage every time: nothing can be skipped
                p = measure([a.replace("{HOST}", reg.host) for a in push], env)
                q = measure([a.replace("{HOST}", reg.host) for a in pull], env)
            samples.setdefault(f"{tool} push", []).append(p)
            samples.setdefault(f"{tool} pull", []).append(q)
            shutil.rmtree(pulled_dir, ignore_errors=True)

        pulled = work / "pulled"
        files = sorted(str(p.relative_to(image)) for p in image.iterdir() if p.is_file())
        pairs = [
            ("gpusnap",
             [py, "-c", f"from gpusnap.packaging import api; api.push({str(store)!r}, 'bench', '{{HOST}}/gs-pkg/bench:v1', insecure=True)"],
             [py, "-c", f"from gpusnap.packaging import api; api.pull({str(pulled / 'gs')!r}, '{{HOST}}/gs-pkg/bench:v1', insecure=True)"],
             pulled / "gs"),
            ("skopeo copy",
             ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:bench:latest", "docker://{HOST}/gs-pkg/bench:v1"],
             ["skopeo", "copy", "--quiet", "--src-tls-verify=false", "docker://{HOST}/gs-pkg/bench:v1", f"oci:{pulled / 'skopeo'}:bench:latest"],
             pulled / "skopeo"),
            ("oras",
             ["sh", "-c", f"cd {image} && exec oras push --plain-http --no-tty {{HOST}}/gs-pkg/bench:v1 {' '.join(files)}"],
             ["oras", "pull", "--plain-http", "--no-tty", "-o", str(pulled / "oras"), "{HOST}/gs-pkg/bench:v1"],
             pulled / "oras"),
        ]
        for _ in range(args.repeat):
            for tool, push, pull, out in pairs:
                run_pair(tool, push, pull, work / "reg", out)
        for tool, vals in samples.items():
            secs = sorted(v[0] for v in vals)
            rows.append({"tool": tool, "seconds": secs[len(secs) // 2], "rss": max(v[1] for v in vals),
                         "all_seconds": [round(v[0], 2) for v in vals]})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"checkpoint: {size / (1 << 30):.2f} GiB (runc checkpoint of a python3 holding {args.gib} GiB), "
          f"{os.cpu_count()} cores, median of {args.repeat} rounds, peak RSS = max over rounds\n")
    print(f"| {'tool':<38} | {'seconds':>8} | {'MiB/s':>8} | {'peak RSS MiB':>12} |")
    print(f"|{'-' * 40}|{'-' * 10}|{'-' * 10}|{'-' * 14}|")
    for r in rows:
        mibs = size / (1 << 20) / float(r["seconds"])  # type: ignore[arg-type]
        r["mib_s"] = round(mibs, 1)
        r["rss_mib"] = round(int(r["rss"]) / (1 << 20), 1)  # type: ignore[arg-type]
        print(f"| {r['tool']:<38} | {float(r['seconds']):>8.2f} | {mibs:>8.1f} | {r['rss_mib']:>12.1f} |")  # type: ignore[arg-type]
    for way in ("push", "pull"):
        ours = next(float(r["seconds"]) for r in rows if r["tool"] == f"gpusnap {way}")  # type: ignore[arg-type]
        peers = [float(r["seconds"]) for r in rows if str(r["tool"]).endswith(way) and not str(r["tool"]).startswith("gpusnap")]  # type: ignore[arg-type]
        rss = next(float(r["rss_mib"]) for r in rows if r["tool"] == f"gpusnap {way}")  # type: ignore[arg-type]
        print(f"gpusnap {way}: {min(peers) / ours:.2f}x the fastest peer's speed (target >= 1), peak RSS {rss:.0f} MiB (target < 256)")
    if args.json:
        args.json.write_text(json.dumps({"bytes": size, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
