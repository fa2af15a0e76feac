"""runc-direct: gpusnap's embedded engine, for hosts without podman or docker.

It writes an OCI bundle per container under ``<run_dir>/engine/containers/<name>/`` and drives
``gpusnap-runtime`` (or the real runc when the shim is not installed) with its own state root
``<run_dir>/engine/runc``. The root filesystem is a directory the user names, an overlay over a
read-only lower directory (``rootfs_overlay``, e.g. ``/``: the host's own programs, such as a
Python with PyTorch, without building an image), or by default a fresh static busybox tree. Container stdio are pipes copied into ``container.log`` by a small
helper (see :mod:`gpusnap.engines.logcopy`): CRIU cannot dump host files the container opened,
and runc reconnects external pipes at restore.

Its checkpoint form is ``criu-dir``: the CRIU images plus ``runc-direct.json`` (the bundle's
config.json and where its root filesystem came from), enough to rebuild the bundle elsewhere,
and for an overlay root ``rootfs-upper.tar``, its writable layer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.config import Settings
from gpusnap.criu.config import skips_network_lock, takes_network_lock_option, with_network_lock_skip
from gpusnap.engines.base import (
    DAMAGED,
    FORM_CRIU_DIR,
    CheckpointOptions,
    ContainerInfo,
    EngineBase,
    EngineCheckpoint,
    RestoreOptions,
    refusal_error,
    rfc3339_now,
    runtime_refusal,
)
from gpusnap.errors import (
    CheckpointError,
    GpusnapError,
    MissingDependencyError,
    NotFoundError,
    RestoreError,
    UsageError,
)
from gpusnap.engines.upper import EarlyPack, pack_upper, unpack_upper_apart
from gpusnap.engines.workdirs import DUMP_DONE
from gpusnap.criu.logs import first_error
from gpusnap.metadata import GATE_ALL, GATE_ENV, GATE_PAGES, GATE_ROOTFS, GATE_STOP, read_restore_timings
from gpusnap.steps import Beside, Step, background, run_steps

NAME = "runc-direct"
BUNDLE_RECORD = "runc-direct.json"
BUSYBOX_ROOTFS = "busybox"  # the default root filesystem: a static busybox tree
OVERLAY_ROOTFS = "overlay"  # an overlay over RuncDirectRecord.overlay_lower (see mount_overlay)
UPPER_ARCHIVE = "rootfs-upper.tar"  # an overlay container's writable layer, in its checkpoint
NETWORK_MODES = ("none", "bridge")
RUNTIME_TIMEOUT_S = 300  # one runtime call (a restore: from its images being ready)
BESIDE_STEP = "prepare the root filesystem and images beside the runtime"
BESIDE_PREFIX = "beside the runtime: "  # timings of what ran on the restore's own threads meanwhile
LAZY_MARKER = "lazy-fill.pending"  # in the container's dir while its lazy restore fills memory (gpusnap.criu.lazy_pages)
LAZY_SERVER_STEP = "start the lazy-pages server"
LAZY_FILL_STEP = "fill the memory (lazy pages)"
WAIT_IMAGES = "wait for the checkpoint images"  # the restore step that waits for the pages files (RestoreOptions.images_ready)
WAIT_EAGER_PAGES = "wait for the pages CRIU copies itself"  # a lazy restore whose pages are still being written
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_DEFAULT_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class RuncDirectRecord:
    """What the engine keeps per container in ``state.json`` (and, minus host paths, in checkpoints)."""

    name: str
    command: list[str]
    rootfs: str  # "busybox", "overlay" (over overlay_lower) or an absolute directory
    network: str = "none"
    env: list[str] = field(default_factory=list)
    created: str = ""
    status: str = "created"  # created | running | checkpointed | exited (runc's state wins when it has one)
    logcopy_pid: int = 0
    network_record: dict[str, Any] | None = None
    publish: list[str] = field(default_factory=list)  # host ports published with --network bridge
    ip: str = ""  # address asked for with --ip (run, or restore at another address); "" = IPAM's pick
    restored_from: str = ""
    overlay_lower: str = ""  # with rootfs "overlay": the read-only lower directory (absolute)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RuncDirectRecord":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def validate_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise UsageError(f"invalid container name {name!r}: use letters, digits, '_', '.', '-' (at most 128, not starting with a symbol)")
    return name


def busybox_binary() -> Path:
    """busybox as found on PATH (so a host, or a test, without it on PATH reads as without it)."""
    found = shutil.which("busybox")
    if found:
        return Path(found)
    raise MissingDependencyError("busybox not found on PATH; install busybox-static (apt-get install busybox-static), or pass --rootfs DIR or --rootfs-overlay /")


def build_busybox_rootfs(dest: Path) -> None:
    """A minimal root filesystem: a static busybox and a link per applet it offers."""
    binary = busybox_binary()
    probe = subprocess.run(["file", "-b", str(binary)], capture_output=True, text=True, check=False)
    if probe.returncode == 0 and "dynamically linked" in probe.stdout:
        raise MissingDependencyError(f"{binary} is dynamically linked; install busybox-static or pass --rootfs DIR")
    for d in ("bin", "dev", "proc", "sys", "tmp", "etc", "root", "var"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    os.chmod(dest / "tmp", 0o1777)
    shutil.copy2(binary, dest / "bin" / "busybox")
    listing = subprocess.run([str(binary), "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in listing:
        link = dest / "bin" / applet
        if applet != "busybox" and not link.exists():
            link.symlink_to("busybox")
    (dest / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (dest / "etc" / "group").write_text("root:x:0:\n")
    (dest / "etc" / "hostname").write_text("gpusnap\n")


def overlay_paths(container_dir: Path) -> tuple[Path, Path]:
    """Where an overlay root filesystem lives: (its private tmpfs for upper/work, the merged tree)."""
    return container_dir / "overlay-scratch", container_dir / "overlay-root"


def mount_overlay(lower: Path, scratch: Path, merged: Path, upper_archive: Path | None = None) -> None:
    """Mount an overlay of ``lower`` (read-only) at ``merged``, its writable layer on a tmpfs.

    The upper and work directories get a tmpfs of their own because overlayfs refuses them
    inside the lower layer's tree, which is always the case with lower ``/``. With
    ``upper_archive`` (a restore) the writable layer starts as the checkpointed one. Undone by
    :func:`unmount_overlay`, also when a later part fails.
    """
    scratch.mkdir(parents=True, exist_ok=True)
    merged.mkdir(parents=True, exist_ok=True)
    _mount(["-t", "tmpfs", "-o", "mode=0755", "gpusnap-overlay-scratch", str(scratch)])
    try:
        (scratch / "upper").mkdir()
        (scratch / "work").mkdir()
        if upper_archive is not None:
            unpack_upper_apart(upper_archive, scratch / "upper")  # beside the restore's writer threads: no GIL shared
        opts = f"lowerdir={lower},upperdir={scratch / 'upper'},workdir={scratch / 'work'}"
        _mount(["-t", "overlay", "-o", opts, "gpusnap-overlay", str(merged)])
    except BaseException:
        _umount(scratch)
        raise


def unmount_overlay(scratch: Path, merged: Path) -> None:
    """Take the overlay and its tmpfs away; refuse to go on while either is still mounted, so a
    later ``rmtree`` of the container directory can never walk into the lower layer."""
    for path in (merged, scratch):
        if os.path.ismount(path):
            _umount(path)
            if os.path.ismount(path):
                raise GpusnapError(f"could not unmount {path}; unmount it (`umount -l {path}`) and delete again")


def _mount(args: list[str]) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise GpusnapError(f"mount {' '.join(args)} failed: {_last_error_line(proc.stderr) or proc.returncode}; check that the kernel has overlayfs and that you are root")


def _umount(path: Path) -> None:
    # Lazy: the container's mount namespace may still hold it for a moment after runc delete.
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def make_spec(name: str, command: list[str], rootfs: Path, env: list[str], netns_path: str | None) -> dict[str, Any]:
    """The OCI runtime config for a non-interactive container (stdio on pipes, no terminal)."""
    caps = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_SETUID", "CAP_SETGID", "CAP_NET_RAW"]
    netns: dict[str, str] = {"type": "network"}
    if netns_path:
        netns["path"] = netns_path
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": command,
            "env": [_DEFAULT_PATH_ENV, *env],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": name[:63],
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        ],
        "annotations": {"io.gpusnap.engine": NAME, "io.gpusnap.name": name},
        "linux": {
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "namespaces": [{"type": "pid"}, netns, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }


def find_shim() -> str | None:
    """gpusnap-runtime on PATH or beside this Python (a venv not on PATH), when it is usable."""
    shim = shutil.which("gpusnap-runtime") or shutil.which("gpusnap-runtime", path=str(Path(sys.executable).parent))
    if shim and importlib.util.find_spec("gpusnap.runtime_shim.main") is not None:
        return shim
    return None


def runtime_command(settings: Settings) -> tuple[list[str], str]:
    """The OCI runtime runc-direct drives and its name: gpusnap-runtime when installed, else runc.

    The shim is what adds GPU state to checkpoints; the plain runc fallback keeps CPU
    containers working while the shim is absent (doctor says so).
    """
    shim = find_shim()
    if shim:
        return [shim], "gpusnap-runtime"
    runc = settings.runc or shutil.which("runc")
    if not runc:
        raise MissingDependencyError("runc not found; install it (apt-get install runc) or set GPUSNAP_RUNC")
    args = [runc]
    if settings.criu:
        args += ["--criu", settings.criu]
    return args, "runc"


@dataclass
class RuncDirectEngine(EngineBase):
    settings: Settings
    name: str = NAME
    form: str = FORM_CRIU_DIR
    # restore() waits for RestoreOptions.images_ready itself, after preparing the bundle, root
    # filesystem and network: a restore writes the pages files meanwhile (orchestrate.restore).
    OVERLAPS_IMAGES = True
    LAZY_PAGES = True  # RestoreOptions.lazy_pages: gpusnap.criu.lazy_pages serves CRIU's lazy restore
    # checkpoint() has CRIU write its images straight into ``dest``, so the store can pack the
    # pages files while they are written (orchestrate.checkpoint, packaging/follow.py).
    DUMPS_INTO_DEST = True

    # ---- layout -------------------------------------------------------------------------
    @property
    def home(self) -> Path:
        return self.settings.run_dir / "engine"

    @property
    def runc_root(self) -> Path:
        return self.home / "runc"

    def container_dir(self, name: str) -> Path:
        return self.home / "containers" / name

    def _state_path(self, name: str) -> Path:
        return self.container_dir(name) / "state.json"

    def log_path(self, name: str) -> Path:
        return self.container_dir(name) / "container.log"

    def _load(self, name: str) -> RuncDirectRecord | None:
        path = self._state_path(name)
        if not path.is_file():
            return None
        return RuncDirectRecord.from_dict(json.loads(path.read_text()))

    def _save(self, rec: RuncDirectRecord) -> None:
        path = self._state_path(rec.name)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(rec), indent=2, sort_keys=True))
        tmp.replace(path)

    # ---- runtime calls --------------------------------------------------------------------
    def _runtime(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        base, _ = runtime_command(self.settings)
        kw.setdefault("capture_output", True)
        return subprocess.run([*base, "--root", str(self.runc_root), *args], text=True, check=False, timeout=kw.pop("timeout", RUNTIME_TIMEOUT_S), **kw)

    def _runtime_state(self, name: str) -> dict[str, Any] | None:
        if not (self.runc_root / name).exists():
            return None
        proc = self._runtime("state", name, timeout=60)
        if proc.returncode != 0:
            return None
        return json.loads(proc.stdout)

    # ---- Engine interface -------------------------------------------------------------------
    def require(self) -> None:
        runtime_command(self.settings)

    def runtime_name(self) -> str:
        return runtime_command(self.settings)[1]

    def _info(self, rec: RuncDirectRecord) -> ContainerInfo:
        state = self._runtime_state(rec.name)
        status = rec.status
        pid = 0
        if state is not None:
            status = state.get("status", status)
            pid = int(state.get("pid") or 0) if status == "running" else 0
        elif status in ("running", "created", "paused"):
            status = "exited"  # runc no longer knows it: its processes are gone
        marker = self.container_dir(rec.name) / LAZY_MARKER
        if marker.exists():
            from gpusnap.criu.lazy_pages import fill_incomplete

            # Its lazy restore ended with pages missing (they read as zeros): damaged whether
            # the process still runs or already died of it.
            if fill_incomplete(marker):
                status = DAMAGED
        return ContainerInfo(
            id=rec.name,
            name=rec.name,
            engine=self.name,
            image=f"overlay:{rec.overlay_lower}" if rec.rootfs == OVERLAY_ROOTFS else rec.rootfs,
            status=status,
            pid=pid,
            created=rec.created,
            command=list(rec.command),
            bundle=str(self.container_dir(rec.name) / "bundle"),
            labels={"network": rec.network, **({"ip": rec.network_record["address"]} if rec.network_record else {})},
        )

    def get(self, ref: str) -> ContainerInfo | None:
        if not _NAME_RE.match(ref):
            return None
        rec = self._load(ref)
        return self._info(rec) if rec else None

    def list(self) -> list[ContainerInfo]:
        root = self.home / "containers"
        if not root.is_dir():
            return []
        out = []
        for d in sorted(root.iterdir()):
            rec = self._load(d.name)
            if rec is not None:
                out.append(self._info(rec))
        return out

    def run(
        self,
        name: str,
        command: list[str],
        *,
        rootfs: str = BUSYBOX_ROOTFS,
        network: str = "none",
        env: list[str] | None = None,
        publish: list[str] | None = None,
        ip: str | None = None,
        rootfs_overlay: str | None = None,
    ) -> ContainerInfo:
        """Create and start a container; on any failure everything made so far is taken back.

        ``rootfs_overlay``: a directory to use read-only under an overlay whose writable layer
        is private to this container (instead of ``rootfs``).
        """
        validate_name(name)
        if not command:
            raise UsageError("no command given; pass the program to run after the options, e.g. `gpusnap run NAME -- sh -c '...'`")
        if network not in NETWORK_MODES:
            raise UsageError(f"unknown network {network!r}; use one of {', '.join(NETWORK_MODES)}")
        if publish and network != "bridge":
            raise UsageError("--publish needs --network bridge")
        if ip and network != "bridge":
            raise UsageError("--ip needs --network bridge")
        overlay_lower = ""
        if rootfs_overlay is not None:
            if rootfs != BUSYBOX_ROOTFS:
                raise UsageError("--rootfs and --rootfs-overlay exclude each other; pass one of them")
            lower = Path(rootfs_overlay).resolve()
            if not lower.is_dir():
                raise NotFoundError(f"overlay lower directory {rootfs_overlay} is not a directory; pass an existing directory such as /")
            rootfs, overlay_lower = OVERLAY_ROOTFS, str(lower)
        elif rootfs != BUSYBOX_ROOTFS:
            src = Path(rootfs).resolve()
            if not src.is_dir():
                raise NotFoundError(f"root filesystem {rootfs} is not a directory; pass an unpacked root filesystem or leave --rootfs out for busybox")
            rootfs = str(src)
        self.require()
        if self._load(name) is not None or (self.runc_root / name).exists():
            raise UsageError(f"a runc-direct container named {name} already exists; pick another name or `gpusnap delete {name}`")
        rec = RuncDirectRecord(
            name=name, command=list(command), rootfs=rootfs, network=network, env=list(env or []), created=rfc3339_now(), publish=list(publish or []),
            ip=ip or "", overlay_lower=overlay_lower,
        )
        self._start(rec, restore_from=None, skip_lock=self._lock_skippable(rec))
        info = self.get(name)
        assert info is not None
        return info

    def _prepare_bundle(self, rec: RuncDirectRecord, spec: dict[str, Any] | None, upper_archive: Path | None, skip_lock: bool,
                        beside: list[Step] | None = None) -> list[Step]:
        """The steps that make the bundle; with ``beside``, the root filesystem's mount goes
        there instead (run beside the runtime's own start, see :meth:`_start`)."""
        cdir = self.container_dir(rec.name)
        bundle = cdir / "bundle"
        steps: list[Step] = []

        def make_dirs() -> None:
            cdir.mkdir(parents=True)
            bundle.mkdir()
            self._save(rec)

        steps.append(Step("create the bundle directory", make_dirs, lambda: shutil.rmtree(cdir, ignore_errors=True)))
        if rec.rootfs == BUSYBOX_ROOTFS:
            steps.append(Step("build the busybox root filesystem", lambda: build_busybox_rootfs(bundle / "rootfs")))
        scratch, merged = overlay_paths(cdir)
        if rec.rootfs == OVERLAY_ROOTFS:
            (steps if beside is None else beside).append(
                Step("mount the overlay root filesystem", lambda: mount_overlay(Path(rec.overlay_lower), scratch, merged, upper_archive),
                     lambda: unmount_overlay(scratch, merged)))
        steps.append(Step("set up the network", lambda: self._network_up(rec), lambda: self._network_down(rec)))

        def write_spec() -> None:
            root = {BUSYBOX_ROOTFS: bundle / "rootfs", OVERLAY_ROOTFS: merged}.get(rec.rootfs, Path(rec.rootfs))
            netns = (rec.network_record or {}).get("netns_path")
            cfg = make_spec(rec.name, rec.command, root, rec.env, netns) if spec is None else _retarget_spec(spec, rec.name, root, netns)
            # Decided on the host that runs the container (a restore elsewhere decides again).
            with_network_lock_skip(cfg.setdefault("annotations", {}), skip_lock)
            (bundle / "config.json").write_text(json.dumps(cfg, indent=2))

        steps.append(Step("write config.json", write_spec))
        return steps

    def _criu_version(self) -> tuple[int, int, int] | None:
        from gpusnap.criu.locate import find_criu

        try:
            return find_criu(self.settings, check=False).version
        except MissingDependencyError:
            return None  # start anyway: CRIU is needed only to checkpoint, which says so

    def _lock_skippable(self, rec: RuncDirectRecord) -> bool:
        """Whether CRIU may skip the network lock for ``rec``: no network, and a CRIU (4.2+)
        that takes ``network-lock skip`` from runc's config file."""
        if rec.network != "none":
            return False
        version = self._criu_version()
        return version is not None and takes_network_lock_option(version)

    def _require_network_lock(self, rec: RuncDirectRecord, skip_lock: bool, what: str) -> None:
        """Refuse, before anything moves, a CRIU run that would fail on its network lock.

        CRIU locks the container's network namespace with iptables-restore (at dump and at
        restore) unless told to skip the lock, which gpusnap does for "none" containers when
        CRIU 4.2+ runs them through gpusnap-runtime (see gpusnap.criu.config.NETWORK_LOCK_SKIP).
        Found out mid-dump, it would cost a GPU state round trip and a rollback.
        """
        if (skip_lock and self.runtime_name() == "gpusnap-runtime") or shutil.which("iptables-restore") is not None:
            return
        fix = "install iptables (apt-get install iptables)"
        if what == "checkpoint" and self._lock_skippable(rec):
            fix += ", or start the container again: with this CRIU gpusnap skips the lock for a container without network"
        elif rec.network == "none":
            fix += " or use CRIU 4.2+ with gpusnap-runtime (gpusnap then skips the lock for a container without network)"
        raise MissingDependencyError(f"cannot {what} {rec.name}: CRIU locks its network namespace with iptables-restore, which is not on PATH; {fix}")

    def _network_up(self, rec: RuncDirectRecord) -> None:
        if rec.network == "none":
            return
        manager = _network_manager(self.settings)
        if rec.network_record:
            old = _record_from_dict(rec.network_record)
            rec.network_record = _record_to_dict(manager.recreate(old, ip=rec.ip or None, container_id=rec.name))
        else:
            request = manager.request(_parse_publish(rec.publish), ip=rec.ip or None)
            rec.network_record = _record_to_dict(manager.create(rec.name, request))
        self._save(rec)

    def _network_down(self, rec: RuncDirectRecord) -> None:
        if rec.network == "none" or not rec.network_record:
            return
        _network_manager(self.settings).remove(rec.name)

    def _start(
        self, rec: RuncDirectRecord, restore_from: Path | None, *, skip_lock: bool, spec: dict[str, Any] | None = None, tcp_established: bool = False,
        timings: dict[str, float] | None = None, images_ready: Callable[[], object] | None = None, lazy_pages: bool = False,
        pages_landed: Any = None,
    ) -> None:
        """``images_ready`` (a restore whose pages files are still being written): waited for
        after everything else is prepared, just before runc starts CRIU; its failure undoes
        the preparation like any failed step.

        Through gpusnap-runtime a restore does not wait for its root filesystem (the overlay's
        writable layer unpacked and mounted) and its pages files before starting the runtime:
        those go on on threads of their own while the runtime starts, loads the GPU driver and
        plans the spec, and the runtime waits for them just before runc (through the pipe named
        by ``GPUSNAP_RESTORE_GATE_FD``: gpusnap.checkpoint.runtime_steps.gate_steps).

        ``pages_landed`` (a lazy restore through gpusnap-runtime whose pages files are still
        being written: gpusnap.criu.landed): CRIU goes on once the pages it copies itself are
        in, and the page server copies the others as they land; the fill step then waits for
        the writer too."""
        bundle = self.container_dir(rec.name) / "bundle"
        pipes: dict[str, int] = {}
        gated = restore_from is not None and self.runtime_name() == "gpusnap-runtime"
        following = gated and lazy_pages and images_ready is not None and pages_landed is not None
        beside_steps: list[Step] = []  # filled by _prepare_bundle below
        beside_times: dict[str, float] = {}

        def spawn_logcopy() -> None:
            r, w = os.pipe()
            in_r, in_w = os.pipe()
            os.close(in_w)  # stdin reads EOF: these containers are not interactive
            pipes.update(out_r=r, out_w=w, in_r=in_r)
            helper = subprocess.Popen(
                [sys.executable, "-m", "gpusnap.engines.logcopy", str(self.log_path(rec.name))],
                stdin=r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
            os.close(r)
            rec.logcopy_pid = helper.pid
            self._save(rec)

        def stop_logcopy() -> None:
            for key in ("out_w", "in_r"):
                if key in pipes:
                    _close_quietly(pipes.pop(key))
            _kill_quietly(rec.logcopy_pid)

        lazy: dict[str, Any] = {}  # the page server and its work directory (lazy_pages)
        marker = self.container_dir(rec.name) / LAZY_MARKER

        def new_work_dir() -> Path:  # CRIU's work directory (and the page server's socket)
            return Path(tempfile.mkdtemp(prefix=f"{rec.name}-", dir=self.container_dir(rec.name)))

        def start_page_server() -> None:
            from gpusnap.criu.lazy_pages import LazyPagesError, ServerProcess

            assert restore_from is not None
            lazy["work"] = new_work_dir()
            try:
                lazy["server"] = ServerProcess.spawn(restore_from, lazy["work"], log=self.container_dir(rec.name) / "lazy-pages.log",
                                                     done_marker=marker, landed=pages_landed.path if following else None)
            except LazyPagesError as exc:
                raise RestoreError(f"{exc}; restore with --eager-pages") from None

        def stop_page_server() -> None:
            if "server" in lazy:
                lazy.pop("server").kill()
            marker.unlink(missing_ok=True)

        def fill_memory() -> None:
            # The process runs; what CRIU left out of its memory is in only when the server says
            # so. If it cannot finish, the container is removed (the undo of the restore step):
            # a process missing pages would get zeros where its memory was.
            from gpusnap.criu.lazy_pages import LazyPagesError

            server = lazy["server"]  # killed by the undo while it is here
            writer: Future[object] | None = None
            if following:
                # The rest of the pages are still being written. Whichever ends first decides:
                # the writer's failure (the server fails with it) is raised as the writer's own;
                # a server that ends first is waited for at once (dead, it leaves the process
                # reading zeros: the container must go now, not after the download).
                assert images_ready is not None
                started = time.perf_counter()
                writer = background(images_ready, "gpusnap-pages-writer")
                while not wait_futures([writer], timeout=0.05).done and server.running():
                    pass
                if writer.done():
                    writer.result()  # the writer's error, if it failed
                    beside_times["pages written, after the restore"] = round(time.perf_counter() - started, 3)
            lazy.pop("server")
            try:
                summary = server.wait(RUNTIME_TIMEOUT_S)
            except LazyPagesError as exc:
                raise RestoreError(f"{exc}; the container was removed, the checkpoint is unchanged: restore it again with --eager-pages") from None
            if writer is not None:
                writer.result()  # every page is in; the writer's last steps (the store's record) too
            lazy["summary"] = summary
            marker.unlink(missing_ok=True)  # the server's, done
            shutil.rmtree(lazy["work"], ignore_errors=True)

        def start() -> None:
            self.runc_root.mkdir(parents=True, exist_ok=True)
            work = lazy.get("work") or new_work_dir()
            # The container inherits runc's stdio, stderr included, so runc's own errors go to
            # a log file rather than a pipe that would stay open as long as the container runs.
            runtime_log = work / "runtime.log"
            logging = ["--log", str(runtime_log), "--log-format", "json"]
            if restore_from is None:
                args = [*logging, "run", "--detach", "--bundle", str(bundle), rec.name]
                what = "start"
            else:
                args = [*logging, "restore", "--detach", "--image-path", str(restore_from), "--work-path", str(work), "--bundle", str(bundle)]
                if "server" in lazy:
                    args.append("--lazy-pages")
                if tcp_established:
                    args.append("--tcp-established")
                args.append(rec.name)
                what = "restore"
            try:
                if gated:
                    proc = self._gated_runtime(args, pipes, beside, images_ready, beside_times,
                                               pages_landed=pages_landed if following else None, images=restore_from)
                else:
                    proc = self._runtime(*args, stdin=pipes["in_r"], stdout=pipes["out_w"], stderr=pipes["out_w"], capture_output=False)
            finally:
                stop_fds = [pipes.pop(k) for k in ("out_w", "in_r") if k in pipes]
                for fd in stop_fds:
                    _close_quietly(fd)
            if proc.returncode != 0:
                detail = _runtime_log_error(runtime_log) or _criu_log_tail(work)
                err = RestoreError if restore_from is not None else GpusnapError
                hint = "; if CRIU's lazy restore is the cause, restore with --eager-pages" if "server" in lazy else ""
                raise err(f"could not {what} {rec.name}: {detail}{hint}")
            if "server" not in lazy:  # else the server's (removed once it is done)
                shutil.rmtree(work, ignore_errors=True)

        def undo_start() -> None:
            self._runtime("delete", "--force", rec.name, timeout=60)

        def mark_running() -> None:
            rec.status = "running"
            self._save(rec)

        steps = [
            *self._prepare_bundle(rec, spec, _upper_archive(restore_from), skip_lock, beside_steps if gated else None),
            Step("start the log copier", spawn_logcopy, stop_logcopy),
        ]
        beside = Beside(beside_steps, name="gpusnap-rootfs")
        if gated:
            steps.append(Step(BESIDE_STEP, beside.start, beside.undo))
        elif restore_from is not None and images_ready is not None:
            steps.append(Step(WAIT_IMAGES, images_ready))
        if restore_from is not None and lazy_pages:
            steps.append(Step(LAZY_SERVER_STEP, start_page_server, stop_page_server))
        steps.append(Step("restore the container" if restore_from else "start the container", start, undo_start))
        if restore_from is not None and lazy_pages:
            steps.append(Step(LAZY_FILL_STEP, fill_memory))
        if restore_from is not None and rec.network != "none":
            # The recreated network stays unplugged until the sockets are back (see activate).
            steps.append(Step("connect the network", lambda: _network_manager(self.settings).activate(rec.name)))
        steps.append(Step("record the container", mark_running))
        records = run_steps(steps)
        if timings is not None:
            timings.update({r.name: round(r.seconds, 3) for r in records})
            timings.update({f"{BESIDE_PREFIX}{r.name}": round(r.seconds, 3) for r in beside.records})
            timings.update({f"{BESIDE_PREFIX}{k}": v for k, v in beside_times.items()})
            if restore_from is not None:
                timings.update(runtime_restore_timings(restore_from))
            if "summary" in lazy:
                for key in ("copy_gbps", "server_s", "restore_finished_s", "done_s"):
                    if key in lazy["summary"]:
                        timings[f"lazy pages: {key}"] = lazy["summary"][key]

    def _gated_runtime(self, args: list[str], pipes: dict[str, int], beside: Beside, images_ready: Callable[[], object] | None,
                       times: dict[str, float], *, pages_landed: Any = None, images: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run the runtime's restore now and let it go on to runc once the root filesystem
        (``beside``) and all image files but the pages are ready ("rootfs" on the gate pipe),
        CRIU then held before it reads the pages until they are whole ("pages"); "stop" when
        either failed (the runtime, or CRIU and then the runtime, undoes its own steps and
        exits non-zero, and that failure is raised here instead of the runtime's). The
        runtime's own time limit counts from the pages being whole, as if it had been started
        then."""
        base, _ = runtime_command(self.settings)
        gate_r, gate_w = os.pipe()
        try:
            proc = subprocess.Popen([*base, "--root", str(self.runc_root), *args], stdin=pipes["in_r"], stdout=pipes["out_w"],
                                    stderr=pipes["out_w"], pass_fds=(gate_r,), env={**os.environ, GATE_ENV: str(gate_r)}, text=True)
        except BaseException:
            _close_quietly(gate_w)
            raise
        finally:
            _close_quietly(gate_r)
        failed: list[BaseException] = []

        def say(word: bytes) -> None:
            try:
                os.write(gate_w, word + b"\n")
            except OSError:
                pass  # the runtime is gone already: its own failure is reported

        def open_gate() -> None:
            # "ok" once all is ready; with criu_before_pages, "rootfs" as soon as the root
            # filesystem is, and "pages" once the pages are whole (CRIU is held before it reads
            # them meanwhile: gpusnap.checkpoint.pages_hold); "stop" when either failed.
            # Not with pages_landed: holding CRIU at setup-namespaces met a cgroup race on a GPU
            # host (CRIU could not move the task into its cgroup: ENOENT, 2 demo restores of 4);
            # runc starts once the pages CRIU copies itself are in, which takes a fraction of a second.
            early = images_ready is not None and self.settings.criu_before_pages and pages_landed is None
            try:
                beside.result()
                if early:
                    say(GATE_ROOTFS)
                if pages_landed is not None:
                    # A lazy restore: CRIU copies a few MB of the pages itself, the page server
                    # the rest as it lands (gpusnap.criu.landed).
                    started = time.perf_counter()
                    from gpusnap.criu.landed import LandedFailed

                    assert images is not None and images_ready is not None
                    try:
                        pages_landed.wait_eager(images)
                    except LandedFailed as exc:
                        images_ready()  # the writer's own error
                        raise RestoreError(f"the checkpoint's pages could not be written: {exc}") from None
                    times[WAIT_EAGER_PAGES] = round(time.perf_counter() - started, 3)
                elif images_ready is not None:
                    started = time.perf_counter()
                    images_ready()
                    times[WAIT_IMAGES] = round(time.perf_counter() - started, 3)
                say(GATE_PAGES if early else GATE_ALL)
            except BaseException as exc:  # noqa: BLE001 - raised by the caller instead of the runtime's
                failed.append(exc)
                say(GATE_STOP)
            finally:
                _close_quietly(gate_w)

        opener = threading.Thread(target=open_gate, name="gpusnap-restore-gate", daemon=True)
        opener.start()
        deadline: float | None = None
        while True:
            try:
                rc = proc.wait(timeout=0.05 if deadline is None else max(0.05, deadline - time.monotonic()))
                break
            except subprocess.TimeoutExpired:
                if deadline is None and not opener.is_alive():
                    deadline = time.monotonic() + RUNTIME_TIMEOUT_S
                elif deadline is not None and time.monotonic() >= deadline:
                    proc.kill()
                    proc.wait()
                    raise RestoreError(f"the runtime's restore did not end within {RUNTIME_TIMEOUT_S} s of its images being ready; "
                                       "see the runtime log and try again") from None
        if failed:
            raise failed[0]
        return subprocess.CompletedProcess(proc.args, rc)

    def checkpoint(self, container: ContainerInfo, dest: Path, opts: CheckpointOptions) -> EngineCheckpoint:
        rec = self._load(container.name)
        if rec is None:
            raise NotFoundError(f"no runc-direct container {container.name}; `gpusnap ps` lists them")
        # The caller's ContainerInfo comes from runc's state moments ago (orchestrate.checkpoint);
        # a container that stopped since fails the runtime's own `runc state`, in its words.
        if not container.running:
            raise CheckpointError(f"{container.name} is not running ({container.status}); only running containers can be checkpointed")
        timings: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(what: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            timings[what] = round(now - clock, 4)
            clock = now

        spec_path = self.container_dir(rec.name) / "bundle" / "config.json"
        skip_lock = skips_network_lock(json.loads(spec_path.read_text()).get("annotations", {}))
        if skip_lock and self.runtime_name() == "gpusnap-runtime":
            version = self._criu_version()  # the CRIU here now, maybe not the one it started with
            if version is not None and not takes_network_lock_option(version):
                raise MissingDependencyError(
                    f"cannot checkpoint {rec.name}: it was set up for CRIU 4.2+ (network-lock skip) but CRIU here is {'.'.join(map(str, version))}, "
                    "which crashes on that option; install CRIU 4.2 or newer"
                )
        self._require_network_lock(rec, skip_lock, "checkpoint")
        dest.mkdir(parents=True)
        # The record first: if gpusnap dies while runc dumps, runc and CRIU finish without it,
        # and the next run can only store what it finds here (complete_interrupted).
        self._write_portable_record(rec, dest)
        lap("check the container and its network, write its record")
        # CRIU's work files go with the images: its stats-dump, written only when a dump
        # succeeded, then tells a run that finds them after this one died that they are whole.
        args = ["checkpoint", "--image-path", str(dest), "--work-path", str(dest)]
        if opts.leave_running:
            args.append("--leave-running")
        if opts.tcp_established:
            args.append("--tcp-established")
        early = None
        if rec.rootfs == OVERLAY_ROOTFS:  # packed once CRIU is done, beside what the runtime does after it
            early = EarlyPack(overlay_paths(self.container_dir(rec.name))[0] / "upper", dest / UPPER_ARCHIVE, dest / DUMP_DONE).start()
        try:
            proc = self._runtime(*args, rec.name)
        except BaseException:
            if early is not None:
                early.cancel()
            raise
        lap(f"{self.runtime_name()} checkpoint")
        if proc.returncode != 0 and early is not None:
            early.cancel()
        if proc.returncode != 0:
            logs = None  # none when CRIU never ran (the runtime refused first)
            kept = list(dest.glob("*.log"))
            if kept:
                logs = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=self.container_dir(rec.name)))
                for log in kept:  # kept for the user; the images go
                    shutil.move(str(log), logs / log.name)
            detail = _last_error_line(proc.stderr)
            if logs is not None and (not detail or "criu failed" in detail):  # runc's own line names no cause
                detail = _criu_log_tail(logs)
            shutil.rmtree(dest, ignore_errors=True)
            still = "still runs" if self.is_running(container) else "is no longer running"
            refusal = runtime_refusal(proc.stderr or "", proc.returncode) if self.runtime_name() == "gpusnap-runtime" else None
            if refusal is not None:
                raise refusal_error(f"could not checkpoint {rec.name}", refusal, f"the container {still}")
            raise CheckpointError(f"could not checkpoint {rec.name}: {detail}; the container {still}" + (f" (CRIU logs: {logs})" if logs is not None else ""))
        try:
            packed = early is not None and early.finish()
        except (CheckpointError, OSError):
            packed = False  # packed once more below, where its failure is the checkpoint's (the dump stays)
        self._after_dump(rec, dest, leave_running=opts.leave_running, upper_packed=packed)
        lap("pack the writable layer (what was left of it after the runtime)" if rec.rootfs == OVERLAY_ROOTFS else "after the dump")
        return EngineCheckpoint(form=self.form, path=dest, image_dir=dest, container=container, timings_s=timings)

    def _write_portable_record(self, rec: RuncDirectRecord, dest: Path) -> None:
        spec = json.loads((self.container_dir(rec.name) / "bundle" / "config.json").read_text())
        portable = {"record": {**asdict(rec), "status": "running", "logcopy_pid": 0}, "spec": spec}
        (dest / BUNDLE_RECORD).write_text(json.dumps(portable, indent=2, sort_keys=True))

    def _after_dump(self, rec: RuncDirectRecord, dest: Path, *, leave_running: bool, upper_packed: bool = False) -> None:
        """What a checkpoint adds once runc has dumped: CRIU's dump.log out (no part of the
        checkpoint), the overlay's writable layer (unless ``upper_packed``: an EarlyPack did it
        while the runtime finished), and for a container the dump stopped, its record and
        network set as a stopped one's."""
        keep_logs(dest, self.settings.criu_log_dir, rec.name)
        if rec.rootfs == OVERLAY_ROOTFS and not upper_packed:
            scratch, _ = overlay_paths(self.container_dir(rec.name))
            pack_upper(scratch / "upper", dest / UPPER_ARCHIVE)
        if not leave_running:
            # runc deleted the container after dumping it; keep the record so `ps` shows it.
            rec.status = "checkpointed"
            self._save(rec)
            # Its network goes too (the checkpoint carries the record): a restore, under this
            # name or another, recreates it with the same address for --tcp-established.
            self._network_down(rec)

    def complete_interrupted(self, dest: Path, name: str) -> bool:
        """Finish a stop-the-container checkpoint whose gpusnap died while runc dumped into
        ``dest`` and whose dump then succeeded (CRIU's stats-dump is there): the steps
        :meth:`checkpoint` takes after the dump. False when ``dest`` cannot be made whole (no
        engine record in it, or the container's own files are gone)."""
        rec = self._load(name)
        if rec is None or not (dest / BUNDLE_RECORD).is_file():
            return False
        if self.is_running(self._info(rec)):
            return False  # not the container this dump stopped (restored again since?)
        if rec.rootfs == OVERLAY_ROOTFS and not (overlay_paths(self.container_dir(rec.name))[0] / "upper").is_dir():
            return False
        self._after_dump(rec, dest, leave_running=False)
        return True

    def restore(self, source: Path, opts: RestoreOptions) -> ContainerInfo:
        record_path = source / BUNDLE_RECORD
        if not record_path.is_file():
            raise RestoreError(f"{source} is not a runc-direct checkpoint (no {BUNDLE_RECORD}); pick --engine to match it")
        saved = json.loads(record_path.read_text())
        old = RuncDirectRecord.from_dict(saved["record"])
        name = validate_name(opts.name or old.name)
        self.require()
        if self._load(name) is not None or (self.runc_root / name).exists():
            raise UsageError(f"a runc-direct container named {name} already exists; restore with --name NEW or `gpusnap delete {name}`")
        if old.rootfs == OVERLAY_ROOTFS:
            if not Path(old.overlay_lower).is_dir():
                raise RestoreError(f"the checkpoint's overlay lower directory {old.overlay_lower} is not on this host; restore where it exists")
        elif old.rootfs != BUSYBOX_ROOTFS and not Path(old.rootfs).is_dir():
            raise RestoreError(f"the checkpoint's root filesystem {old.rootfs} is not on this host; copy it there first")
        rec = RuncDirectRecord(
            name=name,
            command=old.command,
            rootfs=old.rootfs,
            network=old.network,
            env=old.env,
            created=rfc3339_now(),
            network_record=old.network_record if old.network != "none" else None,
            publish=old.publish,
            ip=opts.ip or "",
            restored_from=old.name,
            overlay_lower=old.overlay_lower,
        )
        skip_lock = self._lock_skippable(rec)
        self._require_network_lock(rec, skip_lock, "restore")
        self._start(rec, restore_from=source, skip_lock=skip_lock, spec=saved["spec"], tcp_established=opts.tcp_established,
                    timings=opts.timings, images_ready=opts.images_ready, lazy_pages=opts.lazy_pages,
                    pages_landed=opts.pages_landed)
        info = self.get(name)
        assert info is not None
        return info

    def remove(self, container: ContainerInfo) -> None:
        rec = self._load(container.name)
        if rec is None:
            raise NotFoundError(f"no runc-direct container {container.name}; `gpusnap ps` lists them")
        if (self.runc_root / rec.name).exists():
            proc = self._runtime("delete", "--force", rec.name, timeout=120)
            if proc.returncode != 0 and (self.runc_root / rec.name).exists():
                raise GpusnapError(f"could not delete {rec.name}: {_last_error_line(proc.stderr)}; try `runc --root {self.runc_root} delete -f {rec.name}`")
        self._network_down(rec)
        _wait_gone(rec.logcopy_pid)
        unmount_overlay(*overlay_paths(self.container_dir(rec.name)))
        shutil.rmtree(self.container_dir(rec.name), ignore_errors=True)

    def is_running(self, container: ContainerInfo) -> bool:
        state = self._runtime_state(container.name)
        return bool(state and state.get("status") == "running")

    def checkpoint_extra(self, cp: EngineCheckpoint) -> dict[str, Any]:
        return _checkpoint_extra(cp)

    def logs(self, container: ContainerInfo) -> str:
        path = self.log_path(container.name)
        return path.read_text(errors="replace") if path.is_file() else ""


def runtime_restore_timings(image_dir: Path) -> dict[str, float]:
    """The runtime's own account of a restore (gpusnap-runtime writes it into the image
    directory; runc alone writes none), flat, each name under "runtime: "."""
    data = read_restore_timings(image_dir)
    out: dict[str, float] = {}
    groups = (("before_steps_s", ""), ("steps_s", ""), ("hooks_s", "hook "), ("pages_hold_s", ""), ("timings_s", "gpu plan: "))
    for key, prefix in groups:
        part = data.get(key)
        if isinstance(part, dict):
            out.update({f"runtime: {prefix}{name}": float(v) for name, v in part.items() if isinstance(v, (int, float))})
    if isinstance(data.get("total_s"), (int, float)):
        out["runtime: total"] = float(data["total_s"])
    return out


def _upper_archive(restore_from: Path | None) -> Path | None:
    if restore_from is None:
        return None
    archive = restore_from / UPPER_ARCHIVE
    return archive if archive.is_file() else None


# What the checkpointing host derived for itself and the restoring host derives again (the
# runtime's CRIU config file and its options, the GPU plugin's directory and environment, the
# hooks of the GPU injection): a checkpoint, which may come from a registry, never decides them.
_HOST_DERIVED_ANNOTATIONS = ("org.criu.config", "gpusnap.io/criu-config", "gpusnap.io/criu-libdir", "gpusnap.io/criu-env")


def _retarget_spec(spec: dict[str, Any], name: str, rootfs: Path, netns_path: str | None) -> dict[str, Any]:
    spec = json.loads(json.dumps(spec))
    spec["root"]["path"] = str(rootfs)
    annotations = spec.setdefault("annotations", {})
    for key in _HOST_DERIVED_ANNOTATIONS:
        annotations.pop(key, None)
    annotations["io.gpusnap.name"] = name
    # runc-direct's own specs have no hooks but the GPU injection's, which the runtime adds
    # again at restore; hooks run as root on the host, so none is taken from a checkpoint.
    spec.pop("hooks", None)
    for ns in spec.get("linux", {}).get("namespaces", []):
        if ns.get("type") == "network":
            ns.pop("path", None)
            if netns_path:
                ns["path"] = netns_path
    return spec


def _network_manager(settings: Settings) -> Any:
    from gpusnap.network import NetworkManager

    return NetworkManager(settings)


def _parse_publish(publish: list[str]) -> Any:
    from gpusnap.network import parse_publish_list

    return parse_publish_list(publish)


def _checkpoint_extra(cp: EngineCheckpoint) -> dict[str, Any]:
    """What runc-direct adds to the checkpoint metadata's ``extra``: the network record."""
    record_path = cp.path / BUNDLE_RECORD
    if not record_path.is_file():
        return {}
    network_record = json.loads(record_path.read_text())["record"].get("network_record")
    return {"network": network_record} if network_record else {}


def _record_to_dict(record: Any) -> dict[str, Any]:
    return record.to_dict()


def _record_from_dict(data: dict[str, Any]) -> Any:
    from gpusnap.network import NetworkRecord

    return NetworkRecord.from_dict(data)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _kill_quietly(pid: int) -> None:
    if pid > 0:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    """The log copier ends by itself once the container's pipe closes; stop it if it lingers."""
    if pid <= 0:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    _kill_quietly(pid)


def _last_error_line(stderr: str | None) -> str:
    lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = re.search(r'msg="(.*)"', ln)
        if m:
            return m.group(1)
    return lines[-1] if lines else ""


def _criu_log_tail(work: Path) -> str:
    err = first_error(work)
    return f"CRIU: {err}" if err else "see the CRIU log in " + str(work)


def _runtime_log_error(path: Path) -> str:
    """The last error runc wrote to its --log file (JSON lines: {"level","msg"})."""
    if not path.is_file():
        return ""
    last = ""
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("level") in ("error", "fatal"):
            last = str(entry.get("msg", ""))
    return last


def keep_logs(image_dir: Path, log_dir: Path | None, name: str) -> list[Path]:
    """Take CRIU's logs (``*.log``) out of a dump's image directory: moved into ``log_dir`` as
    ``<name>-<UTC time>-<log>`` (the ``criu_log_dir`` setting), else removed. They are no part
    of the checkpoint; a log that cannot be kept is removed all the same, so the checkpoint
    never carries it. Returns where the kept ones are."""
    kept: list[Path] = []
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for log in sorted(image_dir.glob("*.log")):
        if log_dir is not None:
            target = log_dir / f"{name}-{stamp}-{log.name}"
            n = 1
            while target.exists():  # two dumps of one container within a second
                target = log_dir / f"{name}-{stamp}.{n}-{log.name}"
                n += 1
            try:
                log_dir.mkdir(parents=True, exist_ok=True)
                shutil.move(str(log), target)
                kept.append(target)
                continue
            except OSError:
                pass
        log.unlink(missing_ok=True)
    return kept
