"""The one interface every container engine adapter implements.

The CLI never talks to podman, docker or runc itself: it asks an :class:`Engine` to checkpoint a
container into a local path (whose shape is the engine's *form*, the packaging ``form``) and to
restore a container from such a path under a new name. Going through the engine keeps the
engine's own bookkeeping right (podman's and docker's container lists, runc-direct's state).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gpusnap.errors import ExitCode, GpusnapError, MissingDependencyError

# The packaging forms (see gpusnap.packaging.api): what an engine's checkpoint path holds.
FORM_CRIU_DIR = "criu-dir"  # a CRIU image directory (runc-direct: plus the bundle record)
FORM_PODMAN_ARCHIVE = "podman-archive"  # `podman container checkpoint --export` tar
FORM_DOCKER_DIR = "docker-dir"  # docker's checkpoint directory plus the container's config


# A status engines report besides their runtime's: a runc-direct container whose lazy restore
# ended before its memory was in (engines/runc_direct.py); it must not be checkpointed.
DAMAGED = "damaged"


@dataclass
class ContainerInfo:
    """What gpusnap needs to know about one container, whatever engine runs it."""

    id: str
    name: str
    engine: str
    image: str = ""
    status: str = ""  # engine's word: running, exited, created, paused, stopped
    pid: int = 0  # host PID of the container's init process; 0 when not running
    created: str = ""  # RFC 3339
    command: list[str] = field(default_factory=list)
    bundle: str = ""  # OCI bundle directory, where the engine exposes it
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.status == "running"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CheckpointOptions:
    leave_running: bool = False
    tcp_established: bool = False
    compress: bool = False  # engine-side compression where the engine offers it (podman)


@dataclass
class RestoreOptions:
    name: str | None = None  # new container name; None = engine's choice / the original name
    tcp_established: bool = False
    ip: str | None = None  # runc-direct bridge network: restore at this address instead of the recorded one
    # Filled by engines that run their restore as steps: seconds per step (orchestrate reports
    # them in RestoreOutcome.timings_s as "restore: <step>").
    timings: dict[str, float] | None = None
    # Set by a restore whose image directory is still being written (its pages files: see
    # engines/imagedir.py ImageJob): the engine calls it just before CRIU reads the images and
    # gets the writer's error if it failed. Engines that do not call it are given whole images.
    images_ready: Callable[[], object] | None = None
    # CRIU's lazy pages served by gpusnap.criu.lazy_pages (engines with LAZY_PAGES = True).
    lazy_pages: bool = False
    # With images_ready and lazy_pages: what of the pages files is in so far
    # (gpusnap.criu.landed.LandedPages), so that CRIU and the page server need not wait for all.
    pages_landed: Any = None


@dataclass
class EngineCheckpoint:
    """A checkpoint an engine wrote to a local path, in that engine's form."""

    form: str
    path: Path  # a directory (criu-dir, docker-dir) or a file (podman-archive)
    image_dir: Path | None  # the CRIU image directory inside ``path`` when it is a directory
    container: ContainerInfo
    timings_s: dict[str, float] = field(default_factory=dict)  # the engine's own parts of the dump, for reports


class Engine(Protocol):
    name: str
    form: str

    def available(self) -> bool:
        """True when the engine's client exists and its daemon (if any) answers."""

    def require(self) -> None:
        """Raise MissingDependencyError with the fix when the engine cannot be used."""

    def get(self, ref: str) -> ContainerInfo | None:
        """The container named or identified by ``ref``, or None when this engine has none."""

    def list(self) -> list[ContainerInfo]: ...

    def checkpoint(self, container: ContainerInfo, dest: Path, opts: CheckpointOptions) -> EngineCheckpoint:
        """Checkpoint into ``dest`` (not existing yet). On failure the container is left running."""

    def restore(self, source: Path, opts: RestoreOptions) -> ContainerInfo:
        """Restore the checkpoint at ``source`` (this engine's form) as a new container."""

    def remove(self, container: ContainerInfo) -> None:
        """Stop (kill) and delete the container and what the engine keeps for it."""

    def is_running(self, container: ContainerInfo) -> bool: ...

    def logs(self, container: ContainerInfo) -> str: ...


class EngineBase:
    """What every engine adapter shares: :meth:`available` is :meth:`require` answering instead
    of raising, so each adapter writes only its own check."""

    def require(self) -> None:
        raise NotImplementedError

    def available(self) -> bool:
        try:
            self.require()
        except MissingDependencyError:
            return False
        return True


def find_executable(name: str, *, hint: str) -> str:
    """Absolute path of ``name`` on PATH, or a MissingDependencyError naming the fix."""
    path = shutil.which(name)
    if path is None:
        raise MissingDependencyError(f"{name} not found on PATH; {hint}")
    return path


def rfc3339_now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


# Exit codes with which gpusnap-runtime refuses a checkpoint or restore before anything changed
# (or after putting everything back): a workload the CUDA checkpoint API cannot take (10), a host
# that cannot take the checkpoint (4), a missing tool (5). `gpusnap checkpoint` and `restore`
# exit as the runtime did, whichever engine ran it, instead of 6 or 7 as for a failed dump or
# restore (a restore is checked by the CLI first; the runtime's check is the one left when the
# engine's container is given other GPUs than the CLI saw).
RUNTIME_REFUSALS = frozenset({ExitCode.INCOMPATIBLE, ExitCode.MISSING_DEPENDENCY, ExitCode.UNSUPPORTED})
_RUNTIME_LINE = re.compile(r"gpusnap-runtime: (.+)")
_EXIT_STATUS = re.compile(r"exit status (\d+)")


def runtime_refusal(output: str, status: int | None = None) -> tuple[ExitCode, str] | None:
    """gpusnap-runtime's own refusal inside what an engine printed about a failed runtime call:
    its exit status (``status``, or the last "exit status N" of the output, as podman and
    dockerd put it) when that is a refusal, and the runtime's message (its "gpusnap-runtime: "
    line, without that prefix). None for any other failure."""
    if status is None:
        found = _EXIT_STATUS.findall(output)
        status = int(found[-1]) if found else None
    line = _RUNTIME_LINE.search(output)
    if status not in RUNTIME_REFUSALS or line is None:
        return None
    # dockerd puts the runtime's output on one line with containerd's suffix " path= <log>: unknown".
    return ExitCode(status), line.group(1).split(" path= ", 1)[0].strip()


def refusal_error(what: str, refusal: tuple[ExitCode, str], left: str) -> GpusnapError:
    """The error for a runtime refusal: ``what`` (who could not do what), the runtime's reason,
    ``left`` (what state things are in), with the runtime's exit code."""
    code, reason = refusal
    return GpusnapError(f"{what}: {reason}; {left}", exit_code=code)
