from pathlib import Path

import pytest

from fake_gpu_tree import CAPS_MAJOR, UVM_MAJOR, make_amd_tree, make_nvidia_tree
from gpusnap.config import HostPaths
from gpusnap.gpu import discovery as d


@pytest.fixture
def nv(tmp_path: Path):
    return make_nvidia_tree(tmp_path)


def test_control_nodes_read_from_the_nodes_themselves(nv) -> None:
    nodes = {n.path: n for n in d.nvidia_control_nodes(HostPaths(nv.root))}
    assert (nodes["/dev/nvidiactl"].major, nodes["/dev/nvidiactl"].minor) == (195, 255)
    assert (nodes["/dev/nvidia-uvm"].major, nodes["/dev/nvidia-uvm"].minor) == (UVM_MAJOR, 0)
    assert (nodes["/dev/nvidia-uvm-tools"].major, nodes["/dev/nvidia-uvm-tools"].minor) == (UVM_MAJOR, 1)
    assert (nodes["/dev/nvidia-modeset"].major, nodes["/dev/nvidia-modeset"].minor) == (195, 254)
    assert nodes["/dev/nvidia-caps/nvidia-cap1"].major == CAPS_MAJOR
    assert nodes["/dev/nvidia-caps/nvidia-cap1"].file_mode == 0o400
    assert nodes["/dev/nvidiactl"].file_mode == 0o666
    assert nodes["/dev/nvidiactl"].host_path == nv.root / "dev/nvidiactl"


def test_stale_uvm_node_with_wrong_major_is_left_out(tmp_path: Path) -> None:
    tree = make_nvidia_tree(tmp_path, uvm_node_major=UVM_MAJOR + 5)
    paths = {n.path for n in d.nvidia_control_nodes(HostPaths(tree.root))}
    assert "/dev/nvidia-uvm" not in paths and "/dev/nvidiactl" in paths


def test_regular_file_is_not_a_device(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidiactl").write_text("")
    assert d.read_device_node(HostPaths(tmp_path), "/dev/nvidiactl") is None
    assert not d.discover_nvidia(HostPaths(tmp_path)).present


def test_proc_devices_parses_char_section_only(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/devices").write_text("Character devices:\n 10 misc\n238 nvidia-uvm\n\nBlock devices:\n 99 nvidia-uvm\n")
    assert d.read_proc_devices(HostPaths(tmp_path)) == {"misc": 10, "nvidia-uvm": 238}


def test_gpus_from_proc_in_pci_order(nv) -> None:
    gpus = d.nvidia_gpus_from_proc(HostPaths(nv.root))
    assert [(g.index, g.uuid, g.minor) for g in gpus] == [(0, nv.uuids[0], 0), (1, nv.uuids[1], 1)]
    assert gpus[1].name == "NVIDIA Fake H100"
    assert gpus[0].driver_version == "580.00.01"
    assert gpus[0].pci_bus_id == "0000:01:00.0"


def test_nvml_used_when_it_answers(nv) -> None:
    fake = [d.GpuIdentity(0, "GPU-nvml", "From NVML", 80 << 30, "nvidia", minor=0, driver_version="580.1")]
    inv = d.discover_nvidia(HostPaths(nv.root), nvml=lambda: fake, ld_cache={})
    assert inv.gpus == fake and inv.driver_version == "580.1"
    inv = d.discover_nvidia(HostPaths(nv.root), nvml=lambda: None, ld_cache={})
    assert [g.uuid for g in inv.gpus] == nv.uuids


def test_libraries_named_by_soname(nv) -> None:
    libs = {f.name: f for f in d.libraries_in_dir(nv.lib_dir)}
    assert set(libs) == {"libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1", "libnvidia-glcore.so.580.00.01"}
    assert libs["libcuda.so.1"].host_path == nv.lib_dir / "libcuda.so.580.00.01"
    assert all(f.kind == "lib" for f in libs.values())


def test_ld_cache_libraries_added_after_driver_dirs(nv, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "libnvidia-encode.so.580.00.01").write_text("x")
    cache = {"libnvidia-encode.so.1": other / "libnvidia-encode.so.580.00.01", "libz.so.1": other / "libz.so.1",
             "libcuda.so.1": other / "libcuda.so.1"}
    libs = {f.name: f for f in d.nvidia_libraries(HostPaths(nv.root), ld_cache=cache)}
    assert libs["libnvidia-encode.so.1"].host_path == other / "libnvidia-encode.so.580.00.01"
    assert libs["libcuda.so.1"].host_path == nv.lib_dir / "libcuda.so.580.00.01"  # driver dir wins
    assert "libz.so.1" not in libs


def test_ld_cache_read_with_ldconfig_from_the_roots_cache() -> None:
    # The real host's cache through the real ldconfig: libc is always in it.
    entries = d.ld_cache_entries(HostPaths(Path("/")))
    assert "libc.so.6" in entries and entries["libc.so.6"].exists()


def test_binaries(nv) -> None:
    bins = d.nvidia_binaries(HostPaths(nv.root))
    assert [(b.name, b.kind) for b in bins] == [("nvidia-smi", "bin")]


def test_full_inventory(nv) -> None:
    inv = d.discover(HostPaths(nv.root))
    assert inv.nvidia.present and not inv.amd.present
    assert sorted(inv.nvidia.gpu_nodes) == [0, 1]
    assert inv.nvidia.driver_version == "580.00.01"
    assert inv.nvidia.lib_dir == nv.lib_dir.resolve()


def test_no_driver_means_empty_inventory(tmp_path: Path) -> None:
    inv = d.discover(HostPaths(tmp_path))
    assert not inv.nvidia.present and not inv.amd.present and inv.nvidia.gpus == []


def test_amd_nodes_grouped_per_gpu(tmp_path: Path) -> None:
    make_amd_tree(tmp_path)
    amd = d.discover_amd(HostPaths(tmp_path))
    assert amd.kfd is not None and amd.kfd.path == "/dev/kfd"
    assert [g.gpu.index for g in amd.gpus] == [0, 1]
    assert [n.path for n in amd.gpus[0].nodes] == ["/dev/dri/card0", "/dev/dri/renderD128"]
    assert [n.path for n in amd.gpus[1].nodes] == ["/dev/dri/card1", "/dev/dri/renderD129"]
    assert amd.gpus[1].gpu.name == "AMD Fake MI100"
    assert amd.gpus[1].gpu.memory_total_bytes == 2 * 2**30
    assert amd.gpus[0].gpu.uuid == "0000000000000001"


def test_ld_cache_leftovers_of_another_driver_version_skipped(nv, tmp_path: Path) -> None:
    other = tmp_path / "usrlib"
    other.mkdir()
    (other / "libnvidia-encode.so.470.1").write_text("old")
    (other / "libnvidia-fbc.so.580.00.01").write_text("current")
    cache = {"libnvidia-encode.so.1": other / "libnvidia-encode.so.470.1", "libnvidia-fbc.so.1": other / "libnvidia-fbc.so.580.00.01"}
    names = {f.name for f in d.nvidia_libraries(HostPaths(nv.root), ld_cache=cache, driver_version="580.00.01")}
    assert "libnvidia-fbc.so.1" in names and "libnvidia-encode.so.1" not in names
