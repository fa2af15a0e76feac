"""Spec modifiers: small units that each change config.json for one concern.

The shim runs the chain at ``create``, ``run`` and ``restore`` (a restore from docker/containerd
never passes through ``create``), so every modifier must be idempotent: applied to its own
output it changes nothing. A modifier edits the spec it is given and returns the host-side
steps its edit relies on (files to write, each with its undo); the shim runs those steps only
once the modified spec has passed validation, and undoes them if anything later fails.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from gpusnap.config import Settings
from gpusnap.criu.config import (
    CRIU_CONFIG_ANNOTATION,
    MANAGED_ANNOTATION,
    check_annotations,
    check_user_criu_config,
    criu_config_path,
    host_options,
    options_from_annotations,
    write_config,
)
from gpusnap.steps import Step

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every create pays for imports
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, Protocol

# What gpusnap.gpu.selection.find_request looks for (a unit test keeps the two in step), and the
# annotation an earlier pass of GpuInjection leaves: checked here so that a container that asks
# for no GPUs never imports the GPU modules (about 6 ms, more with discovery).
GPU_REQUEST_ANNOTATION = "gpusnap.io/gpus"
GPU_REQUEST_ENV = ("GPUSNAP_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "AMD_VISIBLE_DEVICES")
GPU_INJECTED_ANNOTATION = "gpusnap.io/assigned-gpus"
GPU_VENDOR_ANNOTATION = "gpusnap.io/gpu-vendor"
GPU_NODE_PREFIX = "/dev/nvidia"  # /dev/nvidia<N>: a GPU node (gpusnap.gpu.selection.given_gpu_minors)


@dataclass(frozen=True)
class ModifyContext:
    """What a modifier may know of the call beside the spec itself."""

    container_id: str
    bundle: Path
    command: str  # create | run | restore
    settings: Settings


if TYPE_CHECKING:

    class SpecModifier(Protocol):
        name: str

        def apply(self, spec: dict[str, Any], ctx: ModifyContext) -> list[Step]:
            """Edit ``spec`` in place; return the host-side steps the edit needs."""


@dataclass
class ChainResult:
    """The modified spec and the host-side steps its edits rely on."""

    spec: dict[str, Any]
    steps: list[Step]


def apply_chain(spec: dict[str, Any], chain: Sequence[SpecModifier], ctx: ModifyContext) -> ChainResult:
    """Apply ``chain`` in order to a copy of ``spec``; ``spec`` itself is left untouched."""
    out = copy.deepcopy(spec)
    steps: list[Step] = []
    for modifier in chain:
        steps.extend(modifier.apply(out, ctx))
    return ChainResult(out, steps)


class CriuConfigModifier:
    """Points ``org.criu.config`` at a per-container file: the CRIU options this container may
    request (allow-listed, typed) followed by the options of this host's own configuration.

    It is also the gate for every ``gpusnap.io/`` annotation (gpusnap.criu.config.check_annotations):
    a value the container may not set is refused here, at create or restore, before anything
    is written.
    """

    name = "criu-config"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def apply(self, spec: dict[str, Any], ctx: ModifyContext) -> list[Step]:
        annotations = spec.setdefault("annotations", {})
        if not has_gpu_request(spec, from_env=self.settings.gpu_request_env) and not has_given_gpu_nodes(spec):
            # Written by GpuInjection for the GPUs it gave; without a request or given GPU nodes
            # there were none, so these came from elsewhere: the GPU plan must not pair a
            # restore with them.
            for key in (GPU_INJECTED_ANNOTATION, GPU_VENDOR_ANNOTATION, "gpusnap.io/criu-libdir"):
                annotations.pop(key, None)
        check_annotations(annotations)
        current = annotations.get(CRIU_CONFIG_ANNOTATION)
        if current is not None and annotations.get(MANAGED_ANNOTATION) != "true":
            check_user_criu_config(current)  # only an admin's file: it can set any CRIU option
            return []
        path = criu_config_path(self.settings.run_dir, ctx.container_id)
        annotations[CRIU_CONFIG_ANNOTATION] = str(path)
        annotations[MANAGED_ANNOTATION] = "true"
        options = options_from_annotations(annotations)
        # The host's last: for an option given twice CRIU keeps the later line, so the admin wins.
        options += [o for o in host_options(self.settings.criu_options, self.settings.host.root,
                                            gpu_vendor=annotations.get(GPU_VENDOR_ANNOTATION, "")) if o not in options]
        previous = path.read_bytes() if path.is_file() else None

        def undo() -> None:
            if previous is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(previous)

        return [Step(f"write CRIU config {path}", lambda: write_config(path, options), undo)]


def has_gpu_request(spec: dict[str, Any], *, from_env: bool = True) -> bool:
    """Whether the container asks for GPUs (what gpusnap.gpu.selection.find_request reads)."""
    if GPU_REQUEST_ANNOTATION in (spec.get("annotations") or {}):
        return True
    if not from_env:
        return False
    env = (spec.get("process") or {}).get("env") or []
    return any(str(item).partition("=")[0] in GPU_REQUEST_ENV for item in env)


def has_given_gpu_nodes(spec: dict[str, Any]) -> bool:
    """Whether the spec came with NVIDIA GPU nodes (/dev/nvidia<N>: a device plugin's, or
    --device), which gpusnap.gpu.selection completes with the driver."""
    for dev in (spec.get("linux") or {}).get("devices") or []:
        path = str(dev.get("path", ""))
        if path.startswith(GPU_NODE_PREFIX) and path[len(GPU_NODE_PREFIX):].isdigit():
            return True
    return False


def asks_for_gpus(spec: dict[str, Any], *, from_env: bool = True) -> bool:
    """Whether the GPU modifier has anything to do: a GPU request, given GPU nodes, or an
    earlier injection."""
    return (GPU_INJECTED_ANNOTATION in (spec.get("annotations") or {}) or has_gpu_request(spec, from_env=from_env)
            or has_given_gpu_nodes(spec))


class LazyGpuInjection:
    """gpusnap.ocispec.gpu_modifiers.GpuInjection, imported only for specs that ask for GPUs."""

    name = "gpu-devices"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def apply(self, spec: dict[str, Any], ctx: ModifyContext) -> list[Step]:
        if not asks_for_gpus(spec, from_env=self.settings.gpu_request_env):
            return []
        from gpusnap.ocispec.gpu_modifiers import GpuInjection

        return GpuInjection(self.settings).apply(spec, ctx)


def default_chain(settings: Settings) -> list[SpecModifier]:
    """The modifiers every container gets, in order (device modifiers join this list)."""
    return [
        LazyGpuInjection(settings),  # before criu-config: it adds CRIU options (AMD plugin libdir)
        CriuConfigModifier(settings),
    ]
