"""Settings shared by the shim, the hooks and the CLI.

Precedence, highest first: explicit arguments, ``GPUSNAP_*`` environment variables, the config
file (``/etc/gpusnap/config.toml``, or ``GPUSNAP_CONFIG``), built-in defaults. Every filesystem
root is injectable so tests point the code at fake ``/dev``, ``/proc``, ``/etc`` trees.

Only the standard library is imported here: the runtime shim loads this on every call.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from gpusnap.errors import UsageError

DEFAULT_CONFIG_FILE = Path("/etc/gpusnap/config.toml")


@dataclass(frozen=True)
class HostPaths:
    """Where the host's pseudo-filesystems and system directories are (``/`` in production)."""

    root: Path = Path("/")

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def proc(self) -> Path:
        return self.root / "proc"

    @property
    def sys(self) -> Path:
        return self.root / "sys"

    @property
    def etc(self) -> Path:
        return self.root / "etc"


@dataclass(frozen=True)
class Settings:
    """Where gpusnap keeps its state, which binaries it runs, and host-wide policy."""

    host: HostPaths = field(default_factory=HostPaths)
    run_dir: Path = Path("/run/gpusnap")  # per-boot state: runc-direct containers, restore markers
    state_dir: Path = Path("/var/lib/gpusnap")  # persistent state: IPAM, GPU assignments
    store_dir: Path = Path("/var/lib/gpusnap/store")  # the local OCI image-layout store
    runc: str | None = None  # path of the real runc; None = first `runc` on PATH that is not us
    criu: str | None = None  # path of CRIU; None = `criu` on PATH
    gpu_backend: str = "auto"  # auto | nvidia | none | standin:<state-dir>
    lock_timeout_ms: int = 10_000  # how long the GPU lock may wait for in-flight work
    hook_path: str | None = None  # gpusnap-hook binary to inject; None = next to the shim
    # runc-direct bridge networking (gpusnap.network): the bridge, its subnet, and the prefix of
    # what gpusnap names on the host (netns "<prefix>-<id>", nft table and veths without '-').
    network_bridge: str = "gpusnap0"
    network_subnet: str = "10.210.0.0/16"
    network_prefix: str = "gpusnap"
    config_file: Path = DEFAULT_CONFIG_FILE
    # CRIU options the admin adds for every container (``criu_options`` in the config file):
    # the only way options outside gpusnap.criu.config.CONTAINER_OPTIONS reach CRIU.
    criu_options: tuple[str, ...] = ()
    # Whether NVIDIA_VISIBLE_DEVICES & co. in a container's environment may request GPUs: false
    # on nodes shared by tenants, where a pod's author sets its environment (docs/security.md).
    gpu_request_env: bool = True
    # Whether a checkpoint whose engine dumps into gpusnap's own directory (runc-direct) is
    # stored, and pushed, while CRIU writes it (gpusnap.packaging.follow); false: after the dump.
    store_while_dumping: bool = True
    # The nice value of the threads that store and push a checkpoint while CRIU dumps it
    # (gpusnap.host.priority): they give the cores to the dump the user waits for. 0: as the
    # gpusnap command itself.
    store_nice: int = 10
    # The nice value of the uploads of `checkpoint --push` while CRIU dumps (the pipelined
    # push); None: store_nice. Above store_nice, the store, which the tag waits for, goes first
    # where the two compete for the cores.
    push_nice: int | None = None
    # Whether a runc-direct restore through gpusnap-runtime starts runc and CRIU before its
    # memory pages are whole, CRIU held before it reads them (gpusnap.checkpoint.pages_hold).
    # Off by default: on the VM it gained nothing (bench/results/criu-hold-vm-2026-11-25: CRIU
    # reaches the hold 0.04 s after it starts; the rest of its restore is copying the pages),
    # on the GPU hosts 0.1-0.2 s, within one host's spread (docs/runtime.md).
    criu_before_pages: bool = False
    # Transfer processes of a restore from a registry (gpusnap.packaging.transfer_worker): None =
    # chosen from the pull's size and the cores; 0 = all in the gpusnap process.
    fetch_processes: int | None = None
    # Transfer processes of a push (gpusnap.packaging.transfer_worker), so that the uploads do
    # not share the interpreter lock with ``checkpoint --push``'s store: None = 2 on a host of 4
    # cores or more (a plain push: also 512 MiB of blobs or more); 0 = all in the gpusnap process.
    push_processes: int | None = None
    # Threads that read, hash and write a checkpoint into the store: None = one per core. A
    # lower count leaves cores to the job and to the dump on a host shared with other work.
    store_workers: int | None = None
    # Whether a runc-direct restore lets the process go before its memory is in, CRIU's lazy
    # pages filled by gpusnap's own page server (gpusnap.criu.lazy_pages) while the GPU's state
    # is copied back. None ("auto"): where the kernel's userfaultfd has what CRIU needs. The
    # H100 host's registry restore of a 5.2 GB server: 3.75 s to the first token lazily, 6.30 s
    # eagerly (bench/results/gpu-h100-lazy-pages-e2e-2026-11-27). ``gpusnap restore
    # --lazy-pages/--eager-pages`` decides for one restore.
    lazy_pages: bool | None = None
    # Where a runc-direct checkpoint keeps CRIU's dump.log (``<container>-<UTC time>-dump.log``):
    # what CRIU did and when, to find what a slow dump spent its time on. None: the log is removed
    # once the dump succeeded (it is no part of the checkpoint; a failed dump's logs are always kept).
    criu_log_dir: Path | None = None


