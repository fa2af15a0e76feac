import json
from pathlib import Path

import pytest

from fake_gpu_tree import make_amd_tree, make_nvidia_tree
from gpusnap.config import HostPaths
from gpusnap.errors import UsageError
from gpusnap.gpu import discovery as d
from gpusnap.gpu import selection as s


def spec(env: list[str] | None = None, annotations: dict | None = None, **extra) -> dict:
    out = {"ociVersion": "1.0.2", "process": {"env": env or ["PATH=/bin"]}, "annotations": annotations or {}}
    out.update(extra)
    return out


@pytest.fixture
def inv(tmp_path: Path) -> d.Inventory:
    make_nvidia_tree(tmp_path)
    return d.discover(HostPaths(tmp_path), nvml=lambda: None)


def test_precedence_annotation_then_gpusnap_then_vendor_env() -> None:
    both = ["NVIDIA_VISIBLE_DEVICES=all", "GPUSNAP_VISIBLE_DEVICES=1"]
    assert s.find_request(spec(both, {s.ANNOTATION: "0"})).source == "annotation gpusnap.io/gpus"
    assert s.find_request(spec(both)).value == "1"
    r = s.find_request(spec(["AMD_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=all"]))
    assert (r.source, r.vendor) == ("env NVIDIA_VISIBLE_DEVICES", "nvidia")
    assert s.find_request(spec(["AMD_VISIBLE_DEVICES=0"])).vendor == "amd"
    assert s.find_request(spec()) is None


def test_later_env_entry_wins() -> None:
    assert s.find_request(spec(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=1"])).value == "1"


def test_all_indexes_uuids(inv) -> None:
    uuids = [g.uuid for g in inv.nvidia.gpus]
    assert s.select(spec(["NVIDIA_VISIBLE_DEVICES=all"]), inv).uuids == uuids
    assert s.select(spec(["NVIDIA_VISIBLE_DEVICES=1"]), inv).uuids == [uuids[1]]
    assert s.select(spec(["NVIDIA_VISIBLE_DEVICES=1,0,1"]), inv).uuids == [uuids[1], uuids[0]]
    assert s.select(spec([f"GPUSNAP_VISIBLE_DEVICES={uuids[1].lower()}"]), inv).uuids == [uuids[1]]
    assert s.select(spec(annotations={s.ANNOTATION: f"0, {uuids[1]}"}), inv).uuids == uuids


def test_none_means_no_gpu_nodes_and_void_means_nothing(inv) -> None:
    sel = s.select(spec(["NVIDIA_VISIBLE_DEVICES=none"]), inv)
    assert sel is not None and sel.gpus == [] and sel.vendor == "nvidia"
    assert s.select(spec(["NVIDIA_VISIBLE_DEVICES=void"]), inv) is None
    assert s.select(spec(["NVIDIA_VISIBLE_DEVICES="]), inv) is None


def test_bad_index_names_it_and_the_gpus_that_exist(inv) -> None:
    with pytest.raises(UsageError) as e:
        s.select(spec(["NVIDIA_VISIBLE_DEVICES=0,7"]), inv)
    msg = str(e.value)
    assert "'7'" in msg and inv.nvidia.gpus[0].uuid in msg and inv.nvidia.gpus[1].uuid in msg and "\n" not in msg
    with pytest.raises(UsageError, match="GPU-nope"):
        s.select(spec(["NVIDIA_VISIBLE_DEVICES=GPU-nope"]), inv)
    with pytest.raises(UsageError, match="empty item"):
        s.select(spec(["NVIDIA_VISIBLE_DEVICES=0,,1"]), inv)


def test_gpu_request_on_host_without_driver(tmp_path: Path) -> None:
    empty = d.discover(HostPaths(tmp_path))
    with pytest.raises(UsageError, match="no NVIDIA driver"):
        s.select(spec(["NVIDIA_VISIBLE_DEVICES=all"]), empty)
    assert s.select(spec(["NVIDIA_VISIBLE_DEVICES=none"]), empty) is None


def test_amd_selection(tmp_path: Path) -> None:
    make_amd_tree(tmp_path)
    inv = d.discover(HostPaths(tmp_path))
    sel = s.select(spec(["AMD_VISIBLE_DEVICES=1"]), inv)
    assert sel.vendor == "amd" and sel.uuids == [inv.amd.gpus[1].gpu.uuid]
    assert s.select(spec(annotations={s.ANNOTATION: "all"}), inv).vendor == "amd"


def test_already_injected_by_cdi_device_or_toolkit_hook() -> None:
    cdi = spec(linux={"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]})
    assert "/dev/nvidia0" in s.already_injected(cdi)
    hooked = spec(hooks={"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["x", "prestart"]}]})
    assert "Toolkit" in s.already_injected(hooked)
    ctk = spec(hooks={"createContainer": [{"path": "/usr/bin/nvidia-ctk", "args": ["nvidia-ctk", "hook", "update-ldcache"]}]})
    assert s.already_injected(ctk)
    assert s.already_injected(spec(linux={"devices": [{"path": "/dev/fuse"}]})) is None
    assert s.already_injected(spec(linux={"devices": [{"path": "/dev/accel0"}]}), {"/dev/accel0"})


def test_cdi_device_paths_read_and_validated(tmp_path: Path) -> None:
    from gpusnap.ocispec.gpu_modifiers import validate_cdi

    cdi = tmp_path / "etc/cdi"
    cdi.mkdir(parents=True)
    (cdi / "vendor.json").write_text(json.dumps({
        "cdiVersion": "0.6.0", "kind": "example.com/gpu",
        "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/egpu0"}]}}],
        "containerEdits": {"deviceNodes": [{"path": "/dev/egpuctl"}]},
    }))
    (cdi / "notes.txt").write_text("ignored")
    assert s.cdi_device_paths(HostPaths(tmp_path), validate_cdi) == {"/dev/egpu0", "/dev/egpuctl"}
    (cdi / "broken.json").write_text(json.dumps({"cdiVersion": "0.6.0", "kind": "example.com/gpu", "devices": [{"name": "0"}]}))
    with pytest.raises(UsageError, match=r"broken.json: invalid at devices/0: 'containerEdits' is a required property"):
        s.cdi_device_paths(HostPaths(tmp_path), validate_cdi)
    (cdi / "broken.json").write_text("{nope")
    with pytest.raises(UsageError, match="not a readable CDI JSON"):
        s.cdi_device_paths(HostPaths(tmp_path), validate_cdi)
