from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from gpusnap.cli.artifacts import register
from gpusnap.errors import ExitCode
from gpusnap.metadata import CheckpointMetadata, GpuInfo, GpuProcess
from gpusnap.packaging import api


@pytest.fixture
def app() -> typer.Typer:
    a = typer.Typer()
    register(a)
    return a


@pytest.fixture
def store(tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "pages-1.img").write_bytes(random.Random(5).randbytes(3 << 20))
    (ck / "inventory.img").write_bytes(b"inv")
    meta = CheckpointMetadata(
        container_id="gs-pkg-0123456789abcdef0123456789abcdef", created="2026-11-22T02:00:00Z", criu_version="4.1.1",
        kernel="6.18.0-gpusnap", arch="x86_64", gpus=[GpuInfo(0, "GPU-8c1f0000-1111-2222-3333-444455556666", "NVIDIA H200", 150 << 30)],
        processes=[GpuProcess(4242, 1, 2 << 30, ["GPU-8c1f0000-1111-2222-3333-444455556666"], "python3")],
        timings_s={"gpu_lock": 0.001, "gpu_checkpoint": 1.01, "criu_dump": 1.03})
    s = tmp_path / "store"
    api.store_checkpoint(s, ck, form="criu-dir", ref="127.0.0.1:5100/gs-pkg/a-rather-long-repository-name/checkpoint:v1", metadata=meta)
    return s


def _run(app: typer.Typer, *args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "80", "TERM": "dumb"})
    return r.exit_code, r.stdout, r.stderr


def test_ls_table_fits_80_columns_and_matches_json(app: typer.Typer, store: Path) -> None:
    code, out, _ = _run(app, "ls", "--store", str(store))
    assert code == 0
    assert all(len(line) <= 80 for line in out.splitlines())
    code, js, _ = _run(app, "ls", "--store", str(store), "--json")
    rows = json.loads(js)
    assert len(rows) == 1
    row = rows[0]
    assert row["digest"].replace("sha256:", "")[:12] in out
    assert row["ref"].split("/")[0] in out and row["container"][:8] in out


def test_inspect_shows_everything_within_80_columns(app: typer.Typer, store: Path) -> None:
    ref = "127.0.0.1:5100/gs-pkg/a-rather-long-repository-name/checkpoint:v1"
    code, out, _ = _run(app, "inspect", ref, "--store", str(store))
    assert code == 0, out
    assert all(len(line) <= 80 for line in out.splitlines())
    for text in ("NVIDIA H200", "python3", "2.0 GiB", "criu_dump", "4.1.1", "pages-1.img", "Layers", "Timing"):
        assert text in out
    code, js, _ = _run(app, "inspect", ref, "--store", str(store), "--json")
    info = json.loads(js)
    assert info["criu_version"] == "4.1.1" and info["gpu_processes"][0]["gpu_memory_bytes"] == 2 << 30
    assert list(info["timings"]) == ["gpu_lock", "gpu_checkpoint", "criu_dump"]


def test_inspect_a_path_on_disk(app: typer.Typer, store: Path, tmp_path: Path) -> None:
    code, out, _ = _run(app, "inspect", str(tmp_path / "ck"), "--json")
    assert code == 0
    assert json.loads(out)["sizes"]["pages"] == 3 << 20


def test_rm_and_gc(app: typer.Typer, store: Path) -> None:
    ref = "127.0.0.1:5100/gs-pkg/a-rather-long-repository-name/checkpoint:v1"
    code, out, _ = _run(app, "rm", ref, "--store", str(store), "--json")
    assert code == 0 and json.loads(out)[0]["ref"] == ref
    code, out, _ = _run(app, "gc", "--store", str(store), "--json")
    assert code == 0 and json.loads(out)["blobs_removed"] >= 3
    assert json.loads(_run(app, "ls", "--store", str(store), "--json")[1]) == []


def test_errors_are_one_line_with_documented_codes(app: typer.Typer, store: Path) -> None:
    code, out, err = _run(app, "inspect", "missing:v1", "--store", str(store))
    assert code == ExitCode.NOT_FOUND and err.count("\n") == 1 and "gpusnap ls" in err
    code, _, err = _run(app, "push", "missing:v1", "bad ref!", "--store", str(store))
    assert code in (ExitCode.NOT_FOUND, ExitCode.USAGE) and err.count("\n") == 1


@pytest.mark.parametrize("extra", [[], ["--encrypt-key", "/nonexistent/key"]])
def test_push_podman_image_refuses_with_nothing_done(app: typer.Typer, store: Path, extra: list[str]) -> None:
    """A runc checkpoint cannot become podman's checkpoint image, nor an encrypted push one: one
    line, exit 2, before the store changes or the registry (nothing listens there) is asked."""
    ref = "127.0.0.1:5100/gs-pkg/a-rather-long-repository-name/checkpoint:v1"
    before = api.list_checkpoints(store)
    code, out, err = _run(app, "push", ref, "127.0.0.1:9/gs-pkg/never:v1", "--podman-image", "--store", str(store), *extra)
    assert code == ExitCode.USAGE, (out, err)
    assert len(err.strip().splitlines()) == 1 and "--podman-image" in err, err
    assert api.list_checkpoints(store) == before


@pytest.mark.parametrize("width", [80, 100, 160])
def test_ls_keeps_references_whole_at_any_width(width: int) -> None:
    from rich.console import Console

    from gpusnap.cli.artifacts import ls_table

    rows = [
        {"ref": "127.0.0.1:5100/gs-pkg/a-rather-long-repository-name/checkpoint:v1", "digest": "sha256:" + "ab" * 32,
         "container": "gs-pkg-" + "0123456789abcdef" * 2, "created": "2026-11-22T02:00:00Z", "size": 3 << 20},
        {"ref": "localhost/gpusnap/gpusnap-demo:demo", "digest": "sha256:" + "cd" * 32, "container": "demo",
         "created": "2026-11-24T02:00:00Z", "size": 3 << 30},
    ]
    console = Console(width=width, highlight=False, record=True, file=open("/dev/null", "w"))
    console.print(ls_table(rows, width, now=1795500000.0))
    lines = console.export_text().splitlines()
    assert all(len(line.rstrip()) <= width for line in lines)
    for r in rows:
        assert any(r["ref"] in line for line in lines), (r["ref"], lines)
        assert any("abababa"[: 7] in line or "cdcdcdc" in line for line in lines)
    assert any("3.0 GiB" in line for line in lines) and any("3.0 MiB" in line for line in lines)


def test_rm_removes_what_exists_and_reports_the_rest(app: typer.Typer, store: Path) -> None:
    ref = "127.0.0.1:5100/gs-pkg/a-rather-long-repository-name/checkpoint:v1"
    r = CliRunner().invoke(app, ["rm", "no/such:ref", ref, "--store", str(store)], env={"COLUMNS": "80"})
    assert r.exit_code == ExitCode.NOT_FOUND
    assert f"removed {ref}" in r.stdout
    assert "no/such:ref" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert api.list_checkpoints(store) == []
