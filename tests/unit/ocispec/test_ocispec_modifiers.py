from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import json

import pytest

from gpusnap.config import HostPaths, Settings
from gpusnap.errors import UsageError
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


def test_users_own_criu_config_is_kept_when_the_admin_wrote_it(tmp_path: Path) -> None:
    settings = Settings(run_dir=tmp_path / "run")
    mine = tmp_path / "mine.conf"
    mine.write_text("tcp-established\n")
    mine.chmod(0o644)
    spec = {"annotations": {"org.criu.config": str(mine)}}
    result = apply_chain(spec, default_chain(settings), _ctx(tmp_path, settings))
    assert result.spec == spec and result.steps == []
    # A file others can write is a file anyone could fill with CRIU options for root.
    mine.chmod(0o666)
    with pytest.raises(UsageError, match="writable by other users"):
        apply_chain(spec, default_chain(settings), _ctx(tmp_path, settings))
    with pytest.raises(UsageError, match="cannot be read"):
        apply_chain({"annotations": {"org.criu.config": "/etc/criu/none-such.conf"}}, default_chain(settings), _ctx(tmp_path, settings))


def test_host_criu_options_are_written_after_the_containers(tmp_path: Path) -> None:
    root = tmp_path / "host"
    root.mkdir()
    settings = Settings(run_dir=tmp_path / "run", host=HostPaths(root), criu_options=("ghost-limit 64M", "tcp-established"))
    result = apply_chain({"annotations": {"gpusnap.io/criu-options": "ghost-limit 1M,file-locks"}}, default_chain(settings), _ctx(tmp_path, settings))
    run_steps(result.steps)
    lines = [ln for ln in (tmp_path / "run" / "criu" / "c1.conf").read_text().splitlines() if not ln.startswith("#")]
    assert lines == ["link-remap", f"ghost-limit {1 << 20}", "file-locks", "ghost-limit 64M", "tcp-established"]
    # nothing of the host's lands in the spec: a checkpoint of it carries none of them
    assert "64M" not in json.dumps(result.spec)


def test_forged_gpu_assignment_without_a_request_is_dropped(tmp_path: Path) -> None:
    settings = Settings(run_dir=tmp_path / "run")
    spec = {"annotations": {"gpusnap.io/assigned-gpus": "GPU-other-tenant", "gpusnap.io/gpu-vendor": "nvidia", "gpusnap.io/criu-libdir": "/tmp/evil"}}
    out = apply_chain(spec, [CriuConfigModifier(settings)], _ctx(tmp_path, settings)).spec
    assert not {"gpusnap.io/assigned-gpus", "gpusnap.io/gpu-vendor", "gpusnap.io/criu-libdir"} & set(out["annotations"])


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


def test_gpu_precheck_matches_selection() -> None:
    """The chain's cheap check names what gpusnap.gpu.selection reads, and agrees with it."""
    from gpusnap.gpu import selection
    from gpusnap.ocispec import gpu_modifiers, modifiers

    assert modifiers.GPU_REQUEST_ANNOTATION == selection.ANNOTATION
    assert set(modifiers.GPU_REQUEST_ENV) == {selection.ENV_GPUSNAP, selection.ENV_NVIDIA, selection.ENV_AMD}
    assert modifiers.GPU_INJECTED_ANNOTATION == gpu_modifiers.ANN_ASSIGNED
    specs: list[dict[str, Any]] = [
        {},
        {"process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"]}},
        {"process": {"env": ["AMD_VISIBLE_DEVICES="]}},
        {"process": {"env": ["NVIDIA_VISIBLE_DEVICESX=1", "XNVIDIA_VISIBLE_DEVICES=1"]}},
        {"annotations": {"gpusnap.io/gpus": "0"}},
        {"annotations": {"gpusnap.io/gpusx": "0"}, "process": {"env": None}},
    ]
    for spec in specs:
        assert modifiers.asks_for_gpus(spec) == (selection.find_request(spec) is not None), spec
    # A spec injected earlier is refreshed even if its request is gone (the modifier decides).
    assert modifiers.asks_for_gpus({"annotations": {"gpusnap.io/assigned-gpus": "GPU-1"}})
    # Given GPU nodes (a device plugin's) are completed with the driver: the same test on both sides.
    assert modifiers.GPU_NODE_PREFIX == selection.GPU_NODE_PREFIX
    for devices in ([{"path": "/dev/nvidia3", "minor": 3}], [{"path": "/dev/nvidiactl"}], [{"path": "/dev/nvidia-uvm"}], [{"path": "/dev/fuse"}]):
        spec = {"linux": {"devices": devices}}
        assert modifiers.has_given_gpu_nodes(spec) == bool(selection.given_gpu_minors(spec)), devices
        assert modifiers.asks_for_gpus(spec) == modifiers.has_given_gpu_nodes(spec)
