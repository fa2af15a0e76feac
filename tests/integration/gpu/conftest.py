import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: gpu_harness, gpu_worker, the stack package

from stack.fixtures import backend, containers, stack  # noqa: E402,F401 (fixtures)
