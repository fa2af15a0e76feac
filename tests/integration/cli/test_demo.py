"""`gpusnap demo`, the README's one command, on the embedded engine and the local store."""

from __future__ import annotations

import json

import pytest

from .conftest import Gs, unique

pytestmark = pytest.mark.integration


def test_demo_resumes_counting_and_cleans_up(gs: Gs) -> None:
    name = unique("demo")
    proc = gs("demo", "--name", name)
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "done: the container resumed exactly where it was checkpointed"
    assert any(ln.startswith("5/5 ") for ln in lines)
    assert gs.json("ps") == []
    index = gs.store / "index.json"
    assert not index.exists() or json.loads(index.read_text())["manifests"] == []


def test_demo_json_keep(gs: Gs) -> None:
    name = unique("demo")
    result = gs.json("demo", "--name", name, "--keep")
    assert result["resumed"] is True and result["resumed_at"] == result["stopped_at"] + 1  # type: ignore[index]
    rows = gs.json("ps")
    assert [(r["name"], r["status"]) for r in rows] == [(name + "-restored", "running")]  # type: ignore[index,union-attr]
    assert [m["annotations"]["org.opencontainers.image.ref.name"] for m in json.loads((gs.store / "index.json").read_text())["manifests"]]
    gs("delete", name + "-restored")
