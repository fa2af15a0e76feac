"""The record gpusnap writes into every checkpoint image directory (``gpusnap.json``).

It travels with the CRIU images (engines export the whole directory), is read back at restore
to check the host before anything changes, and becomes the artifact's config blob in packaging.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

METADATA_FILE = "gpusnap.json"
METADATA_VERSION = 1
# Written by the runtime beside gpusnap.json after a restore: how long each of its steps took
# (the GPU plan's, runc's, the hooks'), read back by whoever asked for the restore.
RESTORE_TIMINGS_FILE = "gpusnap-restore.json"
# Set by a caller that starts the runtime's restore before the container's root filesystem and
# images are complete (gpusnap's runc-direct engine): a pipe's read end, on which the caller
# writes "ok" once they are, or anything else (or closes it) to stop the restore. The runtime
# does all it can before (start-up, imports, the spec, the GPU driver and host check) and waits
# just before runc (gpusnap.checkpoint.runtime_steps.gate_steps): that work goes on beside the
# caller's instead of after it.
GATE_ENV = "GPUSNAP_RESTORE_GATE_FD"
# The words on that pipe, one a line: "ok" (all ready), or "rootfs" (all but the memory pages:
# runc may start, CRIU is held before the pages) then "pages"; "stop" at any point
# (gpusnap.checkpoint.pages_hold).
GATE_ALL, GATE_ROOTFS, GATE_PAGES, GATE_STOP = b"ok", b"rootfs", b"pages", b"stop"


def hook_notes_path(run_dir: Path, container_id: str) -> Path:
    """Where gpusnap-hook, run by runc during a restore of ``container_id``, notes how long it
    ran (one JSON line per hook) for the runtime to report. A folder of its own beside the
    restore markers (``<run_dir>/restoring/<id>``): no container name can stand for it there."""
    return run_dir / "restore-hooks" / container_id


def merge_restore_timings(image_dir: Path, extra: dict[str, Any]) -> None:
    """Add ``extra``'s keys to ``image_dir``'s restore timings file (made when missing).

    Best effort: a read-only image directory (an engine's export) must not fail a restore that
    worked only because its timings could not be written."""
    current = read_restore_timings(image_dir)
    current.update(extra)
    try:
        (image_dir / RESTORE_TIMINGS_FILE).write_text(json.dumps(current, indent=2))
    except OSError:
        pass


def read_restore_timings(image_dir: Path) -> dict[str, Any]:
    """What :func:`merge_restore_timings` wrote, or {} (no file, or not JSON)."""
    try:
        data = json.loads((image_dir / RESTORE_TIMINGS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    driver_version: str = ""
    cuda_version: str = ""  # driver API version, e.g. "13.0"
    vendor: str = "nvidia"


@dataclass
class GpuProcess:
    host_pid: int  # PID on the host at checkpoint time (changes at restore)
    ns_pid: int  # PID inside the container's PID namespace (kept by CRIU)
    gpu_memory_bytes: int = 0
    gpu_uuids: list[str] = field(default_factory=list)
    comm: str = ""
    gpu_memory_by_uuid: dict[str, int] = field(default_factory=dict)  # per GPU, when the backend can tell


@dataclass
class CheckpointMetadata:
    container_id: str
    created: str  # RFC 3339, UTC
    version: int = METADATA_VERSION
    runtime: str = "gpusnap-runtime"
    runtime_version: str = ""
    runc_version: str = ""
    criu_version: str = ""
    kernel: str = ""
    arch: str = ""
    hostname: str = ""
    gpu_backend: str = "none"
    gpus: list[GpuInfo] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)
    leave_running: bool = False
    tcp_established: bool = False
    timings_s: dict[str, float] = field(default_factory=dict)  # step name -> seconds
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CheckpointMetadata":
        data = dict(data)
        data["gpus"] = [GpuInfo(**g) for g in data.get("gpus", [])]
        data["processes"] = [GpuProcess(**p) for p in data.get("processes", [])]
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def write(self, image_dir: Path) -> Path:
        path = image_dir / METADATA_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, image_dir: Path) -> "CheckpointMetadata | None":
        path = image_dir / METADATA_FILE
        if not path.is_file():
            return None
        return cls.from_dict(json.loads(path.read_text()))
