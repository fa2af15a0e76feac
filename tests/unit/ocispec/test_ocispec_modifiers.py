from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from gpusnap.config import Settings
from gpusnap.ocispec.modifiers import CriuConfigModifier, ModifyContext, apply_chain, default_chain
from gpusnap.steps import Step, run_steps


def _ctx(tmp_path: Path, settings: Settings) -> ModifyContext:
    return ModifyContext(container_id="c1", bundle=tmp_path, command="create", settings=settings)


def test_criu_config_modifier(tmp_path: Path) -> None:
    settings = Settings(run_dir=tmp_path / "run")
    spec: dict[str, Any] = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "annotations": {"gpusnap.io/tcp-established": "true"}}
    original = copy.deepcopy(spec)
    result = apply_chain(spec, default_chain(settings), _ctx(tmp_path, settings))
    assert spec == original  # the input is never changed
    conf = tmp_path / "run" / "criu" / "c1.conf"
    assert result.spec["annotations"]["org.criu.config"] == str(conf)
    assert not conf.exists()  # nothing on disk until the steps run
    run_steps(result.steps)
    assert [ln for ln in conf.read_text().splitlines() if not ln.startswith("#")] == ["link-remap", "tcp-established"]
    # Idempotent: the chain applied to its own output changes nothing.
    again = apply_chain(result.spec, default_chain(settings), _ctx(tmp_path, settings))
    assert again.spec == result.spec


def test_undo_removes_the_file(tmp_path: Path) -> None:
    settings = Settings(run_dir=tmp_path / "run")
    result = apply_chain({}, [CriuConfigModifier(settings)], _ctx(tmp_path, settings))

    def boom() -> None:
        raise RuntimeError("later step failed")

    try:
        run_steps([*result.steps, Step("later", boom)])
    except Exception:
        pass
    assert not (tmp_path / "run" / "criu" / "c1.conf").exists()


def test_users_own_criu_config_is_kept(tmp_path: Path) -> None:
    settings = Settings(run_dir=tmp_path / "run")
    spec = {"annotations": {"org.criu.config": "/etc/criu/mine.conf"}}
    result = apply_chain(spec, default_chain(settings), _ctx(tmp_path, settings))
    assert result.spec == spec and result.steps == []


def test_chain_order_and_steps(tmp_path: Path) -> None:
    calls: list[str] = []

    class Mark:
        def __init__(self, name: str) -> None:
            self.name = name

        def apply(self, spec: dict[str, Any], ctx: ModifyContext) -> list[Step]:
            spec.setdefault("order", []).append(self.name)
            return [Step(self.name, lambda: calls.append(self.name))]

    result = apply_chain({}, [Mark("a"), Mark("b")], _ctx(tmp_path, Settings(run_dir=tmp_path)))
    assert result.spec["order"] == ["a", "b"]
    run_steps(result.steps)
    assert calls == ["a", "b"]
