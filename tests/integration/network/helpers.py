"""Real runc containers on gpusnap networks: bundles built from the host's static busybox, a
line-protocol TCP server inside, and a client on the host that holds one connection open."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.network import set_spec_netns

BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "nc", "cat", "httpd", "sleep", "echo", "read", "ip", "ifconfig")
# One line in, one numbered line out: a duplicate, a loss or a reordering shows in the numbers,
# and the counter proves the very same process (not a fresh one) answered after a restore.
SERVER_SCRIPT = 'n=0\nwhile read line; do n=$((n+1)); echo "$n:$line"; done\n'
SERVER_CMD = "echo hello > /www/index.html; httpd -p 8080 -h /www; exec nc -ll -p 80 -e /bin/sh /srv.sh"


def runc_binary() -> str:
    return shutil.which("runc") or "/usr/sbin/runc"


def make_rootfs(root: Path) -> Path:
    rootfs = root / "rootfs"
    for d in ("bin", "proc", "sys", "dev", "tmp", "www", "etc"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
    for applet in APPLETS:
        link = rootfs / "bin" / applet
        if not link.exists():
            link.symlink_to("busybox")
    (rootfs / "srv.sh").write_text(SERVER_SCRIPT)
    return rootfs


def write_bundle(bundle: Path, netns_path: str, rootfs: Path, args: list[str] | None = None) -> Path:
    """A bundle whose config.json joins ``netns_path``; restores under a new name share ``rootfs``."""
    bundle.mkdir(parents=True, exist_ok=True)
    subprocess.run([runc_binary(), "spec"], cwd=bundle, check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = args or ["/bin/sh", "-c", SERVER_CMD]
    spec["root"] = {"path": str(rootfs), "readonly": False}
    set_spec_netns(spec, netns_path)
    (bundle / "config.json").write_text(json.dumps(spec, indent=2))
    return bundle


@dataclass
class Runc:
    """runc with a private --root so these containers never meet other helpers' ones."""

    root: Path
    criu: str = "criu"
    held_fds: list[int] = field(default_factory=list)

    def _cmd(self, *args: str) -> list[str]:
        return [runc_binary(), "--root", str(self.root), "--criu", self.criu, "--log", str(self.log), *args]

    @property
    def log(self) -> Path:
        return self.root.with_name(self.root.name + ".log")

    def _stdio(self) -> tuple[int, int, int]:
        # Pipes, not files or /dev/null: CRIU restores pipes as inherited fds, while a host
        # file has no mount inside the container for CRIU to find.
        fds = []
        for _ in range(3):
            r, w = os.pipe()
            self.held_fds += [r, w]
            fds.append((r, w))
        return fds[0][0], fds[1][1], fds[2][1]

    def _run(self, *args: str, stdio: bool = False, timeout: int = 120) -> subprocess.CompletedProcess[str]:
        if stdio:
            i, o, e = self._stdio()
            proc = subprocess.run(self._cmd(*args), stdin=i, stdout=o, stderr=e, timeout=timeout, check=False)
            out = self.log.read_text()[-2000:] if self.log.exists() else ""
        else:
            proc = subprocess.run(self._cmd(*args), capture_output=True, text=True, timeout=timeout, check=False)
            out = (proc.stderr or "") + (proc.stdout or "")
        if proc.returncode != 0:
            raise RuntimeError(f"runc {' '.join(args)} exited {proc.returncode}: {out[-3000:]}")
        return proc

    def run(self, container_id: str, bundle: Path) -> None:
        self._run("run", "-d", "--bundle", str(bundle), container_id, stdio=True)

    def checkpoint(self, container_id: str, image: Path, *, leave_running: bool) -> None:
        work = image.with_name(image.name + "-work")
        work.mkdir(parents=True, exist_ok=True)
        args = ["checkpoint", "--tcp-established", "--image-path", str(image), "--work-path", str(work)]
        if leave_running:
            args.append("--leave-running")
        try:
            self._run(*args, container_id)
        except RuntimeError as exc:
            log = work / "dump.log"
            raise RuntimeError(f"{exc}\n{log.read_text()[-4000:] if log.exists() else ''}") from None

    def restore(self, container_id: str, bundle: Path, image: Path) -> None:
        work = image.with_name(image.name + "-rwork")
        work.mkdir(parents=True, exist_ok=True)
        args = ["restore", "-d", "--tcp-established", "--image-path", str(image), "--work-path", str(work)]
        args += ["--bundle", str(bundle), container_id]
        try:
            self._run(*args, stdio=True)
        except RuntimeError as exc:
            log = work / "restore.log"
            raise RuntimeError(f"{exc}\n{log.read_text()[-4000:] if log.exists() else ''}") from None

    def state(self, container_id: str) -> str:
        proc = subprocess.run(self._cmd("state", container_id), capture_output=True, text=True, check=False)
        return json.loads(proc.stdout)["status"] if proc.returncode == 0 else "absent"

    def delete(self, container_id: str) -> None:
        subprocess.run(self._cmd("delete", "--force", container_id), capture_output=True, check=False)

    def close(self) -> None:
        for fd in self.held_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.held_fds.clear()


class LineClient:
    """One TCP connection; every ``ask`` sends a line and reads the numbered answer."""

    def __init__(self, address: str, port: int, *, timeout: float = 30.0) -> None:
        self.sock = wait_connect(address, port, timeout=timeout)
        self.sock.settimeout(timeout)
        self.buffer = b""

    def send(self, text: str) -> None:
        self.sock.sendall(text.encode() + b"\n")

    def read_line(self) -> str:
        while b"\n" not in self.buffer:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError(f"server closed the connection; got so far {self.buffer!r}")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def ask(self, text: str) -> str:
        self.send(text)
        return self.read_line()

    def close(self) -> None:
        self.sock.close()


def wait_connect(address: str, port: int, *, timeout: float = 20.0) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((address, port), timeout=2)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def http_get(address: str, port: int, *, path: str = "/index.html", timeout: float = 20.0) -> str:
    sock = wait_connect(address, port, timeout=timeout)
    with sock:
        sock.settimeout(10)
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    return data.decode(errors="replace")