_ENV = {
    "GPUSNAP_ROOT": "host",
    "GPUSNAP_RUN_DIR": "run_dir",
    "GPUSNAP_STATE_DIR": "state_dir",
    "GPUSNAP_STORE": "store_dir",
    "GPUSNAP_RUNC": "runc",
    "GPUSNAP_CRIU": "criu",
    "GPUSNAP_GPU_BACKEND": "gpu_backend",
    "GPUSNAP_LOCK_TIMEOUT_MS": "lock_timeout_ms",
    "GPUSNAP_HOOK": "hook_path",
    "GPUSNAP_BRIDGE": "network_bridge",
    "GPUSNAP_SUBNET": "network_subnet",
    "GPUSNAP_NET_PREFIX": "network_prefix",
    "GPUSNAP_STORE_WHILE_DUMPING": "store_while_dumping",
    "GPUSNAP_STORE_NICE": "store_nice",
    "GPUSNAP_PUSH_NICE": "push_nice",
    "GPUSNAP_CRIU_BEFORE_PAGES": "criu_before_pages",
    "GPUSNAP_FETCH_PROCESSES": "fetch_processes",
    "GPUSNAP_PUSH_PROCESSES": "push_processes",
    "GPUSNAP_STORE_WORKERS": "store_workers",
    "GPUSNAP_LAZY_PAGES": "lazy_pages",
    "GPUSNAP_CRIU_LOG_DIR": "criu_log_dir",
}

_FILE_KEYS = {f.name for f in fields(Settings)} - {"host", "config_file"} | {"root"}


# Settings that take ``auto`` (None) or a count in this range.
_AUTO_COUNTS = {"fetch_processes": (0, 64), "push_processes": (0, 64), "store_workers": (1, 256)}


