"""CPU workload for bench/e2e.py: holds random, zero-filled and constant memory, changes a small
part every step and prints ``step N VALUE t=EPOCH``; VALUE depends only on N (continuation is
checked against the original run's lines).

    python3 cpu_holder.py [--random-mib 1024] [--zero-mib 256] [--const-mib 256] [--change-kib 1024] [--sleep 0.1]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
import zlib


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-mib", type=int, default=1024)
    ap.add_argument("--zero-mib", type=int, default=256)
    ap.add_argument("--const-mib", type=int, default=256)
    ap.add_argument("--change-kib", type=int, default=1024)
    ap.add_argument("--sleep", type=float, default=0.1)
    args = ap.parse_args()
    start = time.time()
    rnd = random.Random(11)
    held = [rnd.randbytes(64 << 20) for _ in range(args.random_mib // 64)]
    zero = bytearray(args.zero_mib << 20)
    zero[:] = bytes(len(zero))  # written, so the pages are present (CRIU dumps them)
    const = b"\x5a" * (args.const_mib << 20)
    changing = bytearray(args.change_kib << 10)
    print(f"ready held_mib={args.random_mib + args.zero_mib + args.const_mib} setup_s={time.time() - start:.2f} t={time.time():.3f}", flush=True)
    step = 0
    while True:
        step += 1
        # One 4 KiB block a step, derived from the step number only.
        at = (step * 4096) % len(changing)
        changing[at:at + 4096] = hashlib.sha256(str(step).encode()).digest() * 128
        print(f"step {step} {zlib.crc32(changing):08x} t={time.time():.3f}", flush=True)
        if len(held) + len(zero) + len(const) < 0:  # keep every buffer referenced
            return 1
        time.sleep(args.sleep)


if __name__ == "__main__":
    sys.exit(main())
