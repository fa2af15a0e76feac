import copy
import json
from pathlib import Path

import pytest

from fake_gpu_tree import UVM_MAJOR, make_amd_tree, make_nvidia_tree
from gpusnap.config import HostPaths, Settings
from gpusnap.criu.config import EXTRA_OPTIONS_ANNOTATION, options_from_annotations
from gpusnap.errors import MissingDependencyError, UsageError
from gpusnap.gpu.discovery import DeviceNode, DriverFile, discover
from gpusnap.gpu.selection import GpuRequest, Selection
from gpusnap.ocispec import gpu_modifiers as gm
from gpusnap.ocispec.modifiers import ModifyContext, apply_chain, default_chain
from gpusnap.ocispec.spec import validate_spec
from gpusnap.steps import run_steps

ENV = {"PATH": "/usr/bin"}


def base_spec(env: list[str]) -> dict:
    """A runc-spec-like config.json (as `runc spec` writes it, trimmed)."""
    return {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": ["sh"], "env": env, "cwd": "/"},
        "root": {"path": "rootfs"},
        "hostname": "gs-dev",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}], "resources": {"devices": [{"allow": False, "access": "rwm"}]}},
    }


@pytest.fixture
def hook(tmp_path: Path) -> Path:
    h = tmp_path / "bin/gpusnap-hook"
    h.parent.mkdir()
    h.write_text("#!/bin/sh\n")
    h.chmod(0o755)
    return h


@pytest.fixture
def settings(tmp_path: Path, hook: Path) -> Settings:
    tree = tmp_path / "host"
    make_nvidia_tree(tree)
    return Settings(host=HostPaths(tree), run_dir=tmp_path / "run", state_dir=tmp_path / "state", hook_path=str(hook))


def node(path: str, major: int, minor: int) -> DeviceNode:
    return DeviceNode(path, Path("/x" + path), major, minor, 0o666, 0, 0)


def test_add_device_nodes_with_allow_rules_idempotent() -> None:
    spec = base_spec([])
    nodes = [node("/dev/nvidiactl", 195, 255), node("/dev/nvidia0", 195, 0)]
    gm.add_device_nodes(spec, nodes)
    once = copy.deepcopy(spec)
    gm.add_device_nodes(spec, nodes)
    assert spec == once
    assert spec["linux"]["devices"][1] == {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 0o666, "uid": 0, "gid": 0}
    assert {"allow": True, "type": "c", "major": 195, "minor": 255, "access": "rwm"} in spec["linux"]["resources"]["devices"]
    assert spec["linux"]["resources"]["devices"][0] == {"allow": False, "access": "rwm"}  # deny-all stays first


def test_driver_mounts_at_stable_soname_paths() -> None:
    spec = base_spec([])
    libs = [DriverFile("libcuda.so.1", Path("/h/lib/libcuda.so.580.1"), "lib")]
    bins = [DriverFile("nvidia-smi", Path("/h/bin/nvidia-smi"), "bin")]
    gm.add_driver_mounts(spec, libs, bins)
    gm.add_driver_mounts(spec, libs, bins)
    assert spec["mounts"][1:] == [
        {"destination": "/usr/local/gpusnap/driver/lib/libcuda.so.1", "type": "bind", "source": "/h/lib/libcuda.so.580.1", "options": ["bind", "ro", "nosuid", "nodev"]},
        {"destination": "/usr/local/gpusnap/driver/bin/nvidia-smi", "type": "bind", "source": "/h/bin/nvidia-smi", "options": ["bind", "ro", "nosuid", "nodev"]},
    ]


def test_env_prepends_lib_dir_and_records_gpus() -> None:
    spec = base_spec(["PATH=/bin", "LD_LIBRARY_PATH=/opt/lib", "NVIDIA_VISIBLE_DEVICES=all"])
    sel = Selection(GpuRequest("env NVIDIA_VISIBLE_DEVICES", "all", "nvidia"), "nvidia", [])
    plan = gm.InjectionPlan(sel, libraries=[DriverFile("libcuda.so.1", Path("/l"), "lib")], binaries=[DriverFile("nvidia-smi", Path("/b"), "bin")])
    gm.add_gpu_env(spec, plan)
    gm.add_gpu_env(spec, plan)
    env = spec["process"]["env"]
    assert "LD_LIBRARY_PATH=/usr/local/gpusnap/driver/lib:/opt/lib" in env
    assert "PATH=/bin:/usr/local/gpusnap/driver/bin" in env
    assert "GPUSNAP_ASSIGNED_GPUS=" in env
    assert len(env) == 4


