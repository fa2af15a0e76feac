"""Spec modifiers that give a container the GPUs it asked for, at ``create`` time.

:class:`GpuInjection` is the one entry of the shim's modifier chain: it discovers the host's
GPUs, reads the container's request (:mod:`gpusnap.gpu.selection`) and, when something is to be
injected, applies the small units below in order. Each unit is a plain function of
``(spec, ...)`` that edits the spec in place and is idempotent (applying it twice gives the same
spec), so a spec passing through create twice, or a restore reusing it, never doubles entries.

Driver libraries appear under one *stable* folder, ``/usr/local/gpusnap/driver/lib``, and
``LD_LIBRARY_PATH`` points there. CRIU restores a container only when every mount it dumped has a
place to go, and programs load ``libcuda.so.1``, not ``libcuda.so.580.159.04``; so no mount may
be named by a driver version (the failure of NVIDIA/cuda-checkpoint#21 is versioned paths baked
into the images). Where the driver has a folder of its own (``/usr/local/nvidia/lib64``) that
folder is mounted whole at the stable path: one mount, the same on every host, whatever version
is inside. Otherwise each library is mounted at its soname; libraries that have no soname link
keep their versioned name, which ties a checkpoint to that driver version (docs/devices.md).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpusnap.config import Settings
from gpusnap.criu.config import AMD_RELAXED_ANNOTATION, CRIU_ENV_ANNOTATION, EXTRA_OPTIONS_ANNOTATION, check_criu_env
from gpusnap.criu.config import find_criu_plugin_dir as _find_plugin_dir
from gpusnap.errors import IncompatibleHostError, MissingDependencyError, UsageError
from gpusnap.gpu.discovery import DeviceNode, DriverFile, Inventory, discover
from gpusnap.gpu.selection import ASSIGNED_ANNOTATION, NODES_SOURCE, VENDOR_ANNOTATION, Selection, already_injected, select

STABLE_LIB_DIR = "/usr/local/gpusnap/driver/lib"
STABLE_BIN_DIR = "/usr/local/gpusnap/driver/bin"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

ANN_ASSIGNED = ASSIGNED_ANNOTATION  # comma list of UUIDs actually given
ANN_VENDOR = VENDOR_ANNOTATION
# Comma list of the GPU nodes the spec came with (a device plugin's): kept when a later pass
# takes out what gpusnap put in, so that they still decide which GPUs the container has.
ANN_GIVEN_NODES = "gpusnap.io/given-gpu-nodes"
# The host's CRIU plugin directory, for information only: the shim's CRIU config takes it from
# the host again at every create and restore (gpusnap.criu.config.host_options), never from here.
ANN_CRIU_LIBDIR = "gpusnap.io/criu-libdir"
ANN_CRIU_ENV = CRIU_ENV_ANNOTATION  # JSON object: environment for CRIU (the amdgpu plugin's KFD_*)
ANN_AMD_RELAXED = AMD_RELAXED_ANNOTATION  # "true": allow restore on a different AMD GPU

HOOK_STAGES = ("createRuntime", "createContainer", "poststop")
HOOK_TIMEOUT_S = 30
# The amdgpu CRIU plugin's restore-time compatibility checks; each is on unless set to 0.
KFD_CHECK_VARS = (
    "KFD_FW_VER_CHECK",
    "KFD_SDMA_FW_VER_CHECK",
    "KFD_CACHES_COUNT_CHECK",
    "KFD_NUM_GWS_CHECK",
    "KFD_VRAM_SIZE_CHECK",
    "KFD_NUMA_CHECK",
    "KFD_CAPABILITY_CHECK",
)

if TYPE_CHECKING:
    from gpusnap.ocispec.modifiers import ModifyContext
    from gpusnap.steps import Step

SCHEMA_DIR = Path(__file__).with_name("schema")


# ---- validation of the files this area reads or writes ------------------------------------


@cache
def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / name).read_text())


def _validate(doc: Any, schema_name: str, what: str, fix: str) -> None:
    import jsonschema  # heavy: only where a file is actually checked

    validator = jsonschema.Draft202012Validator(_schema(schema_name))
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise UsageError(f"{what}: invalid at {where}: {error.message}; {fix}")


def validate_hooks_d(doc: Any, what: str) -> None:
    _validate(doc, "oci-hooks-d.schema.json", what, "this is a gpusnap bug, please report it")


# ---- the plan ------------------------------------------------------------------------------


@dataclass
class InjectionPlan:
    """Everything :func:`apply_plan` puts into one container's spec."""

    selection: Selection
    nodes: list[DeviceNode] = field(default_factory=list)
    libraries: list[DriverFile] = field(default_factory=list)
    binaries: list[DriverFile] = field(default_factory=list)
    lib_dir: Path | None = None  # mounted whole at STABLE_LIB_DIR instead of ``libraries``
    hook_path: str | None = None
    hook_env: list[str] = field(default_factory=list)
    criu_libdir: str | None = None
    criu_env: dict[str, str] = field(default_factory=dict)


