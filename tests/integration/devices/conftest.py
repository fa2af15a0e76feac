import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the fake GPU tree helper, the stack package

from stack.fixtures import podman_names  # noqa: E402,F401 (a fixture)