def test_hooks_added_once_per_stage_and_not_doubled_with_hooks_d() -> None:
    spec = base_spec([])
    spec["hooks"] = {"poststop": [{"path": "/usr/bin/gpusnap-hook", "args": ["gpusnap-hook", "poststop"]}]}
    gm.add_hooks(spec, "/opt/g/gpusnap-hook", ["A=1"])
    gm.add_hooks(spec, "/opt/g/gpusnap-hook", ["A=1"])
    assert [h["args"][1] for h in spec["hooks"]["createRuntime"]] == ["createRuntime"]
    assert spec["hooks"]["createContainer"][0] == {"path": "/opt/g/gpusnap-hook", "args": ["gpusnap-hook", "createContainer"], "env": ["A=1"], "timeout": 30}
    assert len(spec["hooks"]["poststop"]) == 1


def test_hook_path_beside_shim_or_missing(tmp_path: Path, hook: Path) -> None:
    s = Settings()
    assert gm.resolve_hook_path(s, shim_path=str(hook.parent / "gpusnap-runtime")) == str(hook)
    with pytest.raises(MissingDependencyError, match="GPUSNAP_HOOK"):
        gm.resolve_hook_path(s, shim_path=str(tmp_path / "nowhere/gpusnap-runtime"))


def test_hook_environment_carries_settings(tmp_path: Path) -> None:
    s = Settings(host=HostPaths(tmp_path), run_dir=Path("/r"), state_dir=Path("/s"))
    env = gm.hook_environment(s, {"GPUSNAP_CONFIG": "/c.toml", "PYTHONPATH": "/site", "OTHER": "x"})
    assert {"GPUSNAP_RUN_DIR=/r", "GPUSNAP_STATE_DIR=/s", f"GPUSNAP_ROOT={tmp_path}", "GPUSNAP_CONFIG=/c.toml", "PYTHONPATH=/site"} <= set(env)
    assert not any(e.startswith("OTHER=") for e in env)


def test_amd_criu_config_libdir_and_kfd_env(tmp_path: Path) -> None:
    spec = base_spec([])
    spec["annotations"] = {gm.ANN_AMD_RELAXED: "true", EXTRA_OPTIONS_ANNOTATION: "tcp-established"}
    env = gm.amd_criu_env(spec, {"KFD_MAX_BUFFER_SIZE": "1G", "OTHER": "x"})
    assert env["KFD_MAX_BUFFER_SIZE"] == "1G" and env["KFD_NUMA_CHECK"] == "0" and "OTHER" not in env
    gm.add_criu_config(spec, "/usr/lib/criu", env)
    gm.add_criu_config(spec, "/usr/lib/criu", env)
    ann = spec["annotations"]
    # The plugin dir is the host's (gpusnap.criu.config.host_options), never an option in an
    # annotation the container could have written itself.
    assert options_from_annotations(ann) == ["link-remap", "tcp-established"]
    libdir, criu_env = gm.criu_settings_from_annotations(ann)
    assert libdir == "/usr/lib/criu" and criu_env == env


