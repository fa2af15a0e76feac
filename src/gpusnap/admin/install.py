"""Registering gpusnap with podman, docker and containerd (and taking it away again).

Each engine's registration is computed as a list of :class:`FileEdit` (a file's old and new
text) before anything is written, so ``--dry-run`` shows exactly what a real run does, a second
run finds nothing to change, and the writes run as :mod:`gpusnap.steps` (a failure restores
the files already written). A file that changes is first copied to
``<file>.gpusnap-<UTC time>.bak``.

- podman: one hooks.d JSON file per hook stage (``gpusnap-hook STAGE`` for containers annotated
  ``gpusnap.io/gpus``, whatever their runtime) and a containers.conf drop-in naming the runtime
  and adding it to ``runtime_supports_json``.
- docker: a ``runtimes`` entry merged into daemon.json; every other key is kept.
- containerd: a runtime entry for the CRI plugin (``runtime_type = io.containerd.runc.v2`` with
  ``BinaryName``) appended to config.toml as a marked block.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.errors import GpusnapError, UsageError
from gpusnap.steps import Step, StepFailed, run_steps

ENGINES = ("podman", "docker", "containerd")
HOOK_STAGES = ("createRuntime", "createContainer", "poststop")
DEFAULT_NAME = "gpusnap"
# podman's built-in runtime_supports_json list (containers/common defaults), kept when we add ours
PODMAN_JSON_RUNTIMES = ("crun", "runc", "kata", "runsc", "youki", "krun")
_BEGIN = "# >>> gpusnap runtime {name} (written by `gpusnap install`; `gpusnap uninstall` removes it)"
_END = "# <<< gpusnap runtime {name}"


@dataclass(frozen=True)
class InstallPaths:
    """Every file the installer reads or writes (injectable for tests)."""

    hooks_dir: Path | None = None  # None: containers.conf's hooks_dir, else podman's default
    system_containers_conf: Path = Path("/usr/share/containers/containers.conf")  # read only
    containers_conf: Path = Path("/etc/containers/containers.conf")  # read only: current values
    containers_conf_d: Path = Path("/etc/containers/containers.conf.d")
    daemon_json: Path = Path("/etc/docker/daemon.json")
    containerd_config: Path = Path("/etc/containerd/config.toml")
    containerd_bin: str = "containerd"  # asked for its version when the config file has none


@dataclass
class InstallOptions:
    runtime_path: str
    hook_path: str
    name: str = DEFAULT_NAME
    paths: InstallPaths = field(default_factory=InstallPaths)
    # containerd config version for a new (or version-less, empty) config.toml: 3 for
    # containerd 2.x, 2 for 1.x; 0 = ask the containerd binary. A file's own version always wins.
    containerd_config_version: int = 0


@dataclass
class FileEdit:
    path: Path
    old: str | None  # None: the file does not exist
    new: str | None  # None: remove the file
    summary: str
    owned: bool = False  # the whole file is gpusnap's: no backup before changing it

    @property
    def changes(self) -> bool:
        return self.old != self.new


@dataclass
class Change:
    path: Path
    action: str  # "create" | "update" | "remove" | "unchanged"
    summary: str
    backup: Path | None = None

    def describe(self, dry_run: bool = False) -> str:
        verb = {"create": "create", "update": "update", "remove": "remove", "unchanged": "unchanged"}[self.action]
        if dry_run and self.action != "unchanged":
            verb = f"would {verb}"
        text = f"{verb} {self.path}: {self.summary}"
        return text + (f" (backup {self.backup})" if self.backup else "")


def default_options(name: str = DEFAULT_NAME, paths: InstallPaths | None = None) -> InstallOptions:
    """Runtime and hook binaries as found beside this program or on PATH."""
    here = Path(sys.argv[0]).absolute().parent

    def find(binary: str) -> str:
        beside = here / binary
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
        found = shutil.which(binary)
        if not found:
            raise UsageError(f"{binary} not found beside {sys.argv[0]} or on PATH; install gpusnap or pass its path")
        return str(Path(found).absolute())

    return InstallOptions(runtime_path=find("gpusnap-runtime"), hook_path=find("gpusnap-hook"), name=name, paths=paths or InstallPaths())


def _check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise UsageError(f"runtime name {name!r} must be letters, digits, '.', '_' or '-'")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


# ---- podman ---------------------------------------------------------------------------------


PODMAN_DEFAULT_HOOKS_DIR = Path("/usr/share/containers/oci/hooks.d")


def _podman_conf_value(paths: InstallPaths, key: str, exclude: Path | None = None) -> Any:
    """``[engine] key`` as podman would see it from its config files (later files win)."""
    import tomllib

    value = None
    sources = [paths.system_containers_conf, paths.containers_conf]
    if paths.containers_conf_d.is_dir():
        sources += sorted(p for p in paths.containers_conf_d.glob("*.conf") if p != exclude)
    for src in sources:
        text = _read(src)
        if text is None:
            continue
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"{src}: not valid TOML ({exc}); fix it first") from None
        found = (data.get("engine") or {}).get(key)
        if found is not None:
            value = found
    return value


def podman_hooks_dir(paths: InstallPaths) -> Path:
    """Where podman looks for hooks: the first configured hooks_dir, else its default."""
    if paths.hooks_dir is not None:
        return paths.hooks_dir
    configured = _podman_conf_value(paths, "hooks_dir")
    if isinstance(configured, list) and configured:
        return Path(str(configured[0]))
    return PODMAN_DEFAULT_HOOKS_DIR


def hooks_d_file(opts: InstallOptions, stage: str) -> tuple[Path, dict[str, Any]]:
    from gpusnap.ocispec.gpu_modifiers import validate_hooks_d

    doc = {
        "version": "1.0.0",
        "hook": {"path": opts.hook_path, "args": ["gpusnap-hook", stage], "timeout": 30},
        "when": {"annotations": {r"^gpusnap\.io/gpus$": ".*"}},
        "stages": [stage],
    }
    path = podman_hooks_dir(opts.paths) / f"{opts.name}-{stage.lower()}.json"
    validate_hooks_d(doc, str(path))
    return path, doc


def _toml_str(value: str) -> str:
    # JSON string escapes are a subset of TOML basic-string escapes.
    return json.dumps(value)


def _toml_list(values: list[str]) -> str:
    return "[" + ", ".join(_toml_str(v) for v in values) + "]"


def _podman_json_runtimes(paths: InstallPaths, dropin: Path) -> list[str]:
    """runtime_supports_json as podman would see it without our drop-in (a drop-in replaces the
    list, so ours must carry the existing names)."""
    listed = _podman_conf_value(paths, "runtime_supports_json", exclude=dropin)
    return [str(n) for n in listed] if isinstance(listed, list) else list(PODMAN_JSON_RUNTIMES)


def plan_podman(opts: InstallOptions, remove: bool = False) -> list[FileEdit]:
    edits: list[FileEdit] = []
    for stage in HOOK_STAGES:
        path, doc = hooks_d_file(opts, stage)
        new = None if remove else json.dumps(doc, indent=2) + "\n"
        edits.append(FileEdit(path, _read(path), new, f"hooks.d entry: gpusnap-hook {stage} for containers annotated gpusnap.io/gpus", owned=True))
    dropin = opts.paths.containers_conf_d / f"50-{opts.name}.conf"
    new_conf: str | None = None
    if not remove:
        names = _podman_json_runtimes(opts.paths, dropin)
        if opts.name not in names:
            names.append(opts.name)
        new_conf = (
            f"# Written by `gpusnap install podman`; `gpusnap uninstall podman` removes it.\n"
            f"[engine]\nruntime_supports_json = {_toml_list(names)}\n\n"
            f"[engine.runtimes]\n{opts.name} = {_toml_list([opts.runtime_path])}\n"
        )
    summary = f"containers.conf drop-in for runtime {opts.name!r}" if remove else f"containers.conf runtime {opts.name!r} -> {opts.runtime_path} (in runtime_supports_json)"
    edits.append(FileEdit(dropin, _read(dropin), new_conf, summary, owned=True))
    return edits


# ---- docker ---------------------------------------------------------------------------------


def plan_docker(opts: InstallOptions, remove: bool = False) -> list[FileEdit]:
    path = opts.paths.daemon_json
    old = _read(path)
    try:
        cfg = json.loads(old) if old and old.strip() else {}
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno}); fix it first") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{path}: must hold a JSON object; fix it first")
    runtimes = cfg.get("runtimes") or {}
    if not isinstance(runtimes, dict):
        raise UsageError(f"{path}: 'runtimes' must be an object; fix it first")
    want = {"path": opts.runtime_path}
    if remove:
        if opts.name not in runtimes:
            return [FileEdit(path, old, old, f"no runtime {opts.name!r}")]
        runtimes = {k: v for k, v in runtimes.items() if k != opts.name}
        summary = f"removed runtimes.{opts.name}"
    else:
        if runtimes.get(opts.name) == want:
            return [FileEdit(path, old, old, f"runtimes.{opts.name} already -> {opts.runtime_path}")]
        runtimes = {**runtimes, opts.name: want}
        summary = f"runtimes.{opts.name} -> {opts.runtime_path}; other keys kept; reload dockerd (SIGHUP) to use it"
    merged = dict(cfg)
    if runtimes:
        merged["runtimes"] = runtimes
    else:
        merged.pop("runtimes", None)
    return [FileEdit(path, old, json.dumps(merged, indent=2) + "\n", summary)]


# ---- containerd -----------------------------------------------------------------------------


def _containerd_table(version: int, name: str) -> list[str]:
    if version >= 3:
        return ["plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes", name]
    if version == 2:
        return ["plugins", "io.containerd.grpc.v1.cri", "containerd", "runtimes", name]
    return ["plugins", "cri", "containerd", "runtimes", name]


def _toml_key(parts: list[str]) -> str:
    return ".".join(p if re.fullmatch(r"[A-Za-z0-9_-]+", p) else _toml_str(p) for p in parts)


def _dig(data: dict[str, Any], parts: list[str]) -> Any:
    for p in parts:
        if not isinstance(data, dict) or p not in data:
            return None
        data = data[p]
    return data


def _strip_block(text: str, name: str) -> str:
    begin, end = _BEGIN.format(name=name), _END.format(name=name)
    pattern = re.compile(r"\n?" + re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    return pattern.sub("\n", text).rstrip("\n") + ("\n" if text.strip() else "")


def containerd_config_version(binary: str) -> int:
    """The config version a containerd binary writes by default: 3 from containerd 2.0 on, else 2
    (also when it is not installed: 1.x is what distributions still ship most)."""
    import subprocess

    path = shutil.which(binary)
    if not path:
        return 2
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 2
    m = re.search(r"\sv?(\d+)\.(\d+)\.\d+", out)
    return 3 if m and int(m.group(1)) >= 2 else 2


def plan_containerd(opts: InstallOptions, remove: bool = False) -> list[FileEdit]:
    """A marked block appended to config.toml. Hand-written rather than a TOML rewrite: no TOML
    writer is among our dependencies, and appending keeps the operator's file (comments,
    order) byte for byte; tomllib checks the result."""
    import tomllib

    path = opts.paths.containerd_config
    old = _read(path)
    text = old or ""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML ({exc}); fix it first") from None
    ours = _BEGIN.format(name=opts.name) in text
    base = _strip_block(text, opts.name) if ours else text
    base_data = tomllib.loads(base) if ours else data
    if "version" in base_data:
        version = int(base_data["version"])
    elif base.strip():
        version = 1  # containerd reads a version-less file as version 1
    else:
        version = opts.containerd_config_version or containerd_config_version(opts.paths.containerd_bin)
    if version not in (1, 2, 3):
        raise UsageError(f"{path}: config version {version} is not one containerd reads (1, 2 or 3)")
    table = _containerd_table(version, opts.name)
    if remove:
        if not ours:
            return [FileEdit(path, old, old, f"no gpusnap block for runtime {opts.name!r}")]
        return [FileEdit(path, old, base if base.strip() else None, f"removed runtime {opts.name!r}")]
    if _dig(base_data, table) is not None:
        raise UsageError(
            f"{path}: a runtime {opts.name!r} that gpusnap did not write already exists at [{_toml_key(table)}]; "
            "remove it or pass --name"
        )
    block = [_BEGIN.format(name=opts.name)]
    if not base.strip():
        block.append(f"version = {version}")
    block += [
        f"[{_toml_key(table)}]",
        'runtime_type = "io.containerd.runc.v2"',
        f"[{_toml_key([*table, 'options'])}]",
        f"BinaryName = {_toml_str(opts.runtime_path)}",
        _END.format(name=opts.name),
    ]
    new = (base.rstrip("\n") + "\n\n" if base.strip() else "") + "\n".join(block) + "\n"
    try:
        check = tomllib.loads(new)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: adding the runtime would make it invalid TOML ({exc}); add it by hand") from None
    if _dig(check, [*table, "options", "BinaryName"]) != opts.runtime_path:
        raise UsageError(f"{path}: the runtime entry could not be added cleanly; add it by hand")
    if new == old:
        return [FileEdit(path, old, old, f"runtime {opts.name!r} already -> {opts.runtime_path}")]
    return [FileEdit(path, old, new, f"CRI runtime {opts.name!r} (io.containerd.runc.v2, BinaryName {opts.runtime_path}); restart containerd to use it")]


# ---- applying -------------------------------------------------------------------------------

_PLANNERS = {"podman": plan_podman, "docker": plan_docker, "containerd": plan_containerd}


def plan(engine: str, opts: InstallOptions, remove: bool = False) -> list[FileEdit]:
    if engine not in _PLANNERS:
        raise UsageError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    _check_name(opts.name)
    return _PLANNERS[engine](opts, remove)


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.gpusnap-tmp")
    tmp.write_text(text)
    if path.exists():
        mode = path.stat().st_mode & 0o7777
    os.chmod(tmp, mode)
    tmp.replace(path)


def _edit_step(edit: FileEdit, stamp: str, changes: list[Change]) -> Step:
    backup = edit.path.with_name(f"{edit.path.name}.gpusnap-{stamp}.bak") if edit.old is not None and not edit.owned else None

    def do() -> None:
        if backup is not None:
            shutil.copy2(edit.path, backup)
        if edit.new is None:
            edit.path.unlink()
            action = "remove"
        else:
            _write_atomic(edit.path, edit.new)
            action = "update" if edit.old is not None else "create"
        changes.append(Change(edit.path, action, edit.summary, backup))

    def undo() -> None:
        if edit.old is None:
            edit.path.unlink(missing_ok=True)
        else:
            _write_atomic(edit.path, edit.old)
        if backup is not None:
            backup.unlink(missing_ok=True)

    return Step(f"write {edit.path}", do, undo)


def apply(edits: list[FileEdit], dry_run: bool = False, *, clock: Any = time.gmtime) -> list[Change]:
    """Write the edits that change something; with ``dry_run`` only report them."""
    changes: list[Change] = []
    pending = [e for e in edits if e.changes]
    if dry_run:
        return [
            Change(e.path, ("remove" if e.new is None else "update" if e.old is not None else "create") if e.changes else "unchanged", e.summary)
            for e in edits
        ]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", clock())
    written: list[Change] = []
    try:
        run_steps([_edit_step(e, stamp, written) for e in pending])
    except StepFailed as exc:
        raise GpusnapError(f"{exc}; no file was left changed") from None
    by_path = {c.path: c for c in written}
    for e in edits:
        changes.append(by_path.get(e.path) or Change(e.path, "unchanged", e.summary))
    return changes


def diff(edit: FileEdit) -> str:
    """The unified diff an edit makes (``--dry-run`` prints it)."""
    import difflib

    old = (edit.old or "").splitlines(keepends=True)
    new = (edit.new or "").splitlines(keepends=True)
    src = str(edit.path) if edit.old is not None else "/dev/null"
    dst = str(edit.path) if edit.new is not None else "/dev/null"
    return "".join(difflib.unified_diff(old, new, src, dst))


def install(engine: str, opts: InstallOptions, dry_run: bool = False) -> list[Change]:
    return apply(plan(engine, opts), dry_run)


def uninstall(engine: str, opts: InstallOptions, dry_run: bool = False) -> list[Change]:
    return apply(plan(engine, opts, remove=True), dry_run)
