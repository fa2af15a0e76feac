"""Runs one packaging operation in its own process, printing bytes moved, so a test can kill -9
it at a chosen point: ``python gs_rel_transfer.py push|pull|store STORE REF|SRC REMOTE|REF``,
``pushpipe STORE SRC REF REMOTE`` (checkpoint --push: store and upload at once), ``fetch STORE
REMOTE DEST`` (restore from a registry straight into an image directory), ``materialize STORE
REF DEST`` (a restore from the store: prints 0, then unpacks). ``GS_REL_PUSH_PROCESSES``: the
uploads' transfer processes (default: gpusnap's own choice)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gpusnap.packaging import api
from gpusnap.packaging.progress import NullProgress


class Printing(NullProgress):
    def __init__(self) -> None:
        self.moved = 0
        self.step = 0

    def advance(self, n: int) -> None:
        self.moved += n
        if self.moved >= self.step:
            print(self.moved, flush=True)
            self.step = self.moved + (256 << 10)


def main(argv: list[str]) -> int:
    op, store = argv[1], Path(argv[2])
    procs = os.environ.get("GS_REL_PUSH_PROCESSES")
    processes = int(procs) if procs else None
    if op == "push":
        api.push(store, argv[3], argv[4], insecure=True, progress=Printing(), processes=processes)
    elif op == "pull":
        api.pull(store, argv[3], insecure=True, progress=Printing())
    elif op == "pushpipe":
        pipe = api.start_push(store, argv[4], insecure=True, progress=Printing(), processes=processes)
        try:
            api.store_checkpoint(store, Path(argv[3]), form="criu-dir", ref=argv[5] if len(argv) > 5 else "gs-rel/pipe:1",
                                 on_blob=pipe.on_blob)
        except BaseException:
            pipe.cancel()
            raise
        pipe.finish(argv[5] if len(argv) > 5 else "gs-rel/pipe:1")
    elif op == "fetch":
        remote = api.open_remote(argv[3], insecure=True)
        api.fetch_into(store, remote, Path(argv[4]), progress=Printing())
    elif op == "materialize":
        print(0, flush=True)
        api.materialize_checkpoint(store, argv[3], Path(argv[4]), form="criu-dir")
    elif op == "store":
        print(0, flush=True)
        api.store_checkpoint(store, Path(argv[3]), form="criu-dir", ref=argv[4])
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
