"""The compiled config.json validator: same verdicts as jsonschema, cached, regenerated when stale."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusnap.errors import UsageError
from gpusnap.ocispec import fastvalidate
from gpusnap.ocispec.fastvalidate import compiled_validator, violation_types
from gpusnap.ocispec.spec import SCHEMA_FILE, validate_spec

GOOD: dict[str, Any] = {
    "ociVersion": "1.0.2-dev",
    "root": {"path": "rootfs", "readonly": True},
    "process": {"terminal": False, "cwd": "/", "args": ["sh"], "env": ["PATH=/bin"], "user": {"uid": 0, "gid": 0, "additionalGids": [1]}},
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid"]}],
    "hooks": {"poststop": [{"path": "/bin/true", "args": ["true"], "timeout": 5}]},
    "annotations": {"a": "b"},
    "linux": {
        "devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 438, "uid": 0, "gid": 0}],
        "namespaces": [{"type": "pid"}],
        "resources": {"devices": [{"allow": False, "access": "rwm"}, {"allow": True, "type": "c", "major": None, "minor": 1}]},
    },
}

# Places in the document to put arbitrary JSON, so both validators judge many wrong shapes.
SPOTS = [
    ("ociVersion",), ("root",), ("root", "path"), ("process", "cwd"), ("process", "args"), ("process", "env"),
    ("process", "user", "uid"), ("process", "user", "additionalGids"), ("mounts",), ("mounts", 0, "destination"),
    ("hooks", "poststop", 0, "timeout"), ("hooks", "poststop", 0, "path"), ("annotations", "a"), ("linux", "devices", 0, "type"),
    ("linux", "devices", 0, "major"), ("linux", "devices", 0, "fileMode"), ("linux", "resources", "devices", 1, "access"),
    ("linux", "resources", "devices", 1, "major"), ("linux", "namespaces", 0, "type"),
]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5_000_000_000) | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(["", "/x", "rwm", "pid", "c", "1.0.0", "A=b", "nope", "rxw"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["path", "type", "x"]), inner, max_size=2),
    max_leaves=6,
)


def _reference() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


REFERENCE = _reference()


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new shim process would: no validator module loaded yet."""
    import sys

    for name in [m for m in sys.modules if m.startswith("_gpusnap_schema_")]:
        monkeypatch.delitem(sys.modules, name)


def _verdict(validate: Any, doc: Any) -> bool:
    try:
        validate(doc)
    except violation_types(validate):
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(spot=st.sampled_from(SPOTS), value=JSON, drop=st.booleans())
def test_same_verdict_as_jsonschema(tmp_path_factory: pytest.TempPathFactory, spot: tuple, value: Any, drop: bool) -> None:
    doc = copy.deepcopy(GOOD)
    parent = doc
    for key in spot[:-1]:
        parent = parent[key]
    if drop and isinstance(parent, dict):
        parent.pop(spot[-1], None)
    else:
        parent[spot[-1]] = value
    validate = compiled_validator(SCHEMA_FILE, tmp_path_factory.getbasetemp() / "schema-cache")
    assert _verdict(validate, doc) == REFERENCE.is_valid(doc), doc


def test_good_spec_and_top_level_errors(tmp_path: Path) -> None:
    validate_spec(GOOD, tmp_path / "config.json", cache_dir=tmp_path / "cache")
    with pytest.raises(UsageError) as err:
        validate_spec({"root": {"path": "r"}}, tmp_path / "config.json", cache_dir=tmp_path / "cache")
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: (top level): missing required property 'ociVersion'; fix") and "\n" not in str(err.value)
    with pytest.raises(UsageError, match=r": root: missing required property 'path'; fix"):
        validate_spec({"ociVersion": "1.0.0", "root": {}}, tmp_path / "config.json")
    with pytest.raises(UsageError, match=r": \(top level\): missing required properties 'ociVersion', 'root'; fix"):
        validate_spec({}, tmp_path / "config.json")
    with pytest.raises(UsageError, match=r"after gpusnap's spec modifiers: process.env\[0\]: must match pattern \^\[\^=\]\+= \(got 'NOEQ'\); fix"):
        validate_spec({**GOOD, "process": {"cwd": "/", "env": ["NOEQ"]}}, tmp_path / "config.json", stage="gpusnap's spec modifiers")


def _cached(cache: Path) -> list[Path]:
    return sorted(cache.rglob("_gpusnap_schema_*.py"))


def test_cached_module_is_reused_without_generating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    cache = tmp_path / "cache"
    compiled_validator(SCHEMA_FILE, cache)
    [module_file] = _cached(cache)
    assert module_file.parent.name.startswith(f"{__import__('gpusnap').__version__}-")
    assert list((module_file.parent / "__pycache__").glob("*.pyc"))  # even under PYTHONDONTWRITEBYTECODE
    for name in [m for m in sys.modules if m.startswith("_gpusnap_schema_")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(fastvalidate, "generate_source", lambda text: pytest.fail("generated again"))
    validate = compiled_validator(SCHEMA_FILE, cache)
    assert not _verdict(validate, {"ociVersion": 1, "root": {"path": "r"}})
    assert "fastjsonschema" not in module_file.read_text().split("\n\n")[0].replace("gpusnap.ocispec.fastvalidate", "")


@pytest.mark.parametrize("damage", ["truncate", "foreign-writable"])
def test_broken_or_unsafe_cache_is_generated_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    import sys

    cache = tmp_path / "cache"
    compiled_validator(SCHEMA_FILE, cache)
    [module_file] = _cached(cache)
    good_text = module_file.read_text()
    if damage == "truncate":
        module_file.write_text(good_text[: len(good_text) // 2])
    else:
        module_file.write_text("raise SystemExit('must never run')\n")
        module_file.chmod(0o666)
    for name in [m for m in sys.modules if m.startswith("_gpusnap_schema_")]:
        monkeypatch.delitem(sys.modules, name)
    validate = compiled_validator(SCHEMA_FILE, cache)
    assert _verdict(validate, GOOD) and not _verdict(validate, {})
    assert module_file.read_text() == good_text and not module_file.stat().st_mode & 0o022


def test_changed_schema_gets_its_own_module(tmp_path: Path) -> None:
    schema = json.loads(SCHEMA_FILE.read_text())
    changed = tmp_path / "config.schema.json"
    schema["required"] = ["ociVersion", "root", "hostname"]
    changed.write_text(json.dumps(schema))
    cache = tmp_path / "cache"
    assert _verdict(compiled_validator(SCHEMA_FILE, cache), GOOD)
    assert not _verdict(compiled_validator(changed, cache), GOOD)
    assert len(_cached(cache)) == 2


def test_unwritable_cache_falls_back_to_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    validate = compiled_validator(SCHEMA_FILE, blocker / "cache")  # a file where the folder should be
    assert _verdict(validate, GOOD) and not _verdict(validate, {"root": 1})
    assert os.listdir(tmp_path) == ["file"]
