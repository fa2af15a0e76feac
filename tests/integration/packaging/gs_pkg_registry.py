"""Starts the real CNCF distribution registry (/usr/bin/docker-registry) for a test, on 127.0.0.1.

Ports come from gs-pkg's range (5100-5149); each server gets its own temp storage and config.
Auth: htpasswd with a bcrypt hash made by the ``bcrypt`` package (what the registry requires).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt
import requests

REGISTRY_BIN = "/usr/bin/docker-registry"
PORTS = range(5100, 5150)


def free_port() -> int:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 5100-5149")


@dataclass
class Registry:
    root: Path
    port: int = 0
    user: str | None = None
    password: str | None = None
    auth_yaml: str = ""  # a whole ``auth:`` section (token auth tests)
    proc: subprocess.Popen | None = None
    log: Path = field(init=False)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Registry":
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        auth = self.auth_yaml
        if self.user:
            htpasswd = self.root / "htpasswd"
            hashed = bcrypt.hashpw(self.password.encode(), bcrypt.gensalt(rounds=5)).decode()
            htpasswd.write_text(f"{self.user}:{hashed}\n")
            auth = f"auth:\n  htpasswd:\n    realm: gs-pkg\n    path: {htpasswd}\n"
        cfg = self.root / "config.yml"
        cfg.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.root / 'data'}\n  delete:\n    enabled: true\n"
            # A fixed secret keeps upload-session tokens valid across a restart (resume tests).
            f"http:\n  addr: 127.0.0.1:{self.port}\n  secret: gs-pkg-upload-secret\n"
            + auth
        )
        self.log = self.root / "registry.log"
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(cfg)], stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self._env())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                r = requests.get(f"http://{self.host}/v2/", timeout=1)
                if r.status_code in (200, 401):
                    return self
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"registry exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError("registry did not start")

    @staticmethod
    def _env() -> dict[str, str]:
        # The registry reads REGISTRY_* variables as configuration (REGISTRY_AUTH_FILE, set for
        # podman's auth.json, would become auth.file); give it none of them.
        return {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
