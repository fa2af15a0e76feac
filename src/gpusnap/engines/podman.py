"""Podman through its own command line.

Podman's checkpoint/restore already does everything an engine must (stops the container, keeps
its database right, exports config + CRIU images as one archive), so gpusnap only drives
``podman container checkpoint --export`` and ``podman container restore --import``. The CLI is
used rather than the REST socket because the socket service is not running on most hosts.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpusnap.engines.base import (
    FORM_PODMAN_ARCHIVE,
    CheckpointOptions,
    ContainerInfo,
    EngineBase,
    EngineCheckpoint,
    RestoreOptions,
    find_executable,
    refusal_error,
    runtime_refusal,
)
from gpusnap.errors import CheckpointError, MissingDependencyError, NotFoundError, RestoreError

NAME = "podman"


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    # podman prints "Error: ..." last; that is the line that says what went wrong.
    errs = [ln for ln in lines if ln.startswith("Error:")]
    return (errs[-1] if errs else (lines[-1] if lines else "no output")).removeprefix("Error: ")


@dataclass
class PodmanEngine(EngineBase):
    binary: str = "podman"
    name: str = NAME
    form: str = FORM_PODMAN_ARCHIVE

    def _run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        exe = find_executable(self.binary, hint="install podman (apt-get install podman) or pick another --engine")
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, check=False)

    def require(self) -> None:
        proc = self._run("version", "--format", "{{.Client.Version}}", timeout=30)
        if proc.returncode != 0:
            raise MissingDependencyError(f"podman does not work: {_first_line(proc.stderr)}; run `podman info` to see why")

    def version(self) -> str:
        proc = self._run("version", "--format", "{{.Client.Version}}", timeout=30)
        return proc.stdout.strip()

    def _info(self, data: dict) -> ContainerInfo:
        state = data.get("State", {})
        cmd = [data.get("Path", "")] + list(data.get("Args") or [])
        return ContainerInfo(
            id=data["Id"],
            name=data.get("Name", "").lstrip("/"),
            engine=self.name,
            image=data.get("ImageName", "") or data.get("Image", ""),
            status=str(state.get("Status", "")).lower(),
            pid=int(state.get("Pid") or 0),
            created=str(data.get("Created", "")),
            command=[c for c in cmd if c],
            labels=dict((data.get("Config") or {}).get("Labels") or {}),
        )

    def get(self, ref: str) -> ContainerInfo | None:
        self.require()
        proc = self._run("container", "inspect", "--format", "json", ref, timeout=60)
        if proc.returncode != 0:
            if "no such container" in proc.stderr.lower():
                return None
            raise MissingDependencyError(f"podman could not inspect {ref}: {_first_line(proc.stderr)}")
        items = json.loads(proc.stdout or "[]")
        return self._info(items[0]) if items else None

    def list(self) -> list[ContainerInfo]:
        self.require()
        proc = self._run("ps", "-a", "-q", "--no-trunc", timeout=60)
        ids = proc.stdout.split()
        if not ids:
            return []
        proc = self._run("container", "inspect", "--format", "json", *ids, timeout=60)
        return [self._info(d) for d in json.loads(proc.stdout or "[]")]

    def checkpoint(self, container: ContainerInfo, dest: Path, opts: CheckpointOptions) -> EngineCheckpoint:
        # Exported uncompressed: gpusnap adds its metadata to the tar and packaging compresses
        # (zstd, chunked) on its own, so compressing twice would only cost time.
        args = ["container", "checkpoint", "--export", str(dest), "--compress", "none"]
        if opts.leave_running:
            args.append("--leave-running")
        if opts.tcp_established:
            args.append("--tcp-established")
        proc = self._run(*args, container.id)
        if proc.returncode != 0:
            dest.unlink(missing_ok=True)
            refusal = runtime_refusal(proc.stderr or "")
            if refusal is not None:  # podman prints the runtime's line, then "... failed: exit status N"
                raise refusal_error(f"podman could not checkpoint {container.name}", refusal, "the container was left as it was")
            raise CheckpointError(
                f"podman could not checkpoint {container.name}: {_first_line(proc.stderr)}; "
                "the container was left as it was (see `podman logs` and `gpusnap doctor`)"
            )
        return EngineCheckpoint(form=self.form, path=dest, image_dir=None, container=container)

    def restore(self, source: Path, opts: RestoreOptions) -> ContainerInfo:
        args = ["container", "restore", "--import", str(source)]
        if opts.name:
            args += ["--name", opts.name]
        if opts.tcp_established:
            args.append("--tcp-established")
        proc = self._run(*args)
        if proc.returncode != 0:
            refusal = runtime_refusal(proc.stderr or "")
            if refusal is not None:  # the runtime's host check (exit 4 or 5): said as it said it
                raise refusal_error("podman could not restore the checkpoint", refusal, "nothing was started")
            raise RestoreError(f"podman could not restore the checkpoint: {_first_line(proc.stderr)}; nothing was started")
        new_id = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else (opts.name or "")
        info = self.get(new_id)
        if info is None:
            raise RestoreError(f"podman reported a restore but container {new_id} does not exist")
        return info

    def remove(self, container: ContainerInfo) -> None:
        proc = self._run("rm", "-f", "-t", "0", container.id)
        if proc.returncode != 0 and "no such container" not in proc.stderr.lower():
            raise NotFoundError(f"podman could not remove {container.name}: {_first_line(proc.stderr)}")

    def is_running(self, container: ContainerInfo) -> bool:
        info = self.get(container.id)
        return bool(info and info.running)

    def logs(self, container: ContainerInfo) -> str:
        proc = self._run("logs", container.id, timeout=60)
        return proc.stdout + proc.stderr
