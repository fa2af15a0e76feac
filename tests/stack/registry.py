"""The real CNCF distribution registry (/usr/bin/docker-registry) for a test, on 127.0.0.1.

Each server gets its own storage, config and log under ``root``, and a port from its suite's
range (the ``*_PORTS`` below; suites run side by side never pick the same port). It can be
killed (-9) and started again on the same port and storage, which is what the resume and fault
tests do to it; a fixed HTTP secret keeps upload sessions valid across such a restart.
Auth (optional): htpasswd with a bcrypt hash (what the registry requires), or a whole
``auth:`` section (token auth).

    with Registry(tmp_path / "registry", PKG_PORTS) as reg:
        push(..., f"{reg.host}/repo:tag")
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

# GPUSNAP_REGISTRY_BIN, else Debian's, else one on PATH (the GPU machine has none installed:
# tests/gpu/stage.sh carries it).
REGISTRY_BIN = os.environ.get("GPUSNAP_REGISTRY_BIN") or (
    "/usr/bin/docker-registry" if os.path.exists("/usr/bin/docker-registry") else shutil.which("docker-registry") or "docker-registry")
PKG_PORTS = range(5100, 5150)  # tests/integration/packaging
CLI_PORTS = range(5200, 5250)  # tests/integration/cli
REL_PORTS = range(5360, 5400)  # tests/integration/reliability


def free_port(ports: range) -> int:
    """The first port of ``ports`` nothing listens on."""
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")


@dataclass
class Registry:
    root: Path
    ports: range
    port: int = 0  # picked from ``ports`` at the first start, kept across restarts
    user: str | None = None
    password: str | None = None
    auth_yaml: str = ""  # a whole ``auth:`` section (token auth tests)
    log_level: str = "warn"  # "info" logs every request (tests that check what was fetched)
    binary: str = ""  # another registry program speaking the same config (bench/e2e.py --ab-registry); default REGISTRY_BIN
    proc: subprocess.Popen | None = None  # type: ignore[type-arg]
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.root / "registry.log"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Registry":
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.ports)
        auth = self.auth_yaml
        if self.user:
            import bcrypt

            htpasswd = self.root / "htpasswd"
            hashed = bcrypt.hashpw((self.password or "").encode(), bcrypt.gensalt(rounds=5)).decode()
            htpasswd.write_text(f"{self.user}:{hashed}\n")
            auth = f"auth:\n  htpasswd:\n    realm: gpusnap-tests\n    path: {htpasswd}\n"
        cfg = self.root / "config.yml"
        cfg.write_text(
            "version: 0.1\n"
            f"log:\n  level: {self.log_level}\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.root / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n  secret: gpusnap-tests-upload-secret\n"
            + auth
        )
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([self.binary or REGISTRY_BIN, "serve", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=self._env())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://{self.host}/v2/", timeout=1).status_code in (200, 401):
                    return self
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"{self.binary or REGISTRY_BIN} exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{self.binary or REGISTRY_BIN} did not answer on {self.host} within 20 s: {self.log.read_text()[-2000:]}")

    @staticmethod
    def _env() -> dict[str, str]:
        # The registry reads REGISTRY_* variables as configuration (REGISTRY_AUTH_FILE, set for
        # podman's auth.json, would become auth.file); give it none of them.
        return {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}

    def kill(self) -> None:
        """kill -9 (the server and anything it started); ``start()`` brings it back on the same port."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> "Registry":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def has_tag(self, repo: str, tag: str) -> bool:
        r = requests.get(f"http://{self.host}/v2/{repo}/manifests/{tag}", timeout=10,
                         headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
        return r.status_code == 200
