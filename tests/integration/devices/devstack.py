"""Helpers for the device-injection integration tests: a fake NVIDIA host tree behind a shim
wrapper, a busybox bundle, and a probe that reports what a container sees."""

from __future__ import annotations

import functools
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from fake_gpu_tree import FakeGpuTree, make_nvidia_tree
from stack import proc
from stack.proc import etc_lock, run, wait_for  # noqa: F401 (the tests import them from here)
from stack.shim import BIN, DOCKER, DOCKER_IMAGE, HOOK, PODMAN_IMAGE, RUNC, SHIM, Shim  # noqa: F401
from stack.shim import busybox_bundle as make_bundle  # noqa: F401 (base, args, env)

TAG = "gs-dev"
STABLE = "/usr/local/gpusnap/driver/"

# What the container reports: its NVIDIA nodes (hex major/minor as busybox stat prints them),
# the driver mounts with their options, each library's content, and its init process's
# environment (exec'd processes get the engine's env, not config.json's).
PROBE = (
    "for f in $(busybox find /dev -name 'nvidia*' -type c); do busybox stat -c 'NODE %n %t %T %a' $f; done; "
    "busybox awk '$5 ~ /^\\/usr\\/local\\/gpusnap\\// {print \"MOUNT\", $5, $6}' /proc/self/mountinfo; "
    "for f in /usr/local/gpusnap/driver/lib/*; do [ -e \"$f\" ] && echo \"LIB $f $(busybox cat $f)\"; done; "
    "busybox tr '\\0' '\\n' < /proc/1/environ | busybox sed 's/^/ENV /'"
)


unique = functools.partial(proc.unique, TAG)


@dataclass
class View:
    nodes: dict[str, tuple[int, int, int]]  # path -> (major, minor, mode)
    mounts: dict[str, str]  # destination -> mount options
    libs: dict[str, str]  # path -> content
    env: dict[str, str]


def parse_probe(out: str) -> View:
    view = View({}, {}, {}, {})
    for line in out.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "NODE":
            path, major, minor, mode = rest.split()
            view.nodes[path] = (int(major, 16), int(minor, 16), int(mode, 8))
        elif kind == "MOUNT":
            dest, opts = rest.split()
            view.mounts[dest] = opts
        elif kind == "LIB":
            path, _, content = rest.partition(" ")
            view.libs[path] = content
        elif kind == "ENV":
            k, _, v = rest.partition("=")
            view.env[k] = v
    return view


def expected_nodes(tree: FakeGpuTree, gpus: list[int] | None) -> dict[str, tuple[int, int, int]]:
    """The fake tree's nodes as the container must see them (all GPUs when ``gpus`` is None)."""
    out: dict[str, tuple[int, int, int]] = {}
    for p in sorted(tree.path("/dev").rglob("nvidia*")):
        st = os.stat(p)
        if not stat.S_ISCHR(st.st_mode):
            continue
        rel = "/" + str(p.relative_to(tree.root))
        name = p.name
        if name.startswith("nvidia") and name[6:].isdigit() and gpus is not None and int(name[6:]) not in gpus:
            continue
        out[rel] = (os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode))
    return out


def expected_libs(tree: FakeGpuTree) -> dict[str, str]:
    """Every file of the driver's library folder, by its name in the container, with its content
    (the folder is mounted whole at the stable path)."""
    assert tree.lib_dir is not None
    return {f"{STABLE}lib/{p.name}": p.resolve().read_text().strip() for p in sorted(tree.lib_dir.iterdir())}


def expected_mounts() -> set[str]:
    return {f"{STABLE}lib", f"{STABLE}bin/nvidia-smi"}


@dataclass
class GpuShim(Shim):
    """A shim pointed at a fake GPU host tree (GPUSNAP_ROOT), with gpusnap-hook for its hooks."""

    tree: FakeGpuTree = field(kw_only=True)

    def records(self) -> dict[str, dict]:
        d = self.state_dir / "gpus"
        return {p.stem: json.loads(p.read_text()) for p in d.glob("*.json")} if d.is_dir() else {}


def make_gpu_shim(base: Path, name: str | None = None, host: str = "host", **tree_kwargs: object) -> GpuShim:
    """``tree_kwargs`` go to make_nvidia_tree (driver_version, uvm_major, ...)."""
    base.mkdir(parents=True, exist_ok=True)
    tree = make_nvidia_tree(base / host, **tree_kwargs)  # type: ignore[arg-type]
    return GpuShim.at(base, name or unique(f"runtime-{host}"), {"GPUSNAP_ROOT": str(tree.root), "GPUSNAP_HOOK": str(HOOK)}, tree=tree)
