"""What a stored checkpoint artifact is made of, for tests that compare two stores of one
checkpoint (tests/unit/packaging/test_pkg_follow.py, tests/integration/packaging/test_follow_dump.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpusnap.packaging.store import OciStore


def layers_and_config(store_dir: Path, digest: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The manifest's layers and the config of artifact ``digest``, less the config's creation
    time (two stores of the same files a second apart differ only there)."""
    store = OciStore(store_dir)
    manifest = json.loads(store.blob_path(digest).read_bytes())
    config = json.loads(store.blob_path(manifest["config"]["digest"]).read_bytes())
    config.pop("created", None)
    return manifest["layers"], config
