"""Can this host take a GPU checkpoint? Checked against gpusnap.json before anything changes.

The answer is either an :class:`IncompatibleHostError` naming what differs, or the GPU UUID
pairs to hand to the driver's restore: empty when every checkpointed GPU is restored onto itself,
otherwise one pair for *every* checkpointed GPU (identity pairs included), because the driver
refuses a pair list that leaves out a GPU the process was checkpointed on.

``targets`` are the GPUs the restored container is given (the UUIDs its restore spec was
injected with, in its selection's order); without them any GPU of this host may take the state.
"""

from __future__ import annotations

import re
from collections import defaultdict

from gpusnap.errors import IncompatibleHostError
from gpusnap.gpu.base import GpuStatus
from gpusnap.metadata import CheckpointMetadata, GpuInfo


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def needed_memory(meta: CheckpointMetadata) -> dict[str, int]:
    """Checkpointed GPU UUID -> device memory its processes held."""
    need: dict[str, int] = defaultdict(int)
    for p in meta.processes:
        if p.gpu_memory_by_uuid:
            for u, n in p.gpu_memory_by_uuid.items():
                need[u] += n
        elif len(p.gpu_uuids) == 1:
            need[p.gpu_uuids[0]] += p.gpu_memory_bytes
        else:
            # NVML gave one total across several GPUs: count it against each, to stay safe.
            for u in p.gpu_uuids:
                need[u] += p.gpu_memory_bytes
    return dict(need)


def check_host(meta: CheckpointMetadata, host: list[GpuStatus], supports_remap: bool, targets: list[str] | None = None) -> dict[str, str]:
    """Refuse (IncompatibleHostError) unless ``host`` can restore ``meta``'s GPU state; return the
    UUID pairs (old -> new) for the driver, empty when no GPU changes."""
    if not meta.processes:
        return {}
    wanted: list[GpuInfo] = meta.gpus
    if not wanted:
        raise IncompatibleHostError("the checkpoint holds GPU processes but records no GPUs; it cannot be restored safely")
    if not host:
        raise IncompatibleHostError(
            f"the checkpoint needs {len(wanted)} GPU(s) ({wanted[0].name}) but this host has none usable; restore on a GPU host"
        )
    host_driver = host[0].info.driver_version
    ckpt_driver = max((g.driver_version for g in wanted), key=_version_tuple, default="")
    if ckpt_driver and _version_tuple(host_driver) < _version_tuple(ckpt_driver):
        raise IncompatibleHostError(
            f"this host's NVIDIA driver {host_driver} is older than the checkpoint's {ckpt_driver}; upgrade the driver to >= {ckpt_driver}"
        )
    by_uuid = {s.info.uuid: s for s in host}
    candidates = host if targets is None else _given(host, by_uuid, targets)
    need = needed_memory(meta)
    remap: dict[str, str] = {}
    taken: set[str] = set()
    # Same UUID first (no remap), then any free GPU of the same model, in order (index order,
    # or the order the restored container's GPUs were asked for).
    for g in wanted:
        if any(s.info.uuid == g.uuid and s.info.name == g.name for s in candidates):
            remap[g.uuid] = g.uuid
            taken.add(g.uuid)
    for g in wanted:
        if g.uuid in remap:
            continue
        choice = next((s for s in candidates if s.info.name == g.name and s.info.uuid not in taken and not s.mig_enabled), None)
        if choice is None:
            have = ", ".join(f"{n}x {m}" for m, n in _count(candidates).items())
            want = ", ".join(f"{n}x {m}" for m, n in _count_infos(wanted).items())
            where = "this host has" if targets is None else "the restored container is given"
            fix = "restore on a host with the same GPU model and count" if targets is None else "give it as many GPUs of that model (gpusnap.io/gpus or NVIDIA_VISIBLE_DEVICES)"
            raise IncompatibleHostError(f"the checkpoint needs {want} but {where} {have or 'no GPUs'}; {fix}")
        remap[g.uuid] = choice.info.uuid
        taken.add(choice.info.uuid)
    for old, new in remap.items():
        status = by_uuid[new]
        if status.mig_enabled:
            raise IncompatibleHostError(f"GPU {new} has MIG mode on; the checkpoint API cannot restore into MIG instances; turn MIG off")
        if need.get(old, 0) > status.memory_free_bytes:
            raise IncompatibleHostError(
                f"GPU {new} has {_gib(status.memory_free_bytes)} free but the checkpoint needs {_gib(need[old])} there; free GPU memory and retry"
            )
    moved = {o: n for o, n in remap.items() if o != n}
    if moved and not supports_remap:
        raise IncompatibleHostError(
            "the checkpoint's GPUs are not the ones given here and this driver cannot remap GPUs on restore; use driver >= 580 or the same GPUs"
        )
    return remap if moved else {}


def _given(host: list[GpuStatus], by_uuid: dict[str, GpuStatus], targets: list[str]) -> list[GpuStatus]:
    """The host GPUs named by ``targets``, in that order."""
    out: list[GpuStatus] = []
    for u in targets:
        if u not in by_uuid:
            have = ", ".join(s.info.uuid for s in host) or "none"
            raise IncompatibleHostError(f"the restored container is given GPU {u}, which this host's driver does not list (GPUs: {have}); fix its GPU selection")
        if by_uuid[u] not in out:
            out.append(by_uuid[u])
    return out


def pairs_for(remap: dict[str, str], gpu_uuids: list[str]) -> dict[str, str] | None:
    """The pairs for one process: those of the GPUs it was checkpointed on (every one of them,
    as the driver requires), or None when none of its GPUs moves (a plain restore)."""
    if not remap:
        return None
    if not gpu_uuids:
        return dict(remap)  # the backend could not tell which GPUs it used: all of them
    own = {u: remap.get(u, u) for u in gpu_uuids}
    return own if any(o != n for o, n in own.items()) else None


def _count(host: list[GpuStatus]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for s in host:
        out[s.info.name] += 1
    return dict(out)


def _count_infos(gpus: list[GpuInfo]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for g in gpus:
        out[g.name] += 1
    return dict(out)
