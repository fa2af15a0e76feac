"""One concurrent store writer (or gc loop) of the load test, as its own process:
``python gs_rel_writer.py write STORE WORKDIR N SEED`` or ``python gs_rel_writer.py gc STORE SECONDS``.
A writer prints ``REF sha256-of-pages`` for every checkpoint it stored."""

from __future__ import annotations

import hashlib
import random
import sys
import time
from pathlib import Path

from gpusnap.packaging import api

SHARED = random.Random(99).randbytes(3 << 20)  # memory every checkpoint shares (dedup under load)


def write(store: Path, work: Path, n: int, seed: int) -> None:
    rnd = random.Random(seed)
    for i in range(n):
        src = work / f"w{seed}-{i}"
        src.mkdir(parents=True)
        pages = SHARED + rnd.randbytes(rnd.randint(1, 3) << 20)
        (src / "pages-1.img").write_bytes(pages)
        (src / "inventory.img").write_bytes(b"inv %d %d" % (seed, i))
        ref = f"gs-rel/load-{seed}:{i}"
        api.store_checkpoint(store, src, form="criu-dir", ref=ref)
        if i % 3 == 2:  # untag an older one: gc then has real garbage to take
            old = f"gs-rel/load-{seed}:{i - 2}"
            api.remove(store, old)
            print(f"removed {old}", flush=True)
        print(f"{ref} {hashlib.sha256(pages).hexdigest()}", flush=True)


def gc_loop(store: Path, seconds: float) -> None:
    end = time.monotonic() + seconds
    runs = 0
    while time.monotonic() < end:
        api.gc(store)
        runs += 1
        time.sleep(0.02)
    print(f"gc {runs}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        gc_loop(Path(sys.argv[2]), float(sys.argv[3]))
