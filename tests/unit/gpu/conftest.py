"""Fixtures for the GPU orchestration tests: real processes that the driver stand-in treats as CUDA processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the fake GPU tree helper (devices)

from gpusnap.config import Settings
from gpusnap.gpu.base import ContainerRef, ProcessGpuState
from gpusnap.gpu.standin import MEM_ENV, TOKEN_ENV, StandinBackend


@dataclass
class FakeContainer:
    """A few real processes; some carry the stand-in's CUDA marker in their environment."""

    backend: StandinBackend
    procs: list[subprocess.Popen] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    inits: list[int] = field(default_factory=list)

    def spawn(self, cuda: bool = True, mem_mb: int = 100, token: str | None = None, **env: str) -> int:
        """Start a process; with ``token`` it is the same stand-in CUDA process come back (as after a restore)."""
        e = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
        if cuda:
            tok = token or f"gs-gpu-{uuid.uuid4().hex[:10]}"
            e[TOKEN_ENV] = tok
            e[MEM_ENV] = str(mem_mb)
            self.tokens.append(tok)
        p = subprocess.Popen(["sleep", "600"], env=e)
        self.procs.append(p)
        # Popen returns as exec begins; the new environ appears in /proc a moment later.
        deadline = time.monotonic() + 10
        while "PATH=" not in _env(p.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        return p.pid

    def start_container(self, n_cuda: int = 2, tokens: list[str] | None = None, mem_mb: int = 100, **env: str) -> int:
        """A real PID namespace (``unshare -pf``) whose init is a shell with one plain and
        ``n_cuda`` stand-in CUDA children; returns the host PID of its init. The same ``tokens``
        give the same processes at the same PIDs inside, as a CRIU restore does."""
        if os.geteuid() != 0:
            pytest.skip("a PID namespace (unshare --pid) needs root; CI runs tests/run.sh as root")
        tokens = tokens or [f"gs-gpu-{uuid.uuid4().hex[:10]}" for _ in range(n_cuda)]
        self.tokens.extend(t for t in tokens if t not in self.tokens)
        extra = " ".join(f"{k}={v}" for k, v in env.items())
        kids = ["sleep 600 &"] + [f"env {TOKEN_ENV}={t} {MEM_ENV}={mem_mb} {extra} sleep 600 &" for t in tokens]
        p = subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c", " ".join(kids) + " wait"], env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        self.procs.append(p)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            kids_file = Path(f"/proc/{p.pid}/task/{p.pid}/children")
            init = kids_file.read_text().split() if kids_file.exists() else []
            if init:
                inner = Path(f"/proc/{init[0]}/task/{init[0]}/children")
                kids_now = inner.read_text().split() if inner.exists() else []
                if (
                    len(kids_now) == n_cuda + 1
                    and all("sleep" in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace") for k in kids_now)
                    and sum(TOKEN_ENV in _env(int(k)) for k in kids_now) == n_cuda
                ):
                    self.inits.append(int(init[0]))
                    return int(init[0])
            time.sleep(0.02)
        raise RuntimeError("the test container did not start")

    def container_ref(self, init: int) -> ContainerRef:
        return ContainerRef(container_id="gs-gpu-fake", init_pid=init, bundle=Path("/nonexistent"))

    def stop_container(self, init: int) -> None:
        """Kill it like runc checkpoint does without --leave-running (the whole PID namespace)."""
        os.kill(init, 9)
        for p in self.procs:
            if p.poll() is None and Path(f"/proc/{p.pid}/task/{p.pid}/children").exists():
                kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
                if str(init) in kids:
                    p.wait(timeout=10)

    def pids_in(self, init: int) -> list[int]:
        from gpusnap.config import HostPaths
        from gpusnap.gpu.procs import container_pids

        return container_pids(HostPaths(), init)

    def is_cuda(self, pid: int) -> bool:
        return TOKEN_ENV in _env(pid)

    def ns_states(self, init: int) -> list[ProcessGpuState]:
        from gpusnap.config import HostPaths
        from gpusnap.gpu.procs import container_pids

        return [self.backend.state(p) for p in container_pids(HostPaths(), init) if TOKEN_ENV in _env(p)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def cuda_pids(self) -> list[int]:
        return [p.pid for p in self.procs if TOKEN_ENV in _env(p.pid)]

    def ref(self) -> ContainerRef:
        return ContainerRef(container_id="gs-gpu-fake", init_pid=self.pids[0], bundle=Path("/nonexistent"), cgroup_procs=self.pids)

    def states(self) -> list[ProcessGpuState]:
        return [self.backend.state(pid) for pid in self.cuda_pids]

    def calls(self) -> list[str]:
        log = self.backend.state_dir / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def illegal_calls(self) -> list[str]:
        return [c for c in self.calls() if "ILLEGAL" in c]


def _env(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture
def standin(tmp_path: Path) -> StandinBackend:
    return StandinBackend(tmp_path / "standin")


@pytest.fixture
def settings(tmp_path: Path, standin: StandinBackend) -> Settings:
    return Settings(run_dir=tmp_path / "run", state_dir=tmp_path / "state", gpu_backend=f"standin:{standin.state_dir}", lock_timeout_ms=50)


@pytest.fixture
def fake(standin: StandinBackend) -> Iterator[FakeContainer]:
    c = FakeContainer(standin)
    yield c
    for init in c.inits:
        try:
            os.kill(init, 9)  # ends its whole PID namespace
        except ProcessLookupError:
            pass
    for p in c.procs:
        p.kill()
        p.wait()
