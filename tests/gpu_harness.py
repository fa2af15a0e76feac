"""Real runc containers running gpu_worker.py, driven through gpusnap-runtime or plain runc.

Shared by the GPU suite (tests/gpu, the CUDA driver), the CPU integration tests
(tests/integration/gpu, the driver stand-in) and bench/gpu_checkpoint.py. A container's rootfs
is an overlay whose lower layer is the host's ``/`` (so the host's Python, PyTorch and CUDA
libraries are there without an image); its stdio are pipes and its output a bind-mounted host
directory, as CRIU needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

TAG = "gs-gpu"
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
WORKER = Path(__file__).with_name("gpu_worker.py")
NVIDIA_DIR = Path("/usr/local/nvidia")
# The nodes a CUDA process opens (seen on the lent H200): control, UVM, and one per GPU.
NVIDIA_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def unique(kind: str) -> str:
    return f"{TAG}-{kind}-{uuid.uuid4().hex[:8]}"


def sh(cmd: list[str], *, check: bool = True, timeout: float = 600, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


@dataclass
class Stack:
    """How containers are run: which runtime wrapper, runc, CRIU, GPU backend and worker mode."""

    base: Path
    mode: str  # "cuda" (real GPU) or "cpu" (driver stand-in)
    gpu_backend: str  # "nvidia" | "standin:<dir>"
    shim: str
    runc: str
    tools_bin: str = ""  # a directory with criu (and runc) to put first on PATH
    pythonpath: str = ""
    wrapper: Path = field(init=False)

    def __post_init__(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.run_dir = self.base / "run"
        self.state_dir = self.base / "state"
        self.wrapper = self.base / unique("runtime")
        lines = ["#!/bin/sh", f"export PATH={self.path()}"]
        for k, v in self.gpusnap_env().items():
            lines.append(f"export {k}='{v}'")
        lines.append(f'exec {self.shim} "$@"')
        self.wrapper.write_text("\n".join(lines) + "\n")
        self.wrapper.chmod(0o755)

    def path(self) -> str:
        return f"{self.tools_bin}:{HOST_PATH}" if self.tools_bin else HOST_PATH

    def gpusnap_env(self) -> dict[str, str]:
        env = {
            "GPUSNAP_RUN_DIR": str(self.run_dir),
            "GPUSNAP_STATE_DIR": str(self.state_dir),
            "GPUSNAP_CONFIG": "/nonexistent/gpusnap.toml",
            "GPUSNAP_GPU_BACKEND": self.gpu_backend,
            "GPUSNAP_RUNC": self.runc,
        }
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        return env

    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": self.path(), **self.gpusnap_env()}

    def settings(self):  # type: ignore[no-untyped-def]
        from gpusnap.config import load_settings

        return load_settings(self.env())


class Pipes:
    """stdin/stdout/stderr of a container as pipes (CRIU restores pipes, not host files)."""

    def __init__(self) -> None:
        self.stdin_r, self.stdin_w = os.pipe()
        self.out_r, self.out_w = os.pipe()
        os.set_blocking(self.out_r, False)

    def kwargs(self) -> dict[str, int]:
        return {"stdin": self.stdin_r, "stdout": self.out_w, "stderr": self.out_w}

    def read(self) -> str:
        try:
            return os.read(self.out_r, 1 << 20).decode(errors="replace")
        except (BlockingIOError, OSError):
            return ""

    def close(self) -> None:
        for fd in (self.stdin_r, self.stdin_w, self.out_r, self.out_w):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class Run:
    rc: int
    seconds: float
    stderr: str


class Container:
    """One runc container of ``nprocs`` worker processes of ``gb`` GiB each."""

    def __init__(self, stack: Stack, *, nprocs: int = 1, gb: float = 1, via_shim: bool = True, inject: bool = False, sleep: float = 0.01, mode: str | None = None) -> None:
        self.stack = stack
        self.id = unique("ctr")
        self.nprocs, self.gb, self.via_shim, self.inject, self.sleep = nprocs, gb, via_shim, inject, sleep
        self.mode = mode or stack.mode
        self.dir = stack.base / self.id
        self.bundle = self.dir / "bundle"
        self.rootfs = self.bundle / "rootfs"
        self.data = self.dir / "data"
        self.root = self.dir / "runc-root"
        self.tokens = [f"{self.id}-p{i}" for i in range(nprocs)]
        self.pipes: list[Pipes] = []
        self.mounted = False

    # -- setup -----------------------------------------------------------------------------------
    @property
    def runtime(self) -> list[str]:
        return [str(self.stack.wrapper) if self.via_shim else self.stack.runc, "--root", str(self.root)]

    def _spec(self) -> dict:
        sh([self.stack.runc, "spec"], cwd=self.bundle)
        spec = json.loads((self.bundle / "config.json").read_text())
        env = [
            f"PATH={os.path.dirname(sys.executable)}:{HOST_PATH}",
            "HOME=/root",
            f"WORKER_MODE={self.mode}",
            f"GB={self.gb}",
            f"SLEEP={self.sleep}",
            "PYTHONUNBUFFERED=1",
        ]
        launch = " ".join(
            f"env {'GPUSNAP_STANDIN_CUDA=' + t + ' GPUSNAP_STANDIN_GPU_MB=' + str(int(self.gb * 1024)) if self.stack.mode == 'cpu' else ''} "
            f"{sys.executable} /data/gpu_worker.py /data/out{i} &"
            for i, t in enumerate(self.tokens)
        )
        spec["process"].update(terminal=False, args=["sh", "-c", launch + " wait"], env=env, cwd="/")
        spec["root"] = {"path": "rootfs", "readonly": False}
        spec["hostname"] = self.id[:63]
        spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
        spec["mounts"].append({"destination": "/data", "source": str(self.data), "type": "bind", "options": ["rbind", "rw"]})
        if self.mode in ("cuda", "managed"):
            if self.inject:
                env.append("NVIDIA_VISIBLE_DEVICES=all")
            else:
                env.append(f"LD_LIBRARY_PATH={NVIDIA_DIR / 'lib64'}")
                if NVIDIA_DIR.is_dir():
                    spec["mounts"].append({"destination": str(NVIDIA_DIR), "source": str(NVIDIA_DIR), "type": "bind", "options": ["rbind", "ro"]})
                gpus = sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))
                for node in [*NVIDIA_CONTROL_NODES, *gpus]:
                    if not os.path.exists(node):
                        continue
                    st = os.stat(node)
                    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
                    spec["linux"].setdefault("devices", []).append({"path": node, "type": "c", "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0})
                    spec["linux"].setdefault("resources", {}).setdefault("devices", []).append({"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"})
        if not self.via_shim:
            # What the shim does for its containers, done by hand: CRIU must link-remap.
            conf = self.dir / "criu.conf"
            conf.write_text("link-remap\n")
            spec.setdefault("annotations", {})["org.criu.config"] = str(conf)
        return spec

    def create_bundle(self) -> None:
        for d in (self.rootfs, self.data, self.root, self.dir / "upper", self.dir / "work"):
            d.mkdir(parents=True, exist_ok=True)
        shutil.copy(WORKER, self.data / "gpu_worker.py")
        sh(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir=/,upperdir={self.dir / 'upper'},workdir={self.dir / 'work'}", str(self.rootfs)])
        self.mounted = True
        (self.bundle / "config.json").write_text(json.dumps(self._spec(), indent=2))

    def start(self, ready_timeout: float = 180) -> "Container":
        self.create_bundle()
        self.pipes.append(Pipes())
        subprocess.run([*self.runtime, "run", "-d", "--bundle", str(self.bundle), self.id], check=True, env=self.stack.env(), timeout=120, **self.pipes[-1].kwargs())
        self.wait_ready(ready_timeout)
        return self

    # -- observation -----------------------------------------------------------------------------
    def out(self, i: int = 0) -> list[str]:
        path = self.data / f"out{i}"
        return path.read_text().splitlines() if path.exists() else []

    def lines(self, i: int = 0) -> dict[int, int]:
        res = {}
        for line in self.out(i):
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit():
                res[int(parts[0])] = int(parts[1])
        return res

    def last_step(self, i: int = 0) -> int:
        return max(self.lines(i), default=0)

    def wait_ready(self, timeout: float = 180) -> None:
        self.wait_step(10, timeout)

    def wait_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.last_step(i) >= step for i in range(self.nprocs)):
                return
            time.sleep(0.05)
        raise AssertionError(f"{self.id}: step {step} not reached in {timeout}s; last {[self.last_step(i) for i in range(self.nprocs)]}; output: {self.output()[-2000:]}")

    def output(self) -> str:
        return "".join(p.read() for p in self.pipes)

    def state(self) -> dict | None:
        proc = sh([self.stack.runc, "--root", str(self.root), "state", self.id], check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def host_pids(self) -> list[int]:
        from gpusnap.config import HostPaths
        from gpusnap.gpu.procs import container_pids

        st = self.state()
        assert st and st["status"] == "running", st
        return container_pids(HostPaths(), int(st["pid"]))

    def worker_pids(self) -> list[int]:
        """Host PIDs of the worker processes (not the shell)."""
        out = []
        for pid in self.host_pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"gpu_worker.py" in cmd and not cmd.startswith(b"sh\0"):
                out.append(pid)
        return out

    # -- operations ------------------------------------------------------------------------------
    def checkpoint(self, image: Path, *, leave_running: bool = False) -> Run:
        args = [*self.runtime, "checkpoint", "--image-path", str(image)] + (["--leave-running"] if leave_running else []) + [self.id]
        t = time.perf_counter()
        proc = subprocess.run(args, capture_output=True, text=True, env=self.stack.env(), timeout=600)
        return Run(proc.returncode, time.perf_counter() - t, proc.stderr)

    def restore(self, image: Path) -> Run:
        self.pipes.append(Pipes())
        args = [*self.runtime, "restore", "-d", "--bundle", str(self.bundle), "--image-path", str(image), self.id]
        t = time.perf_counter()
        # The restored container keeps runc's stdio: all three must be the new pipes (a
        # captured stderr would never reach EOF); the runtime's own message is read from them.
        proc = subprocess.run(args, env=self.stack.env(), timeout=600, **self.pipes[-1].kwargs())
        seconds = time.perf_counter() - t
        return Run(proc.returncode, seconds, self.pipes[-1].read() if proc.returncode else "")

    def delete(self) -> None:
        sh([self.stack.runc, "--root", str(self.root), "delete", "--force", self.id], check=False)

    def cleanup(self) -> None:
        self.delete()
        for p in self.pipes:
            p.close()
        if self.mounted:
            sh(["umount", "-l", str(self.rootfs)], check=False)
            self.mounted = False
        shutil.rmtree(self.dir, ignore_errors=True)


def reference(mode: str, gb: float, stop: int, workdir: Path, timeout: float = 600) -> dict[int, int]:
    """The worker's values at every 10th step up to ``stop``, from a fresh run on the host."""
    out = workdir / f"reference-{mode}-{gb}-{stop}"
    if not out.exists():
        tmp = out.with_suffix(".partial")
        tmp.unlink(missing_ok=True)
        env = {**os.environ, "WORKER_MODE": mode, "GB": str(gb), "STOP": str(stop), "SLEEP": "0"}
        subprocess.run([sys.executable, str(WORKER), str(tmp)], check=True, env=env, timeout=timeout)
        tmp.replace(out)
    res = {}
    for line in out.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            res[int(parts[0])] = int(parts[1])
    return res


def assert_matches(got: dict[int, int], ref: dict[int, int], *, after: int, at_least: int = 3) -> int:
    """Every step both runs reached has the same value; at least ``at_least`` of them past ``after``."""
    common = sorted(set(got) & set(ref))
    bad = [(s, got[s], ref[s]) for s in common if got[s] != ref[s]]
    assert not bad, f"values differ from the reference run at steps {bad[:5]}"
    later = [s for s in common if s > after]
    assert len(later) >= at_least, f"only {len(later)} steps past {after} to compare (reference ends at {max(ref, default=0)}, run at {max(got, default=0)})"
    return len(common)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs too small for the images: CRIU fails part-way with ENOSPC (a full disk)."""
    path.mkdir(parents=True, exist_ok=True)
    sh(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    try:
        yield path
    finally:
        sh(["umount", "-l", str(path)], check=False)
