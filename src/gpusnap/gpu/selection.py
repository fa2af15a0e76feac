"""Which GPUs a container asked for, read from its config.json.

First match wins: the annotation ``gpusnap.io/gpus``, then ``GPUSNAP_VISIBLE_DEVICES``, then
``NVIDIA_VISIBLE_DEVICES`` / ``AMD_VISIBLE_DEVICES`` in ``process.env``. Values follow the
NVIDIA Container Toolkit's meaning so images built for it behave the same:

- ``all``: every GPU of the vendor;
- ``none``: no GPU device nodes, but the driver's control nodes, libraries and tools (so
  ``nvidia-smi`` works and the container can be checkpointed like a GPU one);
- ``void`` or empty: as if nothing was asked — the spec is left untouched;
- a comma list of indexes (``0,2``) and/or UUIDs (``GPU-…``).

A spec whose GPUs another tool already injected whole — through CDI (``podman --device
nvidia.com/gpu=all``: device nodes, the driver's libraries and the toolkit's hooks) or by the NVIDIA
Container Toolkit's runtime or hook — is left as it is so nothing is injected twice. Device nodes
alone are not such an injection: a Kubernetes device plugin (or ``--device /dev/nvidia0``) hands
over the nodes and leaves the driver's libraries to the runtime, as the toolkit's runtime supplies
them. Such a spec gets the rest from gpusnap (libraries, control nodes, hooks; the nodes it has
are not doubled) for the GPUs whose nodes it was given. Given GPU nodes decide alone which GPUs
the container has: they come from whoever may hand out GPUs (the kubelet), while the request is
the pod author's; so this also holds where requests in the environment are ignored
(``gpu_request_env = false``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.errors import UsageError
from gpusnap.gpu.discovery import GpuIdentity, Inventory

ANNOTATION = "gpusnap.io/gpus"
ASSIGNED_ANNOTATION = "gpusnap.io/assigned-gpus"  # written by the injection: the UUIDs given, in order
VENDOR_ANNOTATION = "gpusnap.io/gpu-vendor"
ENV_GPUSNAP = "GPUSNAP_VISIBLE_DEVICES"
ENV_NVIDIA = "NVIDIA_VISIBLE_DEVICES"
ENV_AMD = "AMD_VISIBLE_DEVICES"

# Hooks that mean another tool already injects NVIDIA devices into this container (the legacy
# runtime hook, and the hooks NVIDIA's CDI specs carry).
_TOOLKIT_HOOK_MARKERS = ("nvidia-container-runtime-hook", "nvidia-container-toolkit", "nvidia-ctk", "nvidia-cdi-hook")
NODES_SOURCE = "device nodes in the spec"
GPU_NODE_PREFIX = "/dev/nvidia"  # /dev/nvidia<N>; gpusnap.ocispec.modifiers has the same (a unit test keeps them in step)


@dataclass(frozen=True)
class GpuRequest:
    source: str  # "annotation gpusnap.io/gpus", "env NVIDIA_VISIBLE_DEVICES", ...
    value: str
    vendor: str  # "nvidia" | "amd" | "any"


@dataclass
class Selection:
    """The outcome for one container."""

    request: GpuRequest
    vendor: str  # "nvidia" | "amd"
    gpus: list[GpuIdentity] = field(default_factory=list)  # empty with "none"

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self.gpus]


def _env(spec: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in (spec.get("process") or {}).get("env") or []:
        key, _, value = str(item).partition("=")
        env[key] = value  # later entries win, as in execve's environment lookup by libc
    return env


def find_request(spec: dict[str, Any], *, from_env: bool = True) -> GpuRequest | None:
    """The first GPU request in precedence order, or None when the container asks for none.

    ``from_env=False`` (the admin's ``gpu_request_env = false``) ignores requests in the
    container's environment, which on a shared node its author sets freely (CUDA images even
    carry NVIDIA_VISIBLE_DEVICES=all), as the NVIDIA toolkit's
    accept-nvidia-visible-devices-envvar-when-unprivileged=false does."""
    annotations = spec.get("annotations") or {}
    if ANNOTATION in annotations:
        return GpuRequest(f"annotation {ANNOTATION}", str(annotations[ANNOTATION]).strip(), "any")
    if not from_env:
        return None
    env = _env(spec)
    for var, vendor in ((ENV_GPUSNAP, "any"), (ENV_NVIDIA, "nvidia"), (ENV_AMD, "amd")):
        if var in env:
            return GpuRequest(f"env {var}", env[var].strip(), vendor)
    return None


def already_injected(spec: dict[str, Any]) -> str | None:
    """Why the spec's GPUs were already injected whole by another tool (CDI or the NVIDIA
    toolkit: their hooks, or the driver's libcuda mounted into the container), or None."""
    for stage, hooks in (spec.get("hooks") or {}).items():
        for hook in hooks or []:
            text = " ".join([str(hook.get("path", "")), *map(str, hook.get("args") or [])])
            if any(m in text for m in _TOOLKIT_HOOK_MARKERS):
                return f"the NVIDIA Container Toolkit's {stage} hook is already in the spec"
    for mount in spec.get("mounts") or []:
        dest = str(mount.get("destination", ""))
        if dest.rsplit("/", 1)[-1].startswith("libcuda.so"):
            return f"the spec already mounts the driver's {dest} (CDI or another GPU runtime put it there)"
    return None


