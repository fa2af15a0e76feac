"""Hostile OCI state on gpusnap-hook's stdin: refused with exit 2 and one line; nothing written
outside the hook's state and run directories (a container id is used in file names there)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusnap.errors import ExitCode

hook = pytest.importorskip("gpusnap.oci_hooks.main", reason="gpusnap-hook has not landed")

VALID = {"ociVersion": "1.0.2", "id": "gs-rel-c1", "status": "creating", "pid": 4242, "bundle": "/run/gs-rel/bundle"}
STAGES = ["prestart", "createRuntime", "poststart", "poststop"]


def _mutations() -> st.SearchStrategy[tuple[str, str]]:
    """(name, stdin text) pairs, each a valid state broken in exactly one way (or not JSON)."""

    def with_(key: str, value: object) -> str:
        return json.dumps({**VALID, key: value})

    def without(key: str) -> str:
        return json.dumps({k: v for k, v in VALID.items() if k != key})

    bad_ids = st.one_of(
        st.sampled_from(["../../escape", "..", ".", "a/b", "/abs", "x/../../../escape", "a\x00b", "", " ", "a\nb"]),
        st.text(min_size=1, max_size=20).filter(lambda s: any(c in s for c in "/\x00\n") or s in (".", "..")),
    )
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.lists(st.integers(), max_size=2))
    return st.one_of(
        st.tuples(st.just("id-path"), bad_ids.map(lambda i: with_("id", i))),
        st.tuples(st.just("missing-field"), st.sampled_from(["ociVersion", "id", "status", "bundle"]).map(without)),
        st.tuples(st.just("wrong-type"), st.tuples(st.sampled_from(["ociVersion", "id", "status", "bundle"]), scalars).map(lambda kv: with_(*kv))),
        st.tuples(st.just("bad-status"), st.text(max_size=10).filter(lambda s: s not in hook.STATUSES).map(lambda s: with_("status", s))),
        st.tuples(st.just("relative-bundle"), st.sampled_from(["bundle", "./b", "../b", ""]).map(lambda b: with_("bundle", b))),
        st.tuples(st.just("bad-pid"), st.one_of(st.integers(max_value=-1), st.booleans(), st.text(max_size=3), st.floats(allow_nan=False)).map(lambda p: with_("pid", p))),
        st.tuples(st.just("bad-annotations"), st.one_of(
            st.lists(st.text(max_size=3), min_size=1, max_size=2),
            st.dictionaries(st.text(max_size=3), scalars.filter(lambda v: not isinstance(v, str)), min_size=1, max_size=2),
        ).map(lambda a: with_("annotations", a))),
        st.tuples(st.just("not-json"), st.one_of(st.text(max_size=40).filter(lambda s: not _is_json(s)), st.binary(max_size=40).map(lambda b: b.decode("latin-1")).filter(lambda s: not _is_json(s)))),
        st.tuples(st.just("not-object"), st.one_of(scalars, st.text(max_size=5)).map(json.dumps)),
        st.tuples(st.just("deep-nesting"), st.integers(min_value=50_000, max_value=200_000).map(lambda n: "[" * n + "]" * n)),
    )


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
    except (ValueError, RecursionError):
        return False
    return True


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    box = tmp_path / "box"
    (box / "state").mkdir(parents=True)
    (box / "run").mkdir()
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(box / "state"))
    monkeypatch.setenv("GPUSNAP_RUN_DIR", str(box / "run"))
    monkeypatch.setenv("GPUSNAP_CONFIG", str(box / "none.toml"))
    # Traversal targets: the state dir's parents. Anything appearing here is an escape.
    (box / "escape.json").write_text("victim")
    return box


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=_mutations(), stage=st.sampled_from(STAGES))
def test_hostile_state_refused(sandbox: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], counter: dict, case: tuple[str, str], stage: str) -> None:  # type: ignore[type-arg]
    name, text = case
    before = _tree(sandbox)
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    capsys.readouterr()
    rc = hook.main([stage])
    err = capsys.readouterr().err
    counter.setdefault(name, [0, 0])[0] += 1
    assert rc == ExitCode.USAGE, f"{name} {text[:80]!r} at {stage}: rc {rc}, {err[:200]}"
    assert err.count("\n") == 1 and err.startswith(f"gpusnap-hook {stage}:"), err[:300]
    assert _tree(sandbox) == before, f"{name} {text[:80]!r} wrote {_tree(sandbox) - before}"
    assert (sandbox / "escape.json").read_text() == "victim"
    counter[name][1] += 1


@pytest.fixture(scope="module")
def counter(module_ledger) -> dict:  # type: ignore[no-untyped-def,type-arg]
    c: dict[str, list[int]] = {}
    yield c
    for name, (tried, refused) in c.items():
        module_ledger.record("bad-input", f"hook-state:{name}", tried=tried, refused=refused)


def test_real_entry_point_refuses_traversal_id(sandbox: Path, counter: dict) -> None:  # type: ignore[type-arg]
    """The installed gpusnap-hook as runc would run it (a process, state on stdin)."""
    env = {**os.environ}
    for stage in ("prestart", "poststop"):
        done = subprocess.run(
            [sys.executable, "-m", "gpusnap.oci_hooks.main", stage],
            input=json.dumps({**VALID, "id": "../../escape"}), capture_output=True, text=True, env=env, timeout=60,
        )
        counter.setdefault("id-path(process)", [0, 0])[0] += 1
        assert done.returncode == ExitCode.USAGE, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
        assert (sandbox / "escape.json").read_text() == "victim"
        counter["id-path(process)"][1] += 1


def test_valid_state_still_accepted(sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusals above are not a hook that refuses everything."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(VALID)))
    assert hook.main(["prestart"]) == ExitCode.OK
    assert (sandbox / "state" / "gpus" / "gs-rel-c1.json").is_file()
