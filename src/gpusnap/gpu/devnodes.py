"""Keeping a restored container's GPU device nodes true to the host it is restored on.

runc puts a container's ``/dev`` on a tmpfs; CRIU dumps that tmpfs as a tar
(``tmpfs-dev-<id>.tar.gz.img``) and at restore unpacks it as it was, device numbers included.
The NVIDIA UVM major (and the nvidia-caps major) is assigned when the module loads, so on another
host, or after a module reload, the restored ``/dev/nvidia-uvm`` would name a device that the
container's cgroup rules (refreshed from the current host at restore) do not allow, or that is
another driver altogether. Before ``runc restore``, :func:`retarget_step` rewrites those nodes
in the image to the numbers of the refreshed spec's ``linux.devices``; its undo puts the original
image files back.

The same step makes a restore onto *other* GPUs possible: CRIU's /dev image lists the GPU nodes
the container had at checkpoint time (``/dev/nvidia0``), and the runtime's own nodes for the
restore are never created (CRIU unpacks /dev instead). A container restored onto GPU 1 needs
``/dev/nvidia1`` (the CUDA driver opens a GPU by its minor number), so per-GPU nodes
(``/dev/nvidiaN``) the refreshed spec does not give are dropped from the image and those it
gives that the image lacks are added, with the spec's numbers, mode and owner. The container's
device cgroup comes from the refreshed spec at restore, so it allows exactly those nodes.

Device numbers of open files are not touched: with the CUDA driver's checkpoint API no
``/dev/nvidia*`` descriptor is open at dump time.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusnap.errors import RestoreError
from gpusnap.steps import Step

_GPU_PREFIXES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/")
_PER_GPU_NODE = re.compile(r"nvidia[0-9]+")  # tar names of NVIDIA's per-GPU nodes


@dataclass
class Retargeted:
    """One GPU node of a /dev image changed: renumbered, added (``old`` None) or dropped (``new`` None)."""

    image: Path
    path: str  # the node's path in the container
    old: tuple[int, int] | None
    new: tuple[int, int] | None


@dataclass(frozen=True)
class _Node:
    major: int
    minor: int
    mode: int
    uid: int
    gid: int


def _wanted(devices: list[dict[str, Any]]) -> dict[str, _Node]:
    """Container-relative tar names ("nvidia-uvm") -> the spec's node, GPU char devices only."""
    out: dict[str, _Node] = {}
    for d in devices:
        path = str(d.get("path", ""))
        if d.get("type", "c") == "c" and path.startswith(_GPU_PREFIXES):
            mode = d.get("fileMode")
            out[path[len("/dev/"):]] = _Node(int(d["major"]), int(d["minor"]), 0o666 if mode is None else int(mode) & 0o7777, int(d.get("uid") or 0), int(d.get("gid") or 0))
    return out


def _name(m: tarfile.TarInfo) -> str:
    return m.name[2:] if m.name.startswith("./") else m.name


def _plan(members: list[tarfile.TarInfo], wanted: dict[str, _Node], image: Path) -> list[Retargeted]:
    changes: list[Retargeted] = []
    have: set[str] = set()
    for m in members:
        name = _name(m)
        if not m.ischr():
            continue
        have.add(name)
        if name in wanted:
            new = (wanted[name].major, wanted[name].minor)
            if (m.devmajor, m.devminor) != new:
                changes.append(Retargeted(image, "/dev/" + name, (m.devmajor, m.devminor), new))
        elif _PER_GPU_NODE.fullmatch(name):
            changes.append(Retargeted(image, "/dev/" + name, (m.devmajor, m.devminor), None))
    # CRIU writes one such image per tmpfs mount (/dev, /dev/shm, ...): nodes are added only to
    # the one that holds GPU nodes already, /dev's.
    is_dev = any(n in wanted or _PER_GPU_NODE.fullmatch(n) for n in have)
    for name, node in sorted(wanted.items()):
        # Only per-GPU nodes are added: the rest (control, UVM) every NVIDIA container has had
        # since it was created, and a node the checkpoint never had is no GPU it was on.
        if is_dev and name not in have and _PER_GPU_NODE.fullmatch(name):
            changes.append(Retargeted(image, "/dev/" + name, None, (node.major, node.minor)))
    return changes


def _rewrite(data: bytes, wanted: dict[str, _Node], image: Path) -> tuple[bytes, list[Retargeted]]:
    src = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
    members = src.getmembers()
    changes = _plan(members, wanted, image)
    if not changes:
        return data, []
    if any(m.issparse() for m in members):
        raise RestoreError(f"{image}: the /dev image holds sparse files gpusnap cannot rewrite; restore on a host with the same device numbers")
    dropped = {c.path[len("/dev/"):] for c in changes if c.new is None}
    added = [c.path[len("/dev/"):] for c in changes if c.old is None]
    out = io.BytesIO()
    # The same tar dialect CRIU's tar wrote (GNU), so its tar --extract reads it back as before.
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as dst:
        for m in members:
            name = _name(m)
            if m.ischr() and name in dropped:
                continue
            if m.ischr() and name in wanted:
                m.devmajor, m.devminor = wanted[name].major, wanted[name].minor
            dst.addfile(m, src.extractfile(m) if m.isreg() else None)
        for name in added:  # /dev/nvidiaN: directly in /dev
            node = wanted[name]
            info = tarfile.TarInfo(f"./{name}")
            info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, node.major, node.minor
            info.mode, info.uid, info.gid = node.mode, node.uid, node.gid
            dst.addfile(info)
    return out.getvalue(), changes


def retarget_dev_images(image_dir: Path, devices: list[dict[str, Any]]) -> tuple[list[Retargeted], dict[Path, bytes]]:
    """Make the GPU device nodes in every ``tmpfs-dev-*.tar.gz.img`` of ``image_dir`` those of
    ``devices`` (a spec's ``linux.devices``): renumbered, added, per-GPU nodes it lacks dropped.
    Returns what changed and the original bytes of each rewritten file (for undo)."""
    wanted = _wanted(devices)
    if not wanted:
        return [], {}
    changes: list[Retargeted] = []
    originals: dict[Path, bytes] = {}
    for image in sorted(image_dir.glob("tmpfs-dev-*.tar.gz.img")):
        data = image.read_bytes()
        try:
            new, changed = _rewrite(data, wanted, image)
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise RestoreError(f"{image}: not a readable CRIU tmpfs image ({exc}); the checkpoint is damaged") from None
        if not changed:
            continue
        originals[image] = data
        tmp = image.with_name(f".{image.name}.gpusnap-tmp")
        tmp.write_bytes(new)
        os.chmod(tmp, stat.S_IMODE(image.stat().st_mode))
        tmp.replace(image)
        changes.extend(changed)
    return changes, originals


def retarget_step(image_dir: Path, spec: dict[str, Any]) -> Step:
    """The restore step (before ``runc restore``, after the spec modifiers refreshed ``spec``)."""
    originals: dict[Path, bytes] = {}

    def do() -> list[Retargeted]:
        changes, saved = retarget_dev_images(image_dir, (spec.get("linux") or {}).get("devices") or [])
        originals.update(saved)
        return changes

    def undo() -> None:
        for image, data in originals.items():
            image.write_bytes(data)

    return Step(f"retarget GPU device nodes in {image_dir}", do, undo)