def given_gpu_minors(spec: dict[str, Any]) -> set[int]:
    """Minor numbers of the NVIDIA GPU nodes (/dev/nvidia<N>) the spec already has."""
    minors: set[int] = set()
    for dev in (spec.get("linux") or {}).get("devices") or []:
        name = str(dev.get("path", ""))
        if name.startswith(GPU_NODE_PREFIX) and name[len(GPU_NODE_PREFIX):].isdigit():
            minor = dev.get("minor")
            minors.add(int(minor) if isinstance(minor, int) else int(name[len(GPU_NODE_PREFIX):]))
    return minors


def _from_given_nodes(spec: dict[str, Any], inventory: Inventory) -> Selection | None:
    """The GPUs whose nodes the spec was given (a device plugin's), whatever it asks for."""
    minors = given_gpu_minors(spec)
    if not minors or not inventory.nvidia.present:
        return None
    gpus = [g for g in inventory.nvidia.gpus if (g.minor if g.minor >= 0 else g.index) in minors]
    if not gpus:
        return None
    return Selection(GpuRequest(NODES_SOURCE, ",".join(g.uuid for g in gpus), "nvidia"), "nvidia", gpus)


def _resolve_items(items: list[str], gpus: list[GpuIdentity], request: GpuRequest) -> list[GpuIdentity]:
    by_uuid = {g.uuid.lower(): g for g in gpus}
    by_index = {g.index: g for g in gpus}
    chosen: list[GpuIdentity] = []
    for item in items:
        g = by_index.get(int(item)) if item.isdigit() else by_uuid.get(item.lower())
        if g is None:
            have = ", ".join(f"{x.index} ({x.uuid})" for x in gpus) or "none"
            raise UsageError(
                f"{request.source}={request.value!r}: no GPU {item!r} on this host; GPUs here: {have}"
            )
        if g not in chosen:
            chosen.append(g)
    return chosen


def select(spec: dict[str, Any], inventory: Inventory, *, from_env: bool = True) -> Selection | None:
    """The GPUs to inject for ``spec``, or None when nothing is to be injected.

    GPU nodes the spec was given (a device plugin's) decide alone: the driver is completed for
    exactly those GPUs, whatever the request says (the pod's author writes the request; the
    kubelet hands out the nodes).

    Raises UsageError for indexes or UUIDs this host does not have, or a request this host
    cannot serve at all (no driver of that vendor).
    """
    given = _from_given_nodes(spec, inventory)
    if given is not None:
        return given
    request = find_request(spec, from_env=from_env)
    if request is None or request.value in ("", "void"):
        return None
    vendor = request.vendor
    if vendor == "any":
        vendor = "nvidia" if inventory.nvidia.present or not inventory.amd.present else "amd"
    present = inventory.nvidia.present if vendor == "nvidia" else inventory.amd.present
    gpus = inventory.nvidia.gpus if vendor == "nvidia" else [a.gpu for a in inventory.amd.gpus]
    if request.value == "none":
        if not present:
            return None  # CPU-only images often say NVIDIA_VISIBLE_DEVICES=none: nothing to do
        return Selection(request, vendor, [])
    if not present:
        raise UsageError(
            f"{request.source}={request.value!r} asks for {vendor.upper()} GPUs but this host has no "
            f"{vendor.upper()} driver nodes; unset it or run on a GPU host"
        )
    if request.value == "all":
        return Selection(request, vendor, list(gpus))
    items = [i.strip() for i in request.value.split(",")]
    if any(not i for i in items):
        raise UsageError(f"{request.source}={request.value!r}: empty item in the list; use e.g. 0,1 or GPU-<uuid>")
    return Selection(request, vendor, _resolve_items(items, gpus, request))


def assigned_gpus(annotations: dict[str, str]) -> list[str] | None:
    """The NVIDIA GPU UUIDs gpusnap's injection gave a spec (its annotation), in selection order;
    None when the spec's GPUs came from elsewhere (CDI, hand-written devices) or are AMD's."""
    if ASSIGNED_ANNOTATION not in annotations or annotations.get(VENDOR_ANNOTATION, "nvidia") != "nvidia":
        return None
    return [u for u in (x.strip() for x in annotations[ASSIGNED_ANNOTATION].split(",")) if u]


def state_path(state_dir: Path, container_id: str) -> Path:
    """Where the hooks record a container's GPU assignment."""
    return state_dir / "gpus" / f"{container_id}.json"