def _coerce(name: str, value: object, source: str) -> object:
    if name == "lazy_pages" and str(value).strip().lower() == "auto":
        return None
    if name in ("gpu_request_env", "store_while_dumping", "criu_before_pages", "lazy_pages"):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text not in ("true", "false", "1", "0"):
            raise UsageError(f"{source}: {name} must be true or false{' or auto' if name == 'lazy_pages' else ''}, got {value!r}")
        return text in ("true", "1")
    if name == "criu_options":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UsageError(f"{source}: criu_options must be a list of strings, one CRIU option each (\"ghost-limit 10M\")")
        return tuple(value)
    if name == "host":
        return HostPaths(Path(str(value)))
    if name in ("run_dir", "state_dir", "store_dir"):
        return Path(str(value))
    if name == "criu_log_dir":
        text = str(value).strip()
        if text and not os.path.isabs(text):
            raise UsageError(f"{source}: criu_log_dir must be an absolute path (or empty: no logs kept), got {value!r}")
        return Path(text) if text else None
    if name in _AUTO_COUNTS:
        lo, hi = _AUTO_COUNTS[name]
        text = str(value).strip().lower()
        if text == "auto":
            return None
        if not text.isdigit() or not lo <= int(text) <= hi:
            raise UsageError(f"{source}: {name} must be auto or a whole number from {lo} to {hi}, got {value!r}")
        return int(text)
    if name in ("store_nice", "push_nice"):
        text = str(value).strip()
        if name == "push_nice" and text.lower() in ("", "auto"):
            return None
        if not text.isdigit() or int(text) > 19:
            raise UsageError(f"{source}: {name} must be a nice value from 0 to 19, got {value!r}")
        return int(text)
    if name == "lock_timeout_ms":
        try:
            return int(str(value))
        except ValueError:
            raise UsageError(f"{source}: lock_timeout_ms must be a whole number of milliseconds, got {value!r}") from None
    return str(value)


def load_settings(env: Mapping[str, str] | None = None, config_file: Path | None = None, **overrides: object) -> Settings:
    """Build :class:`Settings` from defaults, the config file, the environment and ``overrides``."""
    env = os.environ if env is None else env
    path = config_file or Path(env.get("GPUSNAP_CONFIG", str(DEFAULT_CONFIG_FILE)))
    values: dict[str, object] = {"config_file": path}
    if path.is_file():
        # It names the runc, CRIU and hook binaries the runtime runs as root, and CRIU options.
        check_admin_file(path, "gpusnap config file")
        import tomllib  # only when a file exists: keeps the shim's cold start small

        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise UsageError(f"{path}: not valid TOML ({exc}); fix or remove the file") from None
        unknown = set(data) - _FILE_KEYS
        if unknown:
            raise UsageError(f"{path}: unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_FILE_KEYS))}")
        for key, val in data.items():
            name = "host" if key == "root" else key
            values[name] = _coerce(name, val, str(path))
    for var, name in _ENV.items():
        if env.get(var):
            values[name] = _coerce(name, env[var], var)
    for name, val in overrides.items():
        if val is not None:
            values[name] = val if isinstance(val, HostPaths) else _coerce(name, val, name)
    if "store_dir" not in values and "state_dir" in values:
        values["store_dir"] = Path(str(values["state_dir"])) / "store"
    return replace(Settings(), **values)  # type: ignore[arg-type]


def check_admin_file(path: Path, what: str) -> None:
    """Refuse to trust ``path`` unless only root (or the user running gpusnap) could have
    written it: a regular file owned by root, not group- or world-writable, in a directory
    no one else may write to (sticky directories such as /tmp excepted)."""
    trusted = {0, os.geteuid()}
    try:
        st = path.stat()
        parent = path.resolve().parent.stat()
    except OSError as exc:
        raise UsageError(f"{what} {path} cannot be read ({exc.strerror}); fix the path or remove the setting") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what} {path} is not a regular file; point it at a file")
    if st.st_uid not in trusted:
        raise UsageError(f"{what} {path} is owned by uid {st.st_uid}, not root; only a root-owned file is trusted (chown root {path})")
    if st.st_mode & 0o022:
        raise UsageError(f"{what} {path} is writable by other users (mode {oct(st.st_mode & 0o777)}); run chmod go-w {path}")
    if parent.st_uid not in trusted or (parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX):
        raise UsageError(f"{what} {path} is in a directory other users can write to; move it to a root-owned directory such as /etc/gpusnap")
