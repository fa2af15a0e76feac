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


def test_already_injected_by_toolkit_hook_or_driver_mount_not_by_nodes_alone() -> None:
    nodes = spec(linux={"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]})
    assert s.already_injected(nodes) is None  # a device plugin's nodes: the driver is still missing
    hooked = spec(hooks={"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["x", "prestart"]}]})
    assert "Toolkit" in s.already_injected(hooked)
    ctk = spec(hooks={"createContainer": [{"path": "/usr/bin/nvidia-ctk", "args": ["nvidia-ctk", "hook", "update-ldcache"]}]})
    assert s.already_injected(ctk)
    cdi_hook = spec(hooks={"createContainer": [{"path": "/usr/bin/nvidia-cdi-hook", "args": ["nvidia-cdi-hook", "create-symlinks"]}]})
    assert s.already_injected(cdi_hook)
    cdi_mount = spec(mounts=[{"destination": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04", "source": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"}])
    assert "libcuda" in s.already_injected(cdi_mount)
    assert s.already_injected(spec(mounts=[{"destination": "/usr/lib/libcudart.so.12"}])) is None


def test_given_gpu_nodes_decide_whatever_the_request(inv) -> None:
    gpu1 = next(g for g in inv.nvidia.gpus if g.index == 1)
    minor = gpu1.minor if gpu1.minor >= 0 else gpu1.index
    given = {"devices": [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
                         {"path": f"/dev/nvidia{minor}", "type": "c", "major": 195, "minor": minor}]}
    assert s.given_gpu_minors(spec(linux=given)) == {minor}
    for env in (["PATH=/bin"], ["NVIDIA_VISIBLE_DEVICES=all"], ["NVIDIA_VISIBLE_DEVICES=9"], ["NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"]):
        sel = s.select(spec(env, linux=given), inv)
        assert sel is not None and sel.uuids == [gpu1.uuid] and sel.request.source == s.NODES_SOURCE, env
        assert s.select(spec(env, linux=given), inv, from_env=False).uuids == [gpu1.uuid]
    # nvidiactl alone names no GPU: the request decides as without nodes
    ctl = {"devices": given["devices"][:1]}
    assert s.select(spec(["PATH=/bin"], linux=ctl), inv) is None
    assert s.select(spec(["NVIDIA_VISIBLE_DEVICES=all"], linux=ctl), inv).uuids == [g.uuid for g in inv.nvidia.gpus]
    # nodes of GPUs this host does not have: nothing to complete, the request decides
    assert s.select(spec(linux={"devices": [{"path": "/dev/nvidia77", "type": "c", "major": 195, "minor": 77}]}), inv) is None
