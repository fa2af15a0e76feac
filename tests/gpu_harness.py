"""Real runc containers running gpu_worker.py, driven through gpusnap-runtime or plain runc.

Shared by the GPU suite (tests/gpu, the CUDA driver), the CPU integration tests
(tests/integration/gpu, the driver stand-in) and bench/gpu_checkpoint.py. A container's rootfs
is an overlay whose lower layer is the host's ``/`` (so the host's Python, PyTorch and CUDA
libraries are there without an image); its stdio are pipes and its output a bind-mounted host
directory, as CRIU needs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stack import proc
from stack.proc import HOST_PATH
from stack.shim import NO_CONFIG, SHIM, Pipes, write_wrapper

TAG = "gs-gpu"
WORKER = Path(__file__).with_name("gpu_worker.py")
NVIDIA_DIR = Path("/usr/local/nvidia")
# The nodes a CUDA process opens (seen on the lent H200): control, UVM, and one per GPU.
NVIDIA_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
MULTI_GPU_GB = 4  # GiB on each GPU in the GPU suite's two-GPU container

unique = functools.partial(proc.unique, TAG)
sh = functools.partial(proc.run, timeout=600)


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
        self.wrapper = write_wrapper(self.base / unique("runtime"), self.gpusnap_env(), shim=self.shim, search_path=self.path())

    def path(self) -> str:
        return f"{self.tools_bin}:{HOST_PATH}" if self.tools_bin else HOST_PATH

    def gpusnap_env(self) -> dict[str, str]:
        env = {
            "GPUSNAP_RUN_DIR": str(self.run_dir),
            "GPUSNAP_STATE_DIR": str(self.state_dir),
            "GPUSNAP_CONFIG": NO_CONFIG,
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


def standin_stack(tmp_path: Path, tools_bin: str = "") -> Stack:
    """CPU containers through gpusnap-runtime (beside this Python) and the host's runc, with the
    driver stand-in (its state in ``tmp_path/standin``) as the GPU backend."""
    return Stack(base=tmp_path / "stack", mode="cpu", gpu_backend=f"standin:{tmp_path / 'standin'}", shim=str(SHIM),
                 runc=shutil.which("runc") or "runc", tools_bin=tools_bin)


def standin_backend(stack: Stack):  # type: ignore[no-untyped-def]
    """The stand-in backend ``stack``'s runtime talks to (the test reads and scripts its state)."""
    from gpusnap.gpu.standin import StandinBackend

    return StandinBackend(Path(stack.gpu_backend.split(":", 1)[1]))


@dataclass
class Run:
    rc: int
    seconds: float
    stderr: str


class Container:
    """One runc container of ``nprocs`` worker processes of ``gb`` GiB each (on each of ``gpus``
    GPUs). With ``inject`` the GPUs come from gpusnap-runtime's injection, selected by
    NVIDIA_VISIBLE_DEVICES=``visible``; otherwise the bundle lists every GPU node itself."""

    def __init__(
        self, stack: Stack, *, nprocs: int = 1, gb: float = 1, via_shim: bool = True, inject: bool = False, sleep: float = 0.01,
        mode: str | None = None, gpus: int = 1, visible: str = "all", env: dict[str, str] | None = None,
    ) -> None:
        self.stack = stack
        self.id = unique("ctr")
        self.nprocs, self.gb, self.via_shim, self.inject, self.sleep = nprocs, gb, via_shim, inject, sleep
        self.gpus, self.visible = gpus, visible
        self.mode = mode or stack.mode
        self.extra_env = dict(env or {})  # more of the worker's environment (LOADER_START=spawn)
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
        if self.gpus != 1:
            env.append(f"WORKER_GPUS={self.gpus}")
        env.extend(f"{k}={v}" for k, v in self.extra_env.items())
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
        if self.mode in ("cuda", "managed", "loader", "compiled"):
            if self.inject:
                env.append(f"NVIDIA_VISIBLE_DEVICES={self.visible}")
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

    def select_gpus(self, visible: str) -> None:
        """Give the container other GPUs for its next restore: NVIDIA_VISIBLE_DEVICES in the
        bundle's config.json, which gpusnap-runtime's injection reads again at restore."""
        path = self.bundle / "config.json"
        spec = json.loads(path.read_text())
        env = [e for e in spec["process"]["env"] if not e.startswith("NVIDIA_VISIBLE_DEVICES=")]
        spec["process"]["env"] = [*env, f"NVIDIA_VISIBLE_DEVICES={visible}"]
        path.write_text(json.dumps(spec, indent=2))
        self.visible = visible

    def gpu_nodes(self) -> list[str]:
        """The per-GPU device nodes (/dev/nvidiaN) the bundle's spec gives now."""
        spec = json.loads((self.bundle / "config.json").read_text())
        return sorted(d["path"] for d in spec["linux"].get("devices", []) if d["path"][len("/dev/nvidia"):].isdigit() and d["path"].startswith("/dev/nvidia"))

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


def host_gpus() -> list[tuple[int, str]]:
    """(NVML index, UUID) of this host's GPUs, from nvidia-smi; empty without one."""
    if not shutil.which("nvidia-smi"):
        return []
    proc = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True)
    out = []
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            out.append((int(parts[0]), parts[1]))
    return out


def reference(mode: str, gb: float, stop: int, workdir: Path, timeout: float = 600, gpus: int = 1) -> dict[int, int]:
    """The worker's values at every 10th step up to ``stop``, from a fresh run on the host."""
    out = workdir / (f"reference-{mode}-{gb}-{stop}" + (f"-{gpus}gpus" if gpus != 1 else ""))
    if not out.exists():
        tmp = out.with_name(out.name + ".partial")
        tmp.unlink(missing_ok=True)
        env = {**os.environ, "WORKER_MODE": mode, "GB": str(gb), "STOP": str(stop), "SLEEP": "0", "WORKER_GPUS": str(gpus)}
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
