"""Hostile config.json (and container ids) against gpusnap-runtime's create/run validation.

Every case must be refused before anything changes: one-line GpusnapError with exit code 2 or 3,
config.json byte-for-byte as before, nothing new under the run/state dirs, and (for the real
process runs) no container known to runc afterwards.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusnap.config import load_settings
from gpusnap.errors import ExitCode, GpusnapError

intercept = pytest.importorskip("gpusnap.runtime_shim.intercept", reason="the runtime shim has not landed")
from gpusnap.runc.argv import parse  # noqa: E402

VALID: dict[str, Any] = {
    "ociVersion": "1.0.2",
    "root": {"path": "rootfs", "readonly": True},
    "process": {"cwd": "/", "args": ["/bin/sh"], "env": ["PATH=/bin"], "user": {"uid": 0, "gid": 0}},
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
    "hooks": {"prestart": [{"path": "/bin/true"}]},
    "annotations": {"io.example": "x"},
    "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}], "devices": [{"path": "/dev/null", "type": "c", "major": 1, "minor": 3}]},
}


def _set(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    cur: Any = out
    for key in path[:-1]:
        cur = cur[key]
    if value is _DELETE:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return out


_DELETE = object()
_not_str = st.one_of(st.none(), st.booleans(), st.integers(), st.lists(st.integers(), max_size=1), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
_not_list = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
_relative = st.sampled_from(["bin/true", "./x", "../x", "", "x/../y"])

# (name, JSON path, strategy of bad values)
_FIELD_CASES: list[tuple[str, tuple[str | int, ...], st.SearchStrategy[Any]]] = [
    ("missing-ociVersion", ("ociVersion",), st.just(_DELETE)),
    ("bad-ociVersion", ("ociVersion",), st.one_of(_not_str, st.sampled_from(["", "2.0.0", "latest", "v1"]))),
    ("missing-root", ("root",), st.just(_DELETE)),
    ("bad-root", ("root",), _not_list.filter(lambda v: not isinstance(v, dict)) | st.just({})),
    ("bad-root-path", ("root", "path"), st.one_of(_not_str, st.just(""))),
    ("relative-cwd", ("process", "cwd"), _relative),
    ("bad-args", ("process", "args"), st.one_of(_not_list.filter(lambda v: not isinstance(v, list)), st.lists(_not_str, min_size=1, max_size=2))),
    ("bad-env", ("process", "env"), st.one_of(st.lists(st.sampled_from(["NOEQUALS", "=x", ""]), min_size=1, max_size=2), _not_list.filter(lambda v: not isinstance(v, list)))),
    ("bad-uid", ("process", "user", "uid"), st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32), st.text(max_size=2), st.booleans())),
    ("bad-mounts", ("mounts",), st.one_of(_not_list.filter(lambda v: not isinstance(v, list)), st.lists(st.just({"type": "proc"}), min_size=1, max_size=1))),
    ("relative-hook", ("hooks", "prestart", 0, "path"), _relative),
    ("bad-annotations", ("annotations",), st.dictionaries(st.text(min_size=1, max_size=3), _not_str.filter(lambda v: v is not None), min_size=1, max_size=2)),
    ("bad-namespace", ("linux", "namespaces", 0, "type"), st.one_of(_not_str, st.sampled_from(["PID", "net", "", "process"]))),
    ("bad-device", ("linux", "devices", 0), st.sampled_from([{"path": "null", "type": "c"}, {"path": "/dev/x", "type": "z"}, {"type": "c"}, {"path": "/dev/x"}])),
    # CRIU options come from an annotation and land in a CRIU config file read as root: no
    # newlines (a second option smuggled in), no options that make CRIU run programs.
    ("criu-option-injection", ("annotations", "gpusnap.io/criu-options"), st.sampled_from([
        "tcp-established\naction-script /tmp/gs-rel-pwn", "x\nlibdir /tmp", "action-script=/tmp/gs-rel-pwn", "a  b", "tcp-established\tx",
        "action-script /tmp/x", "exec-cmd", "log-file=/etc/passwd", "tcp-established\r\nlib /tmp",
        # ...nor anything off the container allow-list (issue 13): code, namespaces, profiles, paths, network
        "libdir /tmp/evil", "join-ns net:/proc/1/ns/net", "lsm-profile apparmor:unconfined", "ext-mount-map /:/host",
        "cgroup-root /", "tls-cacert /etc/shadow", "page-server", "address 1.2.3.4", "ghost-limit 64G", "timeout 0"])),
    ("criu-env-injection", ("annotations", "gpusnap.io/criu-env"), st.sampled_from([
        '{"LD_PRELOAD":"/tmp/x.so"}', '{"PATH":"/tmp"}', '{"CRIU_LIBS_DIR":"/tmp"}', '{"KFD_X":"0 --x"}', "[]", "{"])),
    ("own-criu-config", ("annotations", "org.criu.config"), st.sampled_from(["/nonexistent/c.conf", "relative.conf", "/tmp"])),
]


@st.composite
def hostile_config(draw: st.DrawFn) -> tuple[str, str]:
    kind = draw(st.sampled_from(["field"] * 6 + ["not-json", "not-object", "deep-nesting"]))
    if kind == "not-json":
        return kind, draw(st.sampled_from(["", "{", "{'a':1}", "nul\x00l", '{"ociVersion":1.0.2}', "\ufeff{}"]))
    if kind == "not-object":
        return kind, json.dumps(draw(st.one_of(st.lists(st.integers(), max_size=2), st.integers(), st.text(max_size=4), st.none())))
    if kind == "deep-nesting":
        n = draw(st.integers(min_value=20_000, max_value=100_000))
        return kind, '{"ociVersion":"1.0.2","root":{"path":"r"},"x":' + "[" * n + "]" * n + "}"
    name, path, values = draw(st.sampled_from(_FIELD_CASES))
    return name, json.dumps(_set(VALID, path, draw(values)))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


@pytest.fixture
def box(tmp_path: Path) -> Path:
    (tmp_path / "bundle" / "rootfs").mkdir(parents=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "state").mkdir()
    # The first validation on a run dir compiles the schema validator into run/schema whatever
    # the input; do that here, so "nothing changed" below is about the hostile config alone.
    (tmp_path / "bundle" / "config.json").write_text(json.dumps(VALID))
    _spec_steps(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def counter(module_ledger) -> dict:  # type: ignore[no-untyped-def,type-arg]
    c: dict[str, list[int]] = {}
    yield c
    for name, (tried, refused) in c.items():
        module_ledger.record("bad-input", f"config.json:{name}", tried=tried, refused=refused)


def _spec_steps(box: Path, container_id: str = "gs-rel-fz") -> Any:
    s = load_settings(env={}, config_file=box / "none.toml", run_dir=box / "run", state_dir=box / "state", gpu_backend="none")
    inv = parse(["create", "--bundle", str(box / "bundle"), container_id])
    return intercept.spec_steps(inv, s, box)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=hostile_config())
def test_hostile_config_refused_before_anything_changes(box: Path, counter: dict, case: tuple[str, str]) -> None:  # type: ignore[type-arg]
    name, text = case
    (box / "bundle" / "config.json").write_text(text)
    before = _tree(box)
    counter.setdefault(name, [0, 0])[0] += 1
    try:
        steps = _spec_steps(box)
    except GpusnapError as exc:
        assert exc.exit_code in (ExitCode.USAGE, ExitCode.NOT_FOUND), f"{name}: {exc}"
        assert "\n" not in str(exc)
    else:
        raise AssertionError(f"{name}: accepted {text[:160]!r} ({len(steps)} steps)")
    assert _tree(box) == before
    counter[name][1] += 1


@pytest.mark.parametrize("bad_id", ["../../escape", "a/b", "..", "x\ny", ""])
def test_hostile_container_id_refused(box: Path, counter: dict, bad_id: str) -> None:  # type: ignore[type-arg]
    """The id names the per-container CRIU config file under the run dir."""
    (box / "bundle" / "config.json").write_text(json.dumps(VALID))
    before = _tree(box)
    counter.setdefault("container-id", [0, 0])[0] += 1
    with pytest.raises(GpusnapError) as err:
        for step in _spec_steps(box, bad_id):
            step.do()
    assert err.value.exit_code == ExitCode.USAGE, str(err.value)
    assert _tree(box) == before
    counter["container-id"][1] += 1


def test_valid_config_accepted(box: Path) -> None:
    (box / "bundle" / "config.json").write_text(json.dumps(VALID))
    assert _spec_steps(box)  # the CRIU config step at least


@pytest.mark.integration
@pytest.mark.parametrize("name", ["relative-cwd", "criu-option-injection", "not-json"])
def test_real_shim_process_refuses_and_runc_never_creates(box: Path, counter: dict, name: str) -> None:  # type: ignore[type-arg]
    if os.geteuid() != 0:
        pytest.skip("runc create needs root")
    text = {
        "relative-cwd": json.dumps(_set(VALID, ("process", "cwd"), "tmp")),
        "criu-option-injection": json.dumps(_set(VALID, ("annotations", "gpusnap.io/criu-options"), "tcp-established\naction-script /tmp/gs-rel-pwn")),
        "not-json": "{",
    }[name]
    (box / "bundle" / "config.json").write_text(text)
    env = {**os.environ, "GPUSNAP_RUN_DIR": str(box / "run"), "GPUSNAP_STATE_DIR": str(box / "state"),
           "GPUSNAP_GPU_BACKEND": "none", "GPUSNAP_RUNC": "/usr/sbin/runc", "GPUSNAP_CONFIG": str(box / "none.toml")}
    root = box / "runc-root"
    done = subprocess.run(
        [sys.executable, "-m", "gpusnap.runtime_shim.main", "--root", str(root), "create", "--bundle", str(box / "bundle"), "gs-rel-fz-proc"],
        capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL,
    )
    counter.setdefault(f"{name}(process)", [0, 0])[0] += 1
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    listed = subprocess.run(["/usr/sbin/runc", "--root", str(root), "list", "-q"], capture_output=True, text=True)
    assert "gs-rel-fz-proc" not in listed.stdout
    assert (box / "bundle" / "config.json").read_text() == text
    counter[f"{name}(process)"][1] += 1