def resolve_hook_path(settings: Settings, shim_path: str | None = None) -> str:
    """``settings.hook_path``, else ``gpusnap-hook`` beside the running shim."""
    if settings.hook_path:
        path = Path(settings.hook_path)
    else:
        path = Path(shim_path or sys.argv[0]).absolute().parent / "gpusnap-hook"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise MissingDependencyError(
            f"gpusnap-hook not found at {path}; install it beside gpusnap-runtime or set GPUSNAP_HOOK / hook_path"
        )
    return str(path)


def hook_environment(settings: Settings, env: Mapping[str, str]) -> list[str]:
    """The environment hooks run with: runc gives hooks only what the spec lists."""
    out = [
        f"PATH={DEFAULT_PATH}",
        f"GPUSNAP_RUN_DIR={settings.run_dir}",
        f"GPUSNAP_STATE_DIR={settings.state_dir}",
    ]
    if settings.host.root != Path("/"):
        out.append(f"GPUSNAP_ROOT={settings.host.root}")
    if env.get("GPUSNAP_CONFIG"):
        out.append(f"GPUSNAP_CONFIG={env['GPUSNAP_CONFIG']}")
    if env.get("PYTHONPATH"):
        # gpusnap installed with pip --target: the hook must import the same gpusnap as the shim.
        out.append(f"PYTHONPATH={env['PYTHONPATH']}")
    return out


def find_criu_plugin_dir(settings: Settings, plugin: str = "amdgpu_plugin.so") -> str | None:
    return _find_plugin_dir(settings.host.root, plugin)


