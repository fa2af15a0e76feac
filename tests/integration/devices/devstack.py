"""Helpers for the device-injection integration tests: a fake NVIDIA host tree behind a shim
wrapper, a busybox bundle, and a probe that reports what a container sees."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fake_gpu_tree import FakeGpuTree, make_nvidia_tree

TAG = "gs-dev"
BIN = Path(sys.executable).parent
SHIM = BIN / "gpusnap-runtime"
HOOK = BIN / "gpusnap-hook"
RUNC = shutil.which("runc", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin") or "/usr/sbin/runc"
DOCKER = "/usr/bin/docker"
PODMAN_IMAGE = "localhost/gpusnap-busybox:latest"
DOCKER_IMAGE = "gpusnap-busybox:latest"
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STABLE = "/usr/local/gpusnap/driver/"
ETC_LOCK = "/run/gpusnap-etc.lock"

# What the container reports: its NVIDIA nodes (hex major/minor as busybox stat prints them),
# the driver mounts with their options, each library's content, and its init process's
# environment (exec'd processes get the engine's env, not config.json's).
PROBE = (
    "for f in $(busybox find /dev -name 'nvidia*' -type c); do busybox stat -c 'NODE %n %t %T %a' $f; done; "
    "busybox awk '$5 ~ /^\\/usr\\/local\\/gpusnap\\// {print \"MOUNT\", $5, $6}' /proc/self/mountinfo; "
    "for f in /usr/local/gpusnap/driver/lib/*; do [ -e \"$f\" ] && echo \"LIB $f $(busybox cat $f)\"; done; "
    "busybox tr '\\0' '\\n' < /proc/1/environ | busybox sed 's/^/ENV /'"
)


def unique(kind: str) -> str:
    return f"{TAG}-{kind}-{uuid.uuid4().hex[:8]}"


def run(cmd: list[str], *, check: bool = True, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


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
class GpuShim:
    """A wrapper that points gpusnap-runtime at a fake GPU host tree (engines drop our env)."""

    wrapper: Path
    run_dir: Path
    state_dir: Path
    tree: FakeGpuTree

    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": HOST_PATH, **self.settings_env()}

    def settings_env(self) -> dict[str, str]:
        return {"GPUSNAP_ROOT": str(self.tree.root), "GPUSNAP_RUN_DIR": str(self.run_dir), "GPUSNAP_STATE_DIR": str(self.state_dir),
                "GPUSNAP_HOOK": str(HOOK), "GPUSNAP_CONFIG": "/nonexistent/gpusnap.toml"}

    def records(self) -> dict[str, dict]:
        d = self.state_dir / "gpus"
        return {p.stem: json.loads(p.read_text()) for p in d.glob("*.json")} if d.is_dir() else {}


def make_gpu_shim(base: Path, name: str | None = None, host: str = "host", **tree_kwargs: object) -> GpuShim:
    """``tree_kwargs`` go to make_nvidia_tree (driver_version, uvm_major, ...)."""
    base.mkdir(parents=True, exist_ok=True)
    tree = make_nvidia_tree(base / host, **tree_kwargs)  # type: ignore[arg-type]
    shim = GpuShim(base / (name or unique(f"runtime-{host}")), base / "run", base / "state", tree)
    exports = " ".join(f"{k}={v}" for k, v in shim.settings_env().items())
    shim.wrapper.write_text(f"#!/bin/sh\nexport PATH={HOST_PATH}\nexport {exports}\nexec {SHIM} \"$@\"\n")
    shim.wrapper.chmod(0o755)
    return shim


@dataclass
class Bundle:
    path: Path
    root: Path  # runc --root of this test

    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())


def make_bundle(base: Path, args: list[str], env: list[str]) -> Bundle:
    bundle = base / "bundle"
    (bundle / "rootfs/bin").mkdir(parents=True)
    for d in ("proc", "sys", "dev", "tmp"):
        (bundle / "rootfs" / d).mkdir()
    shutil.copy2("/bin/busybox", bundle / "rootfs/bin/busybox")
    (bundle / "rootfs/bin/sh").symlink_to("busybox")
    run([RUNC, "spec"], cwd=bundle)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = args
    spec["process"]["env"] += env
    spec["root"]["readonly"] = False
    (bundle / "config.json").write_text(json.dumps(spec, indent=2))
    root = base / "runc-root"
    root.mkdir()
    return Bundle(bundle, root)


@contextlib.contextmanager
def etc_lock() -> Iterator[None]:
    with open(ETC_LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
