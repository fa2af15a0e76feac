"""The README's main job under each engine: checkpoint a counting container, remove it
everywhere, restore it under a new name, and see it count on from where it stopped."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import COUNTER, DOCKER, Gs, docker_logs, podman_logs, unique, wait_numbers

pytestmark = pytest.mark.integration


def assert_continues(before_last: int, after: list[int]) -> None:
    """The restored counter went on: consecutive numbers through before_last+1 and beyond."""
    assert before_last + 1 in after and before_last + 2 in after, (before_last, after)
    start = after.index(before_last + 1)
    tail = after[start:]
    assert tail == list(range(before_last + 1, before_last + 1 + len(tail))), after


class EngineCase:
    """How the test starts, reads, finds and removes a container of one engine, outside gpusnap."""

    def __init__(self, engine: str, gs: Gs, name: str) -> None:
        self.engine, self.gs, self.name = engine, gs, name

    def logs(self, name: str) -> str:
        if self.engine == "podman":
            return podman_logs(name)
        if self.engine == "docker":
            return docker_logs(name)
        return self.gs("logs", name, check=False).stdout

    def running(self, name: str) -> bool:
        if self.engine == "podman":
            p = subprocess.run(["podman", "inspect", "--format", "{{.State.Status}}", name], capture_output=True, text=True)
        elif self.engine == "docker":
            p = subprocess.run([DOCKER, "inspect", "--format", "{{.State.Status}}", name], capture_output=True, text=True)
        else:
            rows = self.gs.json("ps")
            return any(r["name"] == name and r["status"] == "running" for r in rows)  # type: ignore[union-attr,index]
        return p.stdout.strip() == "running"

    def exists(self, name: str) -> bool:
        if self.engine == "podman":
            return subprocess.run(["podman", "container", "exists", name]).returncode == 0
        if self.engine == "docker":
            return subprocess.run([DOCKER, "inspect", name], capture_output=True).returncode == 0
        return any(r["name"] == name for r in self.gs.json("ps"))  # type: ignore[union-attr,index]

    def remove(self, name: str) -> None:
        if self.engine == "podman":
            subprocess.run(["podman", "rm", "-f", "-t", "0", name], check=True, capture_output=True)
        elif self.engine == "docker":
            subprocess.run([DOCKER, "rm", "-f", name], check=True, capture_output=True)
        else:
            self.gs("delete", name)


@pytest.fixture(params=["runc-direct", "podman", "docker"])
def case(request: pytest.FixtureRequest, gs: Gs) -> EngineCase:
    engine = request.param
    if engine == "podman":
        name = request.getfixturevalue("podman_counter")
    elif engine == "docker":
        name = request.getfixturevalue("docker_counter")
    else:
        name = unique("rd")
        gs("run", name, "--", "sh", "-c", COUNTER)
        request.addfinalizer(lambda: [gs("delete", n, check=False) for n in (name, name + "-restored")])
    return EngineCase(engine, gs, name)


def _checkpoint_and_restore(case: EngineCase, checkpoint_args: list[str], restore_source: str, wipe: Callable[[], None], restore_args: tuple[str, ...] = ()) -> list[int]:
    gs = case.gs
    before = wait_numbers(lambda: case.logs(case.name), 4)
    assert len(before) >= 4, before
    out = gs("checkpoint", case.name, *checkpoint_args, "--json")
    assert json.loads(out.stdout)["engine"] == case.engine
    assert not case.running(case.name), "checkpoint without --leave-running stops the container"
    last = wait_numbers(lambda: case.logs(case.name), 1)[-1]
    case.remove(case.name)
    wipe()
    assert not case.exists(case.name)
    new = case.name + "-restored"
    gs("restore", restore_source, "--name", new, *restore_args)
    assert case.running(new)
    after = wait_numbers(lambda: case.logs(new), 3)
    after = wait_numbers(lambda: case.logs(new), len(after) + 2)
    assert_continues(last, after)
    return after


def test_checkpoint_to_path_and_restore(case: EngineCase, tmp_path: Path) -> None:
    out = tmp_path / ("ckpt.tar" if case.engine == "podman" else "ckpt")
    _checkpoint_and_restore(case, ["--output", str(out)], str(out), wipe=lambda: None)


def test_push_remove_everywhere_restore_from_registry(case: EngineCase, registry: str, tmp_path: Path) -> None:
    ref = f"{registry}/{case.name}:v1"
    _checkpoint_and_restore(
        case,
        ["--push", ref, "--insecure", "--compress"],
        ref,
        wipe=lambda: shutil.rmtree(case.gs.store, ignore_errors=True),
        restore_args=("--insecure",),
    )
    # A restore from a registry writes the image directory straight from it (directory
    # checkpoints) and keeps only the manifest and config in the store (inspect works, not
    # materialize): pull to have the whole checkpoint locally.
    case.gs("pull", ref, "--insecure")
    check_inspect(case, ref, tmp_path)


def _has_command(gs: Gs, name: str) -> bool:
    return f" {name} " in gs("--help").stdout


def check_inspect(case: EngineCase, ref: str, tmp_path: Path) -> None:
    """`gpusnap inspect` on the restored reference: the counter's process tree and its sizes,
    checked against the CRIU images themselves (and, for podman, against checkpointctl)."""
    import dataclasses

    from gpusnap.packaging import api

    gs = case.gs
    cli = _has_command(gs, "inspect")  # comes with the packaging CLI (cli/artifacts.py)
    info = gs.json("inspect", ref) if cli else dataclasses.asdict(api.inspect(gs.store, ref))
    tree = info["process_tree"]  # type: ignore[index]
    by_pid = {p["pid"]: p for p in tree}
    assert by_pid[1]["comm"] == "sh", tree
    assert all(p["comm"] == "sleep" and p["ppid"] == 1 for p in tree if p["pid"] != 1), tree
    sizes = info["sizes"]  # type: ignore[index]
    assert sizes["pages"] > 0
    assert sizes["total"] == sum(v for k, v in sizes.items() if k != "total")

    form = {"podman": "podman-archive", "docker": "docker-dir", "runc-direct": "criu-dir"}[case.engine]
    dest = api.materialize_checkpoint(gs.store, ref, tmp_path / ("ck.tar" if form == "podman-archive" else "ck"), form=form)
    if form == "podman-archive":
        out = subprocess.run(["checkpointctl", "inspect", str(dest), "--ps-tree", "--format", "json"], capture_output=True, text=True, check=True)
        [peer] = json.loads(out.stdout)
        assert sizes["pages"] == peer["checkpoint_size"]["memory_pages_size"]
        want = [(peer["process_tree"]["pid"], peer["process_tree"]["command"])]
        want += [(c["pid"], c["command"]) for c in peer["process_tree"].get("children", [])]
        assert sorted((p["pid"], p["comm"]) for p in tree) == sorted(want)
    else:
        pages = sum(p.stat().st_size for p in Path(dest).rglob("pages-*.img"))
        assert sizes["pages"] == pages

    if not cli:
        return
    # The table fits 80 columns and says what the JSON says.
    table = gs("inspect", ref).stdout
    assert max(len(ln) for ln in table.splitlines()) <= 80, table
    assert "sh" in table.split() and str(info["digest"])[:19] in table  # type: ignore[index]
