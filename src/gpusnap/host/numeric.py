"""numpy for gpusnap's own array work, without the BLAS thread pool it never uses.

numpy's OpenBLAS starts one thread per core when numpy is imported, and each spins for a while
before it sleeps: the one extra thread on this project's 2-core machine took 0.10-0.15 s of CPU
in the second after the import, and a 16-core host starts fifteen, at the start of every
`gpusnap checkpoint`, beside the runtime's start and the GPU checkpoint, for nothing (gpusnap's
numpy use is elementwise: no BLAS call). One thread does; a user's own OPENBLAS_NUM_THREADS
wins. Import numpy through this module, so whichever gpusnap module loads it first does so with
the setting in place.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the setting, which OpenBLAS reads as it loads)

__all__ = ["np"]
