"""What the children of a CUDA process hold of the NVIDIA driver (run on a GPU host).

``python3 bench/children_probe.py [--json OUT]``: a PyTorch process initialises CUDA, then starts
children the ways real workloads do — ``os.fork()``, ``subprocess`` (fork + exec), DataLoader
workers started by fork and by spawn, and torch.compile's pool of compile workers (inductor,
default settings) — and reports, for each child, the NVIDIA device files it has open and its
mappings of them (what CRIU cannot save; gpusnap refuses a checkpoint while a process without
a CUDA context holds any, see gpusnap.gpu.unsupported) and whether the driver knows a CUDA
context of it (``cuCheckpointProcessGetState``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from workloads.gpt2_server import descendants  # bench/ is this script's directory


class Samples:
    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        import torch

        return torch.full((4,), float(i))


def describe(pid: int) -> dict[str, object]:
    from gpusnap.gpu.nvidia import NvidiaBackend
    from gpusnap.gpu.unsupported import nvidia_holdings

    files, maps = nvidia_holdings(Path("/proc"), pid)
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
    except OSError:
        cmd = "?"
    return {"pid": pid, "cmd": cmd, "nvidia_files": len(files), "distinct": files, "nvidia_maps": maps,
            "cuda_context": NvidiaBackend()._is_cuda(pid)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch
    from torch.utils.data import DataLoader

    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    me = os.getpid()
    rows: list[dict[str, object]] = [{"how": "the CUDA process itself", **describe(me)}]

    def record(how: str, before: set[int]) -> None:
        time.sleep(1.0)
        new = [p for p in descendants(me) if p not in before]
        if not new:
            rows.append({"how": how, "pid": None})
        for p in new:
            rows.append({"how": how, **describe(p)})

    before = set(descendants(me))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(r, 1)
        os._exit(0)
    record("os.fork()", before)
    os.write(w, b"x")
    os.waitpid(pid, 0)

    before = set(descendants(me))
    sleeper = subprocess.Popen(["sleep", "60"])
    record("subprocess.Popen (fork + exec)", before)
    sleeper.kill()
    sleeper.wait()

    for start in ("fork", "spawn"):
        before = set(descendants(me))
        it = iter(DataLoader(Samples(), batch_size=2, num_workers=2, multiprocessing_context=start, persistent_workers=True))
        next(it)
        record(f"DataLoader workers ({start})", before)
        del it
        time.sleep(1.0)

    before = set(descendants(me))
    try:
        fn = torch.compile(lambda a: torch.nn.functional.gelu(a @ a).sum(dim=0))
        fn(x)
        torch.cuda.synchronize()
        record("torch.compile, inductor's compile workers (default settings)", before)
    except Exception as exc:  # noqa: BLE001 - reported, the probe goes on
        rows.append({"how": "torch.compile", "error": f"{type(exc).__name__}: {exc}"})

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print("| child | pid | NVIDIA files open | distinct | mappings | CUDA context | command |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if row.get("pid") is None:
            print(f"| {row['how']} | none started | | | | | {row.get('error', '')} |")
            continue
        print(f"| {row['how']} | {row['pid']} | {row['nvidia_files']} | {', '.join(row['distinct'])} | {row['nvidia_maps']} | "  # type: ignore[arg-type]
              f"{'yes' if row['cuda_context'] else 'no'} | {row['cmd']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    sys.stdout.flush()
    os._exit(0)  # the loaders' and compile pools' shutdown hooks are not what is measured


if __name__ == "__main__":
    raise SystemExit(main())