def amd_criu_env(spec: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """KFD_* for CRIU's amdgpu plugin: the operator's own, or all checks off when the container
    is annotated for restore onto different AMD GPUs."""
    out = {k: v for k, v in env.items() if k.startswith("KFD_")}
    if str((spec.get("annotations") or {}).get(ANN_AMD_RELAXED, "")).lower() in ("1", "true", "yes"):
        out.update({k: "0" for k in KFD_CHECK_VARS})
    return out


def plan_injection(
    spec: dict[str, Any],
    settings: Settings,
    inventory: Inventory,
    *,
    env: Mapping[str, str] | None = None,
    shim_path: str | None = None,
) -> InjectionPlan | None:
    """What to inject into ``spec``; None when it asks for no GPUs or already has them."""
    env = os.environ if env is None else env
    # GPUs that CDI or the NVIDIA toolkit injected win, whatever the request says.
    if already_injected(spec) is not None:
        return None
    selection = select(spec, inventory, from_env=settings.gpu_request_env)
    if selection is None:
        return None
    plan = InjectionPlan(selection=selection)
    if selection.vendor == "nvidia":
        nv = inventory.nvidia
        plan.nodes = list(nv.control_nodes)
        for gpu in selection.gpus:
            node = nv.gpu_nodes.get(gpu.minor if gpu.minor >= 0 else gpu.index)
            if node is None:
                raise UsageError(
                    f"{selection.request.source}: GPU {gpu.index} ({gpu.uuid}) has no /dev/nvidia{gpu.minor} node on this host; "
                    "load the driver (nvidia-modprobe) or pick another GPU"
                )
            plan.nodes.append(node)
        plan.libraries = list(nv.libraries)
        plan.lib_dir = nv.lib_dir
        plan.binaries = list(nv.binaries)
    else:
        amd = inventory.amd
        assert amd.kfd is not None  # select() refuses AMD requests without /dev/kfd
        plan.nodes = [amd.kfd]
        chosen = {g.uuid for g in selection.gpus}
        for entry in amd.gpus:
            if entry.gpu.uuid in chosen:
                plan.nodes.extend(entry.nodes)
        plan.criu_libdir = find_criu_plugin_dir(settings)
        plan.criu_env = amd_criu_env(spec, env)
    plan.hook_path = resolve_hook_path(settings, shim_path)
    plan.hook_env = hook_environment(settings, env)
    return plan


# ---- the units -----------------------------------------------------------------------------


def add_device_nodes(spec: dict[str, Any], nodes: list[DeviceNode]) -> None:
    """Each node in ``linux.devices`` and an ``rwm`` allow rule for it in the device cgroup."""
    linux = spec.setdefault("linux", {})
    devices = linux.setdefault("devices", [])
    rules = linux.setdefault("resources", {}).setdefault("devices", [])
    have = {d.get("path") for d in devices}
    for n in nodes:
        if n.path not in have:
            devices.append(
                {"path": n.path, "type": n.type, "major": n.major, "minor": n.minor, "fileMode": n.file_mode, "uid": n.uid, "gid": n.gid}
            )
            have.add(n.path)
        rule = {"allow": True, "type": n.type, "major": n.major, "minor": n.minor, "access": "rwm"}
        if rule not in rules:
            rules.append(rule)


def add_driver_mounts(spec: dict[str, Any], libraries: list[DriverFile], binaries: list[DriverFile], lib_dir: Path | None = None) -> None:
    """Read-only bind mounts at stable paths: the driver's library folder whole (``lib_dir``),
    else each library at its soname; each tool at its name."""
    mounts = spec.setdefault("mounts", [])
    have = {m.get("destination") for m in mounts}
    if lib_dir is not None:
        if STABLE_LIB_DIR not in have:
            mounts.append({"destination": STABLE_LIB_DIR, "type": "bind", "source": str(lib_dir), "options": ["bind", "ro", "nosuid", "nodev"]})
            have.add(STABLE_LIB_DIR)
        libraries = []
    for f in [*libraries, *binaries]:
        dest = f"{STABLE_LIB_DIR if f.kind == 'lib' else STABLE_BIN_DIR}/{f.name}"
        if dest in have:
            continue
        mounts.append({"destination": dest, "type": "bind", "source": str(f.host_path), "options": ["bind", "ro", "nosuid", "nodev"]})
        have.add(dest)


def _prepend_path(value: str | None, entry: str) -> str:
    parts = [p for p in (value or "").split(":") if p]
    return ":".join([entry, *[p for p in parts if p != entry]])


def _append_path(value: str | None, entry: str) -> str:
    parts = [p for p in (value or "").split(":") if p and p != entry]
    return ":".join([*parts, entry])


def add_gpu_env(spec: dict[str, Any], plan: InjectionPlan) -> None:
    """LD_LIBRARY_PATH / PATH to the stable driver dirs, and the assigned GPUs for the workload."""
    process = spec.setdefault("process", {})
    env_list: list[str] = process.setdefault("env", [])
    env = dict(e.partition("=")[::2] for e in env_list)
    updates: dict[str, str] = {}
    if plan.libraries or plan.lib_dir is not None:
        updates["LD_LIBRARY_PATH"] = _prepend_path(env.get("LD_LIBRARY_PATH"), STABLE_LIB_DIR)
    if plan.binaries:
        updates["PATH"] = _append_path(env.get("PATH") or DEFAULT_PATH, STABLE_BIN_DIR)
    updates["GPUSNAP_ASSIGNED_GPUS"] = ",".join(plan.selection.uuids)
    for key, value in updates.items():
        entry = f"{key}={value}"
        idx = [i for i, e in enumerate(env_list) if e.partition("=")[0] == key]
        if idx:
            env_list[idx[-1]] = entry
            for i in reversed(idx[:-1]):
                del env_list[i]
        else:
            env_list.append(entry)


def add_hooks(spec: dict[str, Any], hook_path: str, hook_env: list[str]) -> None:
    """``gpusnap-hook STAGE`` at each stage, unless one is there already (e.g. from hooks.d)."""
    hooks = spec.setdefault("hooks", {})
    for stage in HOOK_STAGES:
        entries = hooks.setdefault(stage, [])
        present = any(
            os.path.basename(str(h.get("path", ""))) == "gpusnap-hook" and stage in (h.get("args") or [])
            for h in entries
        )
        if not present:
            entries.append({"path": hook_path, "args": ["gpusnap-hook", stage], "env": list(hook_env), "timeout": HOOK_TIMEOUT_S})


def annotate_assignment(spec: dict[str, Any], selection: Selection, given_nodes: list[str]) -> None:
    ann = spec.setdefault("annotations", {})
    ann[ANN_ASSIGNED] = ",".join(selection.uuids)
    ann[ANN_VENDOR] = selection.vendor
    if given_nodes:
        ann[ANN_GIVEN_NODES] = ",".join(given_nodes)


def add_criu_config(spec: dict[str, Any], libdir: str | None, criu_env: dict[str, str]) -> None:
    """Where CRIU finds its GPU plugin and the environment it needs, for the shim's
    checkpoint/restore (runc starts CRIU with the runtime's environment, not the container's)."""
    ann = spec.setdefault("annotations", {})
    if libdir:
        # Not an option for CRIU: annotations are the container's to write, so the CRIU config
        # file gets "libdir" from the host itself (gpusnap.criu.config.host_options).
        ann[ANN_CRIU_LIBDIR] = libdir
    if criu_env:
        ann[ANN_CRIU_ENV] = json.dumps(dict(sorted(criu_env.items())), separators=(",", ":"))


def criu_settings_from_annotations(annotations: Mapping[str, str]) -> tuple[str | None, dict[str, str]]:
    """For the shim's checkpoint/restore: (CRIU --libdir, extra environment for CRIU)."""
    env: dict[str, str] = {}
    raw = annotations.get(ANN_CRIU_ENV)
    if raw:
        try:
            loaded = json.loads(raw)
        except json.JSONDecodeError:
            raise UsageError(f"annotation {ANN_CRIU_ENV} is not a JSON object; remove or fix it") from None
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise UsageError(f"annotation {ANN_CRIU_ENV} must map names to strings")
        env = check_criu_env(loaded, ANN_CRIU_ENV)
    return annotations.get(ANN_CRIU_LIBDIR), env


def apply_plan(spec: dict[str, Any], plan: InjectionPlan) -> dict[str, Any]:
    given = sorted(str(d.get("path")) for d in (spec.get("linux") or {}).get("devices") or []
                   if plan.selection.request.source == NODES_SOURCE and str(d.get("path", "")).startswith("/dev/nvidia"))
    add_device_nodes(spec, plan.nodes)
    add_driver_mounts(spec, plan.libraries, plan.binaries, plan.lib_dir)
    add_gpu_env(spec, plan)
    if plan.hook_path:
        add_hooks(spec, plan.hook_path, plan.hook_env)
    annotate_assignment(spec, plan.selection, given)
    if plan.selection.vendor == "amd":
        add_criu_config(spec, plan.criu_libdir, plan.criu_env)
    return spec


def strip_own_injection(spec: dict[str, Any]) -> bool:
    """Take out what an earlier pass of :class:`GpuInjection` put in (its annotation says so):
    GPU device nodes, their allow rules, and the driver mounts. At restore this lets the current
    host's nodes (the UVM major is dynamic) and library files replace the checkpointing host's
    behind the same stable paths. Returns False when the spec holds no injection of ours."""
    annotations = spec.get("annotations") or {}
    if ANN_ASSIGNED not in annotations:
        return False
    linux = spec.get("linux") or {}
    devices = linux.get("devices") or []
    given = set(str(annotations.get(ANN_GIVEN_NODES, "")).split(","))
    gpu_nodes = [d for d in devices if str(d.get("path", "")).startswith(("/dev/nvidia", "/dev/kfd", "/dev/dri/"))]
    ours = [d for d in gpu_nodes if d.get("path") not in given]
    linux["devices"] = [d for d in devices if d not in ours]
    # The given nodes' allow rules go too: the injection adds the same rules again, in its order.
    gone = {(d.get("type", "c"), d.get("major"), d.get("minor")) for d in gpu_nodes}
    resources = linux.get("resources") or {}
    if "devices" in resources:
        resources["devices"] = [
            r for r in resources["devices"]
            if not (r.get("allow") and r.get("access") == "rwm" and (r.get("type"), r.get("major"), r.get("minor")) in gone)
        ]
    spec["mounts"] = [m for m in spec.get("mounts") or [] if not str(m.get("destination", "")).startswith("/usr/local/gpusnap/driver/")]
    for key in (ANN_ASSIGNED, ANN_VENDOR, ANN_CRIU_ENV, ANN_GIVEN_NODES):
        annotations.pop(key, None)
    if annotations.pop(ANN_CRIU_LIBDIR, None) is not None:
        # Specs written before the libdir moved to the host side carry it in the options too.
        opts = [o for o in annotations.get(EXTRA_OPTIONS_ANNOTATION, "").split(",") if o.strip() and not o.strip().lstrip("-").startswith("libdir")]
        if opts:
            annotations[EXTRA_OPTIONS_ANNOTATION] = ",".join(opts)
        else:
            annotations.pop(EXTRA_OPTIONS_ANNOTATION, None)
    return True


class GpuInjection:
    """The modifier-chain entry (gpusnap.ocispec.modifiers.SpecModifier): discover, select,
    inject. Does nothing for containers that ask for no GPUs.

    It runs at create/run and again at restore; a spec it already modified is refreshed (its
    own entries replaced by the current host's), never doubled.
    """

    name = "gpu-devices"

    def __init__(
        self,
        settings: Settings,
        *,
        discover_fn: Callable[[Settings], Inventory] | None = None,
        env: Mapping[str, str] | None = None,
        shim_path: str | None = None,
    ) -> None:
        self.settings = settings
        self._discover = discover_fn or (lambda s: discover(s.host))
        self._env = env
        self._shim_path = shim_path

    def modify(self, spec: dict[str, Any]) -> dict[str, Any]:
        from gpusnap.gpu.selection import find_request, given_gpu_minors

        if find_request(spec, from_env=self.settings.gpu_request_env) is None and not given_gpu_minors(spec):
            return spec  # the common case: no discovery at all for CPU containers
        strip_own_injection(spec)
        plan = plan_injection(spec, self.settings, self._discover(self.settings), env=self._env, shim_path=self._shim_path)
        return spec if plan is None else apply_plan(spec, plan)

    def apply(self, spec: dict[str, Any], ctx: ModifyContext | None = None) -> list[Step]:
        """SpecModifier: edit ``spec`` in place; no host-side steps are needed."""
        try:
            self.modify(spec)
        except UsageError as exc:
            if ctx is not None and ctx.command == "restore":
                # At create this is the user's request; at restore it is this host that cannot
                # give the checkpointed container its GPUs.
                raise IncompatibleHostError(f"cannot restore here: {exc}") from None
            raise
        return []
