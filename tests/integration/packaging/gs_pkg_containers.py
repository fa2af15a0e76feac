"""Real containers for the packaging tests: runc bundles and podman containers, named gs-pkg-*.

runc containers get their own ``--root`` (no clash with other suites) and pipes for stdio
(CRIU cannot dump a container whose stdout is a host file). Counters write to a file inside the
container so the test reads progress from the host without holding any fd of the container.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

BUSYBOX = "/bin/busybox"
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /count.tmp; mv /count.tmp /count; sleep 0.2; done"


def run(*args: str, check: bool = True, timeout: int = 120, **kw: object) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return p


def busybox_rootfs(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    for d in ("proc", "sys", "dev", "tmp", "etc"):
        (path / d).mkdir()
    shutil.copy2(BUSYBOX, path / "bin" / "busybox")
    for a in ("sh", "sleep", "cat", "echo", "mv"):
        os.symlink("busybox", path / "bin" / a)
    return path


@dataclass
class RuncContainer:
    workdir: Path
    rootfs: Path
    args: list[str]
    name: str = field(default_factory=lambda: f"gs-pkg-{uuid.uuid4().hex[:8]}")
    criu_conf: str | None = None
    _pipes: list = field(default_factory=list)

    @property
    def bundle(self) -> Path:
        return self.workdir / "bundle"

    @property
    def root(self) -> Path:
        return self.workdir / "runc-root"

    def runc(self, *args: str, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
        return run("runc", "--root", str(self.root), *args, check=check, timeout=timeout)

    def create_bundle(self) -> None:
        self.bundle.mkdir(parents=True, exist_ok=True)
        run("runc", "spec", cwd=str(self.bundle))
        cfg = json.loads((self.bundle / "config.json").read_text())
        cfg["process"]["terminal"] = False
        cfg["process"]["args"] = self.args
        cfg["root"] = {"path": str(self.rootfs), "readonly": False}
        cfg["hostname"] = self.name
        # Lower rlimits than runc's default: the hard nofile limit of these hosts is 20000.
        cfg["process"]["rlimits"] = [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
        if self.criu_conf:
            conf = self.workdir / "criu.conf"
            conf.write_text(self.criu_conf)
            cfg.setdefault("annotations", {})["org.criu.config"] = str(conf)
        (self.bundle / "config.json").write_text(json.dumps(cfg, indent=1))

    def start(self) -> None:
        self.create_bundle()
        self._run_detached("run", "-d", "--bundle", str(self.bundle), self.name)

    def _run_detached(self, *args: str) -> None:
        # Pipes for all of stdio; runc -d returns once the container runs and it keeps the pipes.
        p = subprocess.Popen(["runc", "--root", str(self.root), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        # Not communicate(): the container keeps the write ends, so EOF never comes while it runs.
        rc = p.wait(timeout=300)
        if rc != 0:
            err = p.stderr.read() if p.stderr else b""
            raise AssertionError(f"runc {' '.join(args)} failed: {err.decode(errors='replace')[-2000:]}")
        self._pipes.append(p)

    def checkpoint(self, image_dir: Path, *, leave_running: bool = False) -> None:
        args = ["checkpoint", "--image-path", str(image_dir), "--work-path", str(self.workdir / f"work-{image_dir.name}")]
        if leave_running:
            args.append("--leave-running")
        self.runc(*args, self.name)

    def restore(self, image_dir: Path) -> None:
        self._run_detached("restore", "-d", "--image-path", str(image_dir), "--work-path", str(self.workdir / "work-restore"),
                           "--bundle", str(self.bundle), self.name)

    def status(self) -> str:
        p = self.runc("state", self.name, check=False)
        return json.loads(p.stdout)["status"] if p.returncode == 0 else "absent"

    def count(self, path: str = "count") -> int:
        try:
            return int((self.rootfs / path).read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def wait_count(self, at_least: int, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            c = self.count()
            if c >= at_least:
                return c
            time.sleep(0.1)
        raise AssertionError(f"counter stuck at {self.count()} (wanted {at_least})")

    def destroy(self) -> None:
        if self.status() != "absent":
            self.runc("kill", self.name, "KILL", check=False)
            for _ in range(50):
                if self.status() in ("stopped", "absent"):
                    break
                time.sleep(0.1)
            self.runc("delete", "--force", self.name, check=False)
        for p in self._pipes:
            for f in (p.stdin, p.stdout, p.stderr):
                if f:
                    f.close()
        self._pipes.clear()


def files_of(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def podman(*args: str, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    # runc: crun refuses this host's hybrid cgroup setup, and runc is what checkpoints here.
    return run("podman", "--runtime", "runc", *args, check=check, timeout=timeout)


def podman_count(name: str) -> int:
    p = podman("exec", name, "cat", "/count", check=False)
    try:
        return int(p.stdout.strip())
    except ValueError:
        return 0


def podman_wait_count(name: str, at_least: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = podman_count(name)
        if c >= at_least:
            return c
        time.sleep(0.2)
    raise AssertionError(f"podman counter stuck at {podman_count(name)} (wanted {at_least})")
