"""Picking the engine: by name, or (``auto``) the one that owns the container or checkpoint."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from gpusnap.config import Settings
from gpusnap.engines.base import FORM_CRIU_DIR, FORM_DOCKER_DIR, FORM_PODMAN_ARCHIVE, ContainerInfo, Engine
from gpusnap.errors import GpusnapError, MissingDependencyError, NotFoundError, UsageError

ENGINE_NAMES = ("runc-direct", "podman", "docker")
AUTO = "auto"


def make_engine(name: str, settings: Settings) -> Engine:
    if name == "runc-direct":
        from gpusnap.engines.runc_direct import RuncDirectEngine

        return RuncDirectEngine(settings)
    if name == "podman":
        from gpusnap.engines.podman import PodmanEngine

        return PodmanEngine()
    if name == "docker":
        from gpusnap.engines.docker import DockerEngine

        return DockerEngine()
    raise UsageError(f"unknown engine {name!r}; use one of auto, {', '.join(ENGINE_NAMES)}")


def engine_for_form(form: str, settings: Settings) -> Engine:
    by_form = {FORM_CRIU_DIR: "runc-direct", FORM_PODMAN_ARCHIVE: "podman", FORM_DOCKER_DIR: "docker"}
    if form not in by_form:
        raise UsageError(f"unknown checkpoint form {form!r}")
    return make_engine(by_form[form], settings)


def find_container(ref: str, engine: str, settings: Settings) -> tuple[Engine, ContainerInfo]:
    """The engine that owns ``ref`` and the container, or NotFoundError saying where it looked.

    With ``auto`` every engine is asked, runc-direct first (it needs no daemon); an engine that
    is not installed or not running is skipped, but if no engine answered at all the error
    says so, since "no such container" would then be misleading.
    """
    names = ENGINE_NAMES if engine == AUTO else (engine,)
    unreachable: list[str] = []
    for name in names:
        eng = make_engine(name, settings)
        try:
            info = eng.get(ref)
        except MissingDependencyError as exc:
            if engine != AUTO:
                raise
            unreachable.append(f"{name} ({exc})")
            continue
        if info is not None:
            return eng, info
    if engine != AUTO:
        raise NotFoundError(f"{engine} has no container {ref!r}; check the name with `{_list_hint(engine)}`")
    looked = [n for n in names if not any(u.startswith(n + " ") for u in unreachable)]
    msg = f"no container {ref!r} in {', '.join(looked) or 'any engine'}"
    if unreachable:
        msg += f" (not reachable: {', '.join(u.split(' ')[0] for u in unreachable)})"
    raise NotFoundError(msg + "; check the name, or name the engine with --engine")


def _list_hint(engine: str) -> str:
    return {"runc-direct": "gpusnap ps", "podman": "podman ps -a", "docker": "docker ps -a"}.get(engine, "gpusnap ps")


def detect_form(path: Path) -> str:
    """The form of a checkpoint on disk (for `gpusnap restore PATH`)."""
    from gpusnap.engines.docker import CONTAINER_RECORD
    from gpusnap.engines.runc_direct import BUNDLE_RECORD

    if path.is_dir():
        if (path / BUNDLE_RECORD).is_file():
            return FORM_CRIU_DIR
        if (path / CONTAINER_RECORD).is_file():
            return FORM_DOCKER_DIR
        raise UsageError(f"{path} is not a gpusnap checkpoint directory (no {BUNDLE_RECORD} or {CONTAINER_RECORD})")
    if path.is_file():
        try:
            with tarfile.open(path) as tar:
                names = set(tar.getnames())
        except (tarfile.TarError, OSError) as exc:
            raise UsageError(f"{path} is neither a checkpoint directory nor a checkpoint archive ({exc})") from None
        if {"config.dump", "spec.dump"} & {n.lstrip("./") for n in names}:
            return FORM_PODMAN_ARCHIVE
        raise UsageError(f"{path} is a tar archive but not a podman checkpoint (no config.dump)")
    raise NotFoundError(f"{path} does not exist; give a checkpoint path or a reference like host/repo:tag")


def read_json_member(archive: Path, member: str) -> dict | None:
    """A JSON file inside a (possibly compressed) tar archive, or None."""
    try:
        with tarfile.open(archive) as tar:
            for cand in (member, "./" + member):
                try:
                    f = tar.extractfile(cand)
                except KeyError:
                    continue
                if f is not None:
                    return json.loads(f.read())
    except (tarfile.TarError, OSError, ValueError) as exc:
        raise GpusnapError(f"could not read {member} from {archive}: {exc}") from None
    return None
