"""`--engine cri` arguments and the CRI client's set-up errors (no runtime needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.cri.client import CriClient, find_proto, kubelet_checkpoint_name, load
from gpusnap.cri.engine import CriTarget, parse_target
from gpusnap.errors import MissingDependencyError, UsageError


@pytest.mark.parametrize("text, ns, want", [
    ("trainer", "default", CriTarget("default", "trainer", "")),
    ("trainer/main", "ml", CriTarget("ml", "trainer", "main")),
    ("ml/trainer/main", "default", CriTarget("ml", "trainer", "main")),
])
def test_targets(text: str, ns: str, want: CriTarget) -> None:
    assert parse_target(text, ns) == want


@pytest.mark.parametrize("text", ["", "a//b", "a/b/c/d", "/pod"])
def test_bad_targets(text: str) -> None:
    with pytest.raises(UsageError, match="is not POD, POD/CONTAINER or NAMESPACE/POD/CONTAINER"):
        parse_target(text)


def test_kubelet_archive_name() -> None:
    assert kubelet_checkpoint_name("job", "ml", "trainer", "2026-11-24T16:19:30Z") == "checkpoint-job_ml-trainer-2026-11-24T16:19:30Z.tar"


def test_missing_proto_and_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_CRI_PROTO", str(tmp_path / "nope.proto"))
    with pytest.raises(MissingDependencyError, match="CRI api.proto was not found"):
        find_proto()
    with pytest.raises(MissingDependencyError, match="no CRI socket at"):
        CriClient(str(tmp_path / "containerd.sock"))


def test_a_file_that_is_not_the_cri_proto(tmp_path: Path) -> None:
    bad = tmp_path / "api.proto"
    bad.write_text('syntax = "proto3";\nmessage {')
    with pytest.raises(UsageError, match="could not be compiled as the CRI api.proto"):
        load(bad)