def test_whole_injection_nvidia_all(settings: Settings) -> None:
    spec = base_spec(["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"])
    validate_spec(spec, Path("config.json"))
    out = gm.GpuInjection(settings, env=ENV).modify(copy.deepcopy(spec))
    validate_spec(out, Path("config.json"), stage="gpu")
    paths = [d["path"] for d in out["linux"]["devices"]]
    assert paths == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset",
                     "/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2", "/dev/nvidia0", "/dev/nvidia1"]
    uvm = out["linux"]["devices"][1]
    assert (uvm["major"], uvm["minor"]) == (UVM_MAJOR, 0)
    driver = {m["destination"]: m for m in out["mounts"] if m["destination"].startswith("/usr/local/gpusnap")}
    # The driver's own folder, whole, at the stable path: no mount is named by a driver version.
    assert sorted(driver) == ["/usr/local/gpusnap/driver/bin/nvidia-smi", "/usr/local/gpusnap/driver/lib"]
    assert driver["/usr/local/gpusnap/driver/lib"]["source"] == str(settings.host.root / "usr/local/nvidia/lib64")
    assert "ro" in driver["/usr/local/gpusnap/driver/lib"]["options"]
    assert out["annotations"][gm.ANN_VENDOR] == "nvidia"
    assert len(out["annotations"][gm.ANN_ASSIGNED].split(",")) == 2
    assert set(out["hooks"]) == {"createRuntime", "createContainer", "poststop"}
    # Applying again (create twice, or a restore of the same bundle) changes nothing.
    assert gm.GpuInjection(settings, env=ENV).modify(copy.deepcopy(out)) == out


def test_index_selects_one_gpu_node(settings: Settings) -> None:
    out = gm.GpuInjection(settings, env=ENV).modify(base_spec(["NVIDIA_VISIBLE_DEVICES=1"]))
    gpu_nodes = [d["path"] for d in out["linux"]["devices"] if d["path"][-1].isdigit() and "caps" not in d["path"]]
    assert gpu_nodes == ["/dev/nvidia1"]


def test_none_gives_control_nodes_and_libraries_only(settings: Settings) -> None:
    out = gm.GpuInjection(settings, env=ENV).modify(base_spec(["NVIDIA_VISIBLE_DEVICES=none"]))
    paths = [d["path"] for d in out["linux"]["devices"]]
    assert "/dev/nvidiactl" in paths and "/dev/nvidia0" not in paths and "/dev/nvidia1" not in paths


