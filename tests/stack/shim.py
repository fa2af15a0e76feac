"""gpusnap-runtime as the engines see it in tests: a wrapper script with the test's settings,
busybox bundles for runc, and pipes for a container's stdio.

Engines (dockerd above all) do not pass a test's environment on to the runtime they run, so a
test's GPUSNAP_* settings travel in the script the engine is told to run (:func:`write_wrapper`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from stack.proc import HOST_PATH, run

BIN = Path(sys.executable).parent
SHIM = BIN / "gpusnap-runtime"
HOOK = BIN / "gpusnap-hook"
RUNC = shutil.which("runc", path=HOST_PATH) or "/usr/sbin/runc"
DOCKER = "/usr/bin/docker"  # Debian's client; another one sits earlier on PATH on these hosts
PODMAN_IMAGE = "localhost/gpusnap-busybox:latest"
DOCKER_IMAGE = "gpusnap-busybox:latest"
NO_CONFIG = "/nonexistent/gpusnap.toml"  # no config file: defaults and GPUSNAP_* variables only
BUSYBOX_APPLETS = ("sh", "sleep", "echo", "cat", "true", "false")


def write_wrapper(path: Path, env: Mapping[str, str], *, shim: str | Path = SHIM, search_path: str = HOST_PATH) -> Path:
    """An executable script at ``path`` that exports PATH=``search_path`` and ``env`` and execs ``shim``."""
    lines = ["#!/bin/sh", f"export PATH={shlex.quote(search_path)}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(f'exec {shlex.quote(str(shim))} "$@"')
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


@dataclass
class Shim:
    """gpusnap-runtime behind a wrapper with this test's run and state directories, no config
    file, and ``extra`` GPUSNAP_* settings."""

    wrapper: Path
    run_dir: Path
    state_dir: Path
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def at(cls, base: Path, name: str, extra: Mapping[str, str] | None = None, **fields: Any) -> Self:
        """A shim whose wrapper is ``base/name`` and whose directories are ``base/run`` and ``base/state``."""
        base.mkdir(parents=True, exist_ok=True)
        shim = cls(base / name, base / "run", base / "state", dict(extra or {}), **fields)
        write_wrapper(shim.wrapper, shim.settings_env())
        return shim

    def settings_env(self) -> dict[str, str]:
        return {"GPUSNAP_RUN_DIR": str(self.run_dir), "GPUSNAP_STATE_DIR": str(self.state_dir), "GPUSNAP_CONFIG": NO_CONFIG, **self.extra}

    def env(self) -> dict[str, str]:
        """The environment to run gpusnap itself (or the shim directly) with the same settings."""
        return {**os.environ, "PATH": HOST_PATH, **self.settings_env()}


@dataclass
class Bundle:
    path: Path
    root: Path  # runc --root: this test's own state directory
    data: Path | None = None  # bind-mounted at /data

    def config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())


def busybox_bundle(base: Path, args: list[str], env: Sequence[str] = (), data: Path | None = None) -> Bundle:
    """A runc bundle at ``base/bundle``: a static busybox rootfs (with BUSYBOX_APPLETS linked),
    ``args`` as its process, ``env`` added to runc's default environment, ``data`` (if given)
    bind-mounted read-write at /data; its runc --root is ``base/runc-root``."""
    bundle = base / "bundle"
    bin_dir = bundle / "rootfs" / "bin"
    bin_dir.mkdir(parents=True)
    for d in ("proc", "sys", "dev", "tmp", *(("data",) if data is not None else ())):
        (bundle / "rootfs" / d).mkdir()
    shutil.copy2("/bin/busybox", bin_dir / "busybox")
    for applet in BUSYBOX_APPLETS:
        (bin_dir / applet).symlink_to("busybox")
    run([RUNC, "spec"], cwd=bundle)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = args
    spec["process"]["env"] += list(env)
    spec["root"]["readonly"] = False
    if data is not None:
        spec["mounts"].append({"destination": "/data", "source": str(data), "type": "bind", "options": ["rbind", "rw"]})
    (bundle / "config.json").write_text(json.dumps(spec, indent=2))
    root = base / "runc-root"
    root.mkdir()
    return Bundle(bundle, root, data)


class Pipes:
    """Pipes for a container's stdio: CRIU restores pipes (not host files), which runc
    reconnects through its inherit-fd at restore."""

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
