from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpusnap.errors import NotFoundError, UsageError
from gpusnap.ocispec.spec import load_spec, save_spec, validate_spec

GOOD = {
    "ociVersion": "1.0.2-dev",
    "root": {"path": "rootfs", "readonly": True},
    "process": {"terminal": False, "cwd": "/", "args": ["sh"], "env": ["PATH=/bin"], "user": {"uid": 0, "gid": 0}},
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
    "annotations": {"a": "b"},
    "linux": {"namespaces": [{"type": "pid"}], "resources": {"devices": [{"allow": False, "access": "rwm"}]}},
}


def test_good_spec_validates(tmp_path: Path) -> None:
    validate_spec(GOOD, tmp_path / "config.json")


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"process": {**GOOD["process"], "args": "sh"}}, "process.args"),
        ({"process": {**GOOD["process"], "env": ["NOEQUALS"]}}, "process.env[0]"),
        ({"annotations": {"a": 1}}, "annotations.a"),
        ({"linux": {"namespaces": [{"type": "pidd"}]}}, "linux.namespaces[0].type"),
        ({"ociVersion": 1}, "ociVersion"),
    ],
)
def test_schema_errors_name_file_and_path(tmp_path: Path, change: dict, where: str) -> None:
    path = tmp_path / "config.json"
    with pytest.raises(UsageError) as err:
        validate_spec({**GOOD, **change}, path)
    assert str(err.value).startswith(f"{path}: {where}: ") and "fix the bundle's config.json" in str(err.value)


def test_load_errors(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    with pytest.raises(NotFoundError):
        load_spec(path)
    path.write_text('{"ociVersion": ')
    with pytest.raises(UsageError, match=r"not valid JSON at line 1 column 16"):
        load_spec(path)
    path.write_text("[]")
    with pytest.raises(UsageError, match="must be a JSON object"):
        load_spec(path)


def test_save_is_atomic_and_keeps_mode(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    path.chmod(0o600)
    save_spec(path, GOOD)
    assert json.loads(path.read_text()) == GOOD
    assert path.read_text() == json.dumps(GOOD, separators=(",", ":"))  # compact: one line
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