def test_no_request_or_cdi_injected_spec_is_untouched(settings: Settings) -> None:
    plain = base_spec(["PATH=/bin"])
    assert gm.GpuInjection(settings, env=ENV, discover_fn=lambda s: pytest.fail("no discovery for CPU containers")).modify(copy.deepcopy(plain)) == plain
    cdi = base_spec(["NVIDIA_VISIBLE_DEVICES=all"])
    cdi["linux"]["devices"] = [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]
    cdi["mounts"].append({"destination": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04", "type": "bind",
                          "source": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04", "options": ["ro", "bind"]})
    assert gm.GpuInjection(settings, env=ENV).modify(copy.deepcopy(cdi)) == cdi
    cdi["process"]["env"] = ["NVIDIA_VISIBLE_DEVICES=9"]  # the toolkit's value, meaningless to us: left alone
    assert gm.GpuInjection(settings, env=ENV).modify(copy.deepcopy(cdi)) == cdi


def test_device_plugin_nodes_get_the_driver_for_exactly_those_gpus(settings: Settings) -> None:
    """A device plugin hands over /dev/nvidia0 (and the control nodes) and nothing else: the
    container gets the driver's libraries, the hooks and the assignment for GPU 0 only, its
    nodes are not doubled, and the pod author's request does not widen it."""
    given = [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
             {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]
    for env in (["PATH=/bin"], ["NVIDIA_VISIBLE_DEVICES=all"]):
        spec = base_spec(env)
        spec["linux"]["devices"] = copy.deepcopy(given)
        out = gm.GpuInjection(settings, env=ENV).modify(spec)
        paths = [d["path"] for d in out["linux"]["devices"]]
        assert paths.count("/dev/nvidiactl") == 1 and paths.count("/dev/nvidia0") == 1 and "/dev/nvidia1" not in paths, paths
        assert any(m["destination"] == "/usr/local/gpusnap/driver/lib" for m in out["mounts"])
        assert "LD_LIBRARY_PATH=/usr/local/gpusnap/driver/lib" in out["process"]["env"]
        assert len(out["annotations"]["gpusnap.io/assigned-gpus"].split(",")) == 1
        assert out["hooks"]["createContainer"]
        validate_spec(out, Path("config.json"))
        assert gm.GpuInjection(settings, env=ENV).modify(copy.deepcopy(out)) == out  # idempotent


def test_bad_index_is_a_usage_error(settings: Settings) -> None:
    with pytest.raises(UsageError, match="no GPU '5'"):
        gm.GpuInjection(settings, env=ENV).modify(base_spec(["NVIDIA_VISIBLE_DEVICES=5"]))


def test_restore_on_other_driver_and_uvm_major_refreshes_sources(tmp_path: Path, settings: Settings, hook: Path) -> None:
    out = gm.GpuInjection(settings, env=ENV).modify(base_spec(["NVIDIA_VISIBLE_DEVICES=all"]))
    other = tmp_path / "other"
    make_nvidia_tree(other, driver_version="590.10.02", uvm_node_major=UVM_MAJOR)
    s2 = Settings(host=HostPaths(other), run_dir=settings.run_dir, state_dir=settings.state_dir, hook_path=str(hook))
    again = gm.GpuInjection(s2, env=ENV).modify(copy.deepcopy(out))
    libdir = [m for m in again["mounts"] if m["destination"] == "/usr/local/gpusnap/driver/lib"]
    assert len(libdir) == 1 and libdir[0]["source"] == str(other / "usr/local/nvidia/lib64")
    assert sorted(m["destination"] for m in again["mounts"]) == sorted(m["destination"] for m in out["mounts"])
    assert len([d for d in again["linux"]["devices"] if d["path"] == "/dev/nvidiactl"]) == 1
    rules = again["linux"]["resources"]["devices"]
    assert len(rules) == len({json.dumps(r, sort_keys=True) for r in rules})


def test_amd_injection(tmp_path: Path, hook: Path) -> None:
    root = tmp_path / "amdhost"
    make_amd_tree(root)
    plugdir = root / "usr/lib/criu"
    plugdir.mkdir(parents=True)
    (plugdir / "amdgpu_plugin.so").write_text("x")
    s = Settings(host=HostPaths(root), hook_path=str(hook))
    out = gm.GpuInjection(s, env={"KFD_NUMA_CHECK": "0"}).modify(base_spec(["AMD_VISIBLE_DEVICES=1"]))
    assert [d["path"] for d in out["linux"]["devices"]] == ["/dev/kfd", "/dev/dri/card1", "/dev/dri/renderD129"]
    assert out["annotations"][gm.ANN_CRIU_LIBDIR] == str(plugdir)
    assert json.loads(out["annotations"][gm.ANN_CRIU_ENV]) == {"KFD_NUMA_CHECK": "0"}
    assert EXTRA_OPTIONS_ANNOTATION not in out["annotations"]
    # ...the shim's CRIU config file gets it from the host, through the chain
    s2 = Settings(host=HostPaths(root), hook_path=str(hook), run_dir=tmp_path / "run")
    result = apply_chain(base_spec(["AMD_VISIBLE_DEVICES=1"]), default_chain(s2), ModifyContext("gs-amd", tmp_path, "create", s2))
    run_steps(result.steps)
    assert f"libdir {plugdir}" in (tmp_path / "run" / "criu" / "gs-amd.conf").read_text().splitlines()


def test_in_the_shims_default_chain(settings: Settings, tmp_path: Path) -> None:
    spec = base_spec(["NVIDIA_VISIBLE_DEVICES=0"])
    names = [m.name for m in default_chain(settings)]
    assert names[0] == "gpu-devices" and "criu-config" in names
    ctx = ModifyContext("gs-dev-x", tmp_path, "create", settings)
    result = apply_chain(spec, default_chain(settings), ctx)
    assert any(d["path"] == "/dev/nvidia0" for d in result.spec["linux"]["devices"])
    validate_spec(result.spec, Path("config.json"), stage="chain")


def test_hooks_d_schema_rejects_bad_stage() -> None:
    with pytest.raises(UsageError, match="stages/0"):
        gm.validate_hooks_d({"version": "1.0.0", "hook": {"path": "/x"}, "when": {"always": True}, "stages": ["prestop"]}, "f.json")


def test_without_a_driver_folder_each_library_is_mounted_at_its_soname(tmp_path: Path, hook: Path) -> None:
    """Libraries found through the ld cache in a shared system folder: one mount per library."""
    root = tmp_path / "host"
    tree = make_nvidia_tree(root, lib_dir="usr/lib/x86_64-linux-gnu")
    cache = {p.name: p for p in tree.lib_dir.iterdir() if p.is_symlink() and p.name.endswith(".so.1")}
    s = Settings(host=HostPaths(root), hook_path=str(hook))
    inv = lambda st: discover(st.host, nvml=lambda: None)  # noqa: E731
    from gpusnap.gpu import discovery as d

    def with_cache(st: Settings):
        full = inv(st)
        full.nvidia.libraries = d.nvidia_libraries(st.host, ld_cache=cache, driver_version="580.00.01")
        return full

    out = gm.GpuInjection(s, env=ENV, discover_fn=with_cache).modify(base_spec(["NVIDIA_VISIBLE_DEVICES=0"]))
    libs = {m["destination"]: m["source"] for m in out["mounts"] if "/driver/lib" in m["destination"]}
    assert libs == {
        "/usr/local/gpusnap/driver/lib/libcuda.so.1": str(tree.lib_dir / "libcuda.so.580.00.01"),
        "/usr/local/gpusnap/driver/lib/libnvidia-ml.so.1": str(tree.lib_dir / "libnvidia-ml.so.580.00.01"),
        "/usr/local/gpusnap/driver/lib/libnvidia-ptxjitcompiler.so.1": str(tree.lib_dir / "libnvidia-ptxjitcompiler.so.580.00.01"),
    }
    assert "LD_LIBRARY_PATH=/usr/local/gpusnap/driver/lib" in out["process"]["env"]


def test_restore_on_a_host_without_the_gpus_is_incompatible(tmp_path: Path, settings: Settings, hook: Path) -> None:
    from gpusnap.errors import IncompatibleHostError

    spec = base_spec(["NVIDIA_VISIBLE_DEVICES=1"])
    gm.GpuInjection(settings, env=ENV).apply(spec, ModifyContext("gs-dev-c", tmp_path, "create", settings))
    bare = Settings(host=HostPaths(tmp_path / "cpu-only"), hook_path=str(hook))
    with pytest.raises(IncompatibleHostError, match="cannot restore here: .*no NVIDIA driver"):
        gm.GpuInjection(bare, env=ENV).apply(spec, ModifyContext("gs-dev-c", tmp_path, "restore", bare))
    with pytest.raises(UsageError):
        gm.GpuInjection(bare, env=ENV).apply(base_spec(["NVIDIA_VISIBLE_DEVICES=1"]), ModifyContext("gs-dev-d", tmp_path, "create", bare))


def test_admin_can_refuse_gpu_requests_from_the_containers_environment(settings: Settings, tmp_path: Path) -> None:
    """gpu_request_env = false: NVIDIA_VISIBLE_DEVICES=all in a pod's env (or a CUDA image's)
    gets no GPU from gpusnap, as with the NVIDIA toolkit's unprivileged setting; the annotation,
    which the admin's runtime handler decides to pass or not, still works."""
    from dataclasses import replace

    strict = replace(settings, gpu_request_env=False)
    ctx = ModifyContext("gs-env", tmp_path, "create", strict)
    out = apply_chain(base_spec(["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"]), default_chain(strict), ctx).spec
    assert not any(str(d.get("path", "")).startswith("/dev/nvidia") for d in (out.get("linux") or {}).get("devices") or [])
    assert gm.ANN_ASSIGNED not in out["annotations"]
    by_annotation = base_spec(["PATH=/bin"])
    by_annotation["annotations"] = {"gpusnap.io/gpus": "0"}
    out = apply_chain(by_annotation, default_chain(strict), ctx).spec
    assert any(d["path"] == "/dev/nvidia0" for d in out["linux"]["devices"])


def test_gpu_request_env_setting_from_the_config_file(tmp_path: Path) -> None:
    from gpusnap.config import load_settings

    cfg = tmp_path / "config.toml"
    cfg.write_text("gpu_request_env = false\n")
    assert load_settings(env={}, config_file=cfg).gpu_request_env is False
    assert load_settings(env={}, config_file=tmp_path / "none.toml").gpu_request_env is True
    cfg.write_text('gpu_request_env = "sometimes"\n')
    with pytest.raises(UsageError, match="true or false"):
        load_settings(env={}, config_file=cfg)
