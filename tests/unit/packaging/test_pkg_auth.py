from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from gpusnap.errors import RegistryError, UsageError
from gpusnap.packaging.auth import AuthSources, Credentials, find_credentials
from gpusnap.packaging.registry import RemoteRef


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _sources(tmp_path: Path, docker: dict | None = None, containers: dict | None = None) -> AuthSources:
    d = tmp_path / "docker.json"
    c = tmp_path / "auth.json"
    if docker is not None:
        d.write_text(json.dumps(docker))
    if containers is not None:
        c.write_text(json.dumps(containers))
    return AuthSources(docker_config=d, containers_auth=[c], helper_prefix=str(tmp_path / "docker-credential-"))


@pytest.mark.parametrize("key", ["reg.example:5000", "https://reg.example:5000", "http://reg.example:5000/v1/"])
def test_docker_config_auths_any_key_spelling(tmp_path: Path, key: str) -> None:
    src = _sources(tmp_path, {"auths": {key: {"auth": _b64("alice:s3cr:et")}}})
    creds = find_credentials("reg.example:5000", src)
    assert creds == Credentials("alice", "s3cr:et", source=str(tmp_path / "docker.json"))


def test_identity_token(tmp_path: Path) -> None:
    src = _sources(tmp_path, {"auths": {"reg.example": {"identitytoken": "tok"}}})
    assert find_credentials("reg.example", src).identity_token == "tok"  # type: ignore[union-attr]


def test_docker_hub_aliases(tmp_path: Path) -> None:
    src = _sources(tmp_path, {"auths": {"https://index.docker.io/v1/": {"auth": _b64("bob:pw")}}})
    assert find_credentials("docker.io", src).username == "bob"  # type: ignore[union-attr]


def _helper(tmp_path: Path, name: str, user: str, secret: str) -> None:
    script = tmp_path / f"docker-credential-{name}"
    script.write_text(
        "#!/bin/sh\n"
        '[ "$1" = get ] || exit 1\n'
        "read server\n"
        f'printf \'{{"ServerURL":"%s","Username":"{user}","Secret":"{secret}"}}\' "$server"\n'
    )
    os.chmod(script, 0o755)


def test_cred_helpers_win_over_auths(tmp_path: Path) -> None:
    _helper(tmp_path, "gs", "helper-user", "helper-pw")
    src = _sources(tmp_path, {"credHelpers": {"reg.example": "gs"}, "auths": {"reg.example": {"auth": _b64("x:y")}}})
    creds = find_credentials("reg.example", src)
    assert (creds.username, creds.password) == ("helper-user", "helper-pw")  # type: ignore[union-attr]


def test_creds_store_and_token_username(tmp_path: Path) -> None:
    _helper(tmp_path, "store", "<token>", "refresh")
    src = _sources(tmp_path, {"credsStore": "store"})
    assert find_credentials("reg.example", src).identity_token == "refresh"  # type: ignore[union-attr]


def test_missing_helper_is_a_clear_error(tmp_path: Path) -> None:
    src = _sources(tmp_path, {"credHelpers": {"reg.example": "absent"}})
    with pytest.raises(RegistryError, match="not installed"):
        find_credentials("reg.example", src)


def test_containers_auth_json_is_the_fallback(tmp_path: Path) -> None:
    src = _sources(tmp_path, {"auths": {"other": {"auth": _b64("a:b")}}}, {"auths": {"reg.example/ns": {"auth": _b64("carol:pw")}}})
    assert find_credentials("reg.example", src).username == "carol"  # type: ignore[union-attr]
    assert find_credentials("nowhere", src) is None


def test_malformed_files(tmp_path: Path) -> None:
    src = _sources(tmp_path, {"auths": {"reg.example": {"auth": "!!!notbase64"}}})
    with pytest.raises(UsageError, match="base64"):
        find_credentials("reg.example", src)
    (tmp_path / "docker.json").write_text("{broken")
    with pytest.raises(UsageError, match="unreadable"):
        find_credentials("reg.example", src)


def test_default_sources_follow_the_environment(tmp_path: Path) -> None:
    s = AuthSources.default({"HOME": str(tmp_path), "DOCKER_CONFIG": str(tmp_path / "d"), "REGISTRY_AUTH_FILE": str(tmp_path / "a.json")})
    assert s.docker_config == tmp_path / "d" / "config.json"
    assert s.containers_auth[0] == tmp_path / "a.json"
    assert s.containers_auth[-1] == tmp_path / ".config" / "containers" / "auth.json"


@pytest.mark.parametrize("text,expected", [
    ("127.0.0.1:5100/gs-pkg/ck:v1", ("127.0.0.1:5100", "gs-pkg/ck", "v1", None)),
    ("localhost/a", ("localhost", "a", "latest", None)),
    ("busybox", ("docker.io", "library/busybox", "latest", None)),
    ("reg.io/a/b@sha256:" + "a" * 64, ("reg.io", "a/b", None, "sha256:" + "a" * 64)),
])
def test_remote_reference_parsing(text: str, expected: tuple) -> None:
    r = RemoteRef.parse(text)
    assert (r.registry, r.repository, r.tag, r.digest) == expected


@pytest.mark.parametrize("bad", ["reg.io/UPPER", "reg.io/a:b:c", "reg.io/a@sha256:short", "reg.io/a\n"])
def test_bad_remote_references(bad: str) -> None:
    with pytest.raises(UsageError):
        RemoteRef.parse(bad)
