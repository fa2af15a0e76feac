"""Registry credentials from the files docker and podman users already have.

Looked up in this order (first hit wins), the same places ``docker login`` and ``podman login``
write to:
1. docker's config.json (``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``):
   ``credHelpers[registry]``, then ``auths[registry]`` (``auth`` = base64 user:password, or
   ``identitytoken``), then ``credsStore`` (a ``docker-credential-<name>`` helper);
2. containers' auth.json (``$REGISTRY_AUTH_FILE``, ``$XDG_RUNTIME_DIR/containers/auth.json``,
   ``/run/containers/<uid>/auth.json``, ``~/.config/containers/auth.json``): ``auths`` as above.
Every path is injectable (:class:`AuthSources`) so tests never touch the real home directory.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.errors import RegistryError, UsageError

DOCKER_HUB_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io")


@dataclass(frozen=True)
class Credentials:
    username: str = ""
    password: str = ""
    identity_token: str = ""  # an OAuth2 refresh token (docker's ``identitytoken``)
    source: str = ""  # where they were found, for error messages


@dataclass
class AuthSources:
    docker_config: Path | None = None
    containers_auth: list[Path] = field(default_factory=list)
    helper_prefix: str = "docker-credential-"

    @classmethod
    def default(cls, env: dict[str, str] | None = None) -> "AuthSources":
        env = dict(os.environ if env is None else env)
        home = Path(env.get("HOME", str(Path.home())))
        docker_dir = Path(env["DOCKER_CONFIG"]) if env.get("DOCKER_CONFIG") else home / ".docker"
        paths: list[Path] = []
        if env.get("REGISTRY_AUTH_FILE"):
            paths.append(Path(env["REGISTRY_AUTH_FILE"]))
        if env.get("XDG_RUNTIME_DIR"):
            paths.append(Path(env["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
        paths.append(Path(f"/run/containers/{os.getuid()}/auth.json"))
        paths.append(home / ".config" / "containers" / "auth.json")
        return cls(docker_config=docker_dir / "config.json", containers_auth=paths)


def _host_key(key: str) -> str:
    """``https://host:port/v1/`` → ``host:port`` (config files use all of these spellings)."""
    k = key.split("://", 1)[-1]
    return k.split("/", 1)[0]


def _lookup(auths: dict[str, Any], registry: str) -> tuple[str, dict[str, Any]] | None:
    wanted = {registry} | (set(_host_key(k) for k in DOCKER_HUB_KEYS) if registry in DOCKER_HUB_KEYS else set())
    for key, value in auths.items():
        if _host_key(key) in wanted and isinstance(value, dict):
            return key, value
    return None


def _decode_entry(entry: dict[str, Any], source: str) -> Credentials | None:
    if entry.get("identitytoken"):
        return Credentials(username=entry.get("username", ""), identity_token=entry["identitytoken"], source=source)
    if entry.get("auth"):
        try:
            user, _, pw = base64.b64decode(entry["auth"]).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise UsageError(f"{source}: the 'auth' entry is not base64 of user:password; log in again") from None
        return Credentials(user, pw, source=source)
    if entry.get("username") and entry.get("password"):
        return Credentials(entry["username"], entry["password"], source=source)
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: unreadable credentials file ({exc}); fix it or remove it") from None
    return data if isinstance(data, dict) else None


def run_helper(prefix: str, helper: str, registry: str) -> Credentials | None:
    """Ask ``docker-credential-<helper> get`` (the docker credential-helper protocol)."""
    exe = prefix + helper
    server = "https://index.docker.io/v1/" if registry in DOCKER_HUB_KEYS else registry
    try:
        proc = subprocess.run([exe, "get"], input=server.encode(), capture_output=True, timeout=30)
    except FileNotFoundError:
        raise RegistryError(f"credential helper {exe} (configured for {registry}) is not installed; install it or edit ~/.docker/config.json") from None
    except subprocess.TimeoutExpired:
        raise RegistryError(f"credential helper {exe} did not answer in 30 s") from None
    if proc.returncode != 0:
        if b"credentials not found" in proc.stdout + proc.stderr:
            return None
        raise RegistryError(f"credential helper {exe} failed: {(proc.stderr or proc.stdout).decode(errors='replace').strip()}")
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise RegistryError(f"credential helper {exe} answered something that is not JSON") from None
    user, secret = data.get("Username", ""), data.get("Secret", "")
    if user == "<token>":
        return Credentials(identity_token=secret, source=exe)
    return Credentials(user, secret, source=exe)


def find_credentials(registry: str, sources: AuthSources | None = None) -> Credentials | None:
    sources = sources or AuthSources.default()
    if sources.docker_config is not None:
        cfg = _read_json(sources.docker_config)
        if cfg:
            helpers = cfg.get("credHelpers") or {}
            for key, helper in helpers.items():
                if _host_key(key) == registry:
                    return run_helper(sources.helper_prefix, helper, registry)
            hit = _lookup(cfg.get("auths") or {}, registry)
            if hit:
                creds = _decode_entry(hit[1], str(sources.docker_config))
                if creds:
                    return creds
            if cfg.get("credsStore"):
                creds = run_helper(sources.helper_prefix, cfg["credsStore"], registry)
                if creds:
                    return creds
    for path in sources.containers_auth:
        data = _read_json(path)
        if not data:
            continue
        hit = _lookup(data.get("auths") or {}, registry)
        if hit:
            creds = _decode_entry(hit[1], str(path))
            if creds:
                return creds
    return None
