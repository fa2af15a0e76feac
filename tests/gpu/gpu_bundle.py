"""Building and running a GPU test container through gpusnap-runtime, shared by the GPU test
(tests/gpu/test_gpu_devices.py) and its CPU-host counterpart (tests/integration/devices/).

The rootfs is an overlay whose lower layer is the host's own root (``/``): the container has
the host's Python and packages without an image. Its upper and work directories live on a tmpfs
mounted for the purpose, because overlayfs refuses an upper directory inside its lower layer's
filesystem. Directories the overlay does not show (other mounts, e.g. a separately mounted venv)
are bind-mounted read-only.

Parameters, all from the environment (defaults in brackets):
  GPUSNAP_GPU_TOOLS     a folder with runc (and criu) in it or in its bin/ (tests/../gpu-probe/make-tools.sh) [runc on PATH]
  GPUSNAP_GPU_PYTHON    the interpreter that has torch [/opt/torch/.venv/bin/python3]
  GPUSNAP_GPU_LOWER     the overlay's lower layer [/]
  GPUSNAP_RUNTIME       gpusnap-runtime to test [beside this Python, else on PATH]
  GPUSNAP_HOOK          gpusnap-hook for the container's hooks [beside gpusnap-runtime]
  GPUSNAP_GPU_TIMEOUT   seconds the container may run [300]
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Runs inside the container: CUDA must be there, and a float64 matmul on the GPU must agree with
# the CPU's (float64 so TF32 or reduced-precision paths cannot blur the comparison).
TORCH_PROBE = r"""
import json, os, torch
out = {"available": torch.cuda.is_available(), "ld_library_path": os.environ.get("LD_LIBRARY_PATH", "")}
if out["available"]:
    torch.manual_seed(0)
    a = torch.randn(512, 512, dtype=torch.float64)
    b = torch.randn(512, 512, dtype=torch.float64)
    gpu = (a.cuda() @ b.cuda()).cpu()
    cpu = a @ b
    out.update(count=torch.cuda.device_count(), name=torch.cuda.get_device_name(0),
               max_abs_diff=(gpu - cpu).abs().max().item(), max_abs=cpu.abs().max().item())
print("RESULT " + json.dumps(out), flush=True)
"""


def _tools_dir() -> Path | None:
    d = os.environ.get("GPUSNAP_GPU_TOOLS")
    return Path(d) if d else None


def find_tool(name: str) -> str | None:
    tools = _tools_dir()
    if tools is not None:
        for cand in (tools / "bin" / name, tools / name):
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + HOST_PATH)


def find_runtime() -> str | None:
    if os.environ.get("GPUSNAP_RUNTIME"):
        return os.environ["GPUSNAP_RUNTIME"]
    beside = Path(sys.executable).parent / "gpusnap-runtime"
    return str(beside) if beside.is_file() else shutil.which("gpusnap-runtime")


def find_hook(runtime: str) -> str:
    return os.environ.get("GPUSNAP_HOOK") or str(Path(runtime).parent / "gpusnap-hook")


def tool_path_env() -> str:
    """PATH with the tools folder first (runc finds criu on PATH)."""
    tools = _tools_dir()
    first = [str(tools / "bin"), str(tools)] if tools is not None else []
    return ":".join([*first, HOST_PATH])


@contextlib.contextmanager
def overlay_rootfs(work: Path, lower: str = "/") -> Iterator[Path]:
    """An overlay of ``lower`` with its writable layer on a private tmpfs; unmounted afterwards."""
    scratch, merged = work / "scratch", work / "merged"
    scratch.mkdir(parents=True)
    merged.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=0755", "gs-dev-gpu-scratch", str(scratch)], check=True)
    try:
        (scratch / "upper").mkdir()
        (scratch / "work").mkdir()
        opts = f"lowerdir={lower},upperdir={scratch / 'upper'},workdir={scratch / 'work'}"
        subprocess.run(["mount", "-t", "overlay", "-o", opts, "gs-dev-gpu-root", str(merged)], check=True)
        try:
            yield merged
        finally:
            subprocess.run(["umount", "-l", str(merged)], check=False)
    finally:
        subprocess.run(["umount", "-l", str(scratch)], check=False)


def python_dirs(python: str) -> list[str]:
    """The folders ``python`` needs (its venv and base installation), as absolute host paths."""
    out = subprocess.run([python, "-c", "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix]))"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    dirs = [str(Path(p).resolve()) for p in json.loads(out)]
    dirs.append(str(Path(python).resolve().parent))
    return sorted(set(dirs))


def make_bundle(work: Path, rootfs: Path, args: list[str], env: list[str], *, runc: str, need_dirs: list[str] = ()) -> Path:
    """A bundle over ``rootfs`` running ``args``: host network (no netns), pipes for stdio,
    and read-only binds for any of ``need_dirs`` the rootfs does not show."""
    bundle = work / "bundle"
    bundle.mkdir()
    subprocess.run([runc, "spec"], cwd=bundle, check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"] = {"path": str(rootfs), "readonly": False}
    spec["process"]["terminal"] = False
    spec["process"]["args"] = args
    spec["process"]["env"] = [f"PATH={HOST_PATH}", "HOME=/root", *env]
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
    spec["hostname"] = "gs-dev-gpu"
    for d in need_dirs:
        seen = rootfs / d.lstrip("/")
        if not (seen.is_dir() and any(seen.iterdir())):  # absent, or an empty mountpoint in the lower layer
            spec["mounts"].append({"destination": d, "type": "bind", "source": d, "options": ["rbind", "ro"]})
    (bundle / "config.json").write_text(json.dumps(spec, indent=2))
    return bundle


def run_through_shim(runtime: str, runc_root: Path, bundle: Path, cid: str, env: Mapping[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``gpusnap-runtime run`` in the foreground; the container is deleted afterwards."""
    try:
        return subprocess.run([runtime, "--root", str(runc_root), "run", "--bundle", str(bundle), cid],
                              env=dict(env), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False)
    finally:
        subprocess.run([runtime, "--root", str(runc_root), "delete", "-f", cid], env=dict(env), capture_output=True, check=False)


def result_line(stdout: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"the container printed no RESULT line; its output:\n{stdout}")
