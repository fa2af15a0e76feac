"""The real CNCF distribution registry (/usr/bin/docker-registry) for the reliability suite, on
127.0.0.1 in this area's port range (5360-5399); it can be killed (-9) and restarted on the
same port and storage, which is what the fault tests do to it."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import requests

REGISTRY_BIN = "/usr/bin/docker-registry"
PORTS = range(5360, 5400)


def free_port() -> int:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 5360-5399")


@dataclass
class Registry:
    root: Path
    port: int = 0
    proc: subprocess.Popen | None = None  # type: ignore[type-arg]

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Registry":
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        cfg = self.root / "config.yml"
        cfg.write_text(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\n"
            "http:\n  addr: 127.0.0.1:%d\n" % (self.root / "data", self.port)
        )
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://{self.host}/v2/", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                time.sleep(0.05)
        raise RuntimeError("docker-registry did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def has_tag(self, repo: str, tag: str) -> bool:
        r = requests.get(f"http://{self.host}/v2/{repo}/manifests/{tag}", timeout=10,
                         headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
        return r.status_code == 200
