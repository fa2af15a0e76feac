"""Keeping a restored container's GPU device nodes true to the host it is restored on.

runc puts a container's ``/dev`` on a tmpfs; CRIU dumps that tmpfs as a tar
(``tmpfs-dev-<id>.tar.gz.img``) and at restore unpacks it as it was, device numbers included.
The NVIDIA UVM major (and the nvidia-caps major) is assigned when the module loads, so on another
host, or after a module reload, the restored ``/dev/nvidia-uvm`` would name a device that the
container's cgroup rules (refreshed from the current host at restore) do not allow, or that is
another driver altogether. Before ``runc restore``, :func:`retarget_step` rewrites those nodes
in the image to the numbers of the refreshed spec's ``linux.devices``; its undo puts the original
image files back.

Device numbers of open files are not touched: with the CUDA driver's checkpoint API no
``/dev/nvidia*`` descriptor is open at dump time.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusnap.errors import RestoreError
from gpusnap.steps import Step

_GPU_PREFIXES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/")


@dataclass
class Retargeted:
    image: Path
    path: str  # the node's path in the container
    old: tuple[int, int]
    new: tuple[int, int]


def _wanted(devices: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """Container-relative tar names ("nvidia-uvm") -> (major, minor), GPU char devices only."""
    out: dict[str, tuple[int, int]] = {}
    for d in devices:
        path = str(d.get("path", ""))
        if d.get("type", "c") == "c" and path.startswith(_GPU_PREFIXES):
            out[path[len("/dev/"):]] = (int(d["major"]), int(d["minor"]))
    return out


def _rewrite(data: bytes, wanted: dict[str, tuple[int, int]], image: Path) -> tuple[bytes, list[Retargeted]]:
    changes: list[Retargeted] = []
    src = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
    members = src.getmembers()
    for m in members:
        name = m.name[2:] if m.name.startswith("./") else m.name
        if m.ischr() and name in wanted and (m.devmajor, m.devminor) != wanted[name]:
            changes.append(Retargeted(image, "/dev/" + name, (m.devmajor, m.devminor), wanted[name]))
    if not changes:
        return data, []
    if any(m.issparse() for m in members):
        raise RestoreError(f"{image}: the /dev image holds sparse files gpusnap cannot rewrite; restore on a host with the same device numbers")
    out = io.BytesIO()
    # The same tar dialect CRIU's tar wrote (GNU), so its tar --extract reads it back as before.
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as dst:
        for m in members:
            name = m.name[2:] if m.name.startswith("./") else m.name
            if m.ischr() and name in wanted:
                m.devmajor, m.devminor = wanted[name]
            dst.addfile(m, src.extractfile(m) if m.isreg() else None)
    return out.getvalue(), changes


def retarget_dev_images(image_dir: Path, devices: list[dict[str, Any]]) -> tuple[list[Retargeted], dict[Path, bytes]]:
    """Rewrite GPU device nodes in every ``tmpfs-dev-*.tar.gz.img`` of ``image_dir`` to the
    numbers in ``devices`` (a spec's ``linux.devices``). Returns what changed and the original
    bytes of each rewritten file (for undo)."""
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
