"""CRIU version parsing and checks, against small executable stand-ins for the criu binary."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.config import HostPaths, Settings
from gpusnap.criu.locate import find_criu, parse_version, probe_criu
from gpusnap.errors import MissingDependencyError


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("Version: 4.1.1\n", (4, 1, 1)),
        ("Version: 4.0\nGitID: v4.0-12-gdeadbee\n", (4, 0, 0)),
        ("Warn: something\nVersion: 3.17.1\n", (3, 17, 1)),
        ("criu: command not found\n", None),
        ("", None),
    ],
)
def test_parse_version(text: str, version: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == version


def _criu(tmp_path: Path, version: str = "4.1.1", check: str = "ok") -> Path:
    counter = tmp_path / "check-runs"
    body = {
        "ok": f"echo run >> {counter}; echo 'Looks good.'",
        "fail": "echo 'Error (criu/cr-check.c:1): Kernel lacks seccomp' >&2; exit 1",
    }[check]
    path = tmp_path / "criu"
    path.write_text(f'#!/bin/sh\ncase "$1" in --version) echo "Version: {version}";; check) {body};; esac\n')
    path.chmod(0o755)
    return path


def _settings(tmp_path: Path, criu: Path | str | None) -> Settings:
    proc = tmp_path / "root" / "proc" / "sys" / "kernel" / "random"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "boot_id").write_text("boot-1\n")
    return Settings(host=HostPaths(tmp_path / "root"), run_dir=tmp_path / "run", criu=None if criu is None else str(criu))


def test_finds_checks_once_per_boot(tmp_path: Path) -> None:
    criu = _criu(tmp_path)
    settings = _settings(tmp_path, criu)
    info = find_criu(settings)
    assert info.version == (4, 1, 1) and info.version_text == "4.1.1" and info.path == str(criu)
    find_criu(settings)
    assert (tmp_path / "check-runs").read_text().count("run") == 1  # cached
    (tmp_path / "root/proc/sys/kernel/random/boot_id").write_text("boot-2\n")
    find_criu(settings)
    assert (tmp_path / "check-runs").read_text().count("run") == 2  # a new boot checks again


def test_found_on_path(tmp_path: Path) -> None:
    criu = _criu(tmp_path)
    assert find_criu(_settings(tmp_path, None), env_path=str(tmp_path)).path == str(criu)


@pytest.mark.parametrize(
    ("setup", "expect"),
    [
        (lambda p: p / "missing" / "criu", "CRIU not found at"),
        (lambda p: _criu(p, version="3.17.1"), "is 3.17.1, gpusnap needs 4.0 or newer"),
        (lambda p: _criu(p, check="fail"), "Kernel lacks seccomp"),
    ],
)
def test_unusable_criu_names_the_fix(tmp_path: Path, setup, expect: str) -> None:
    with pytest.raises(MissingDependencyError) as err:
        find_criu(_settings(tmp_path, setup(tmp_path)))
    assert expect in str(err.value) and "install CRIU 4.x" in str(err.value)
    assert "\n" not in str(err.value)


def test_not_on_path(tmp_path: Path) -> None:
    with pytest.raises(MissingDependencyError, match="not found on PATH"):
        find_criu(_settings(tmp_path, None), env_path=str(tmp_path / "empty"))


def test_probe_describes_instead_of_raising(tmp_path: Path) -> None:
    """doctor and the host facts ask the same locator as checkpoint, and get a description."""
    assert probe_criu(_settings(tmp_path, None), env_path=str(tmp_path / "empty")) == (None, "")
    assert probe_criu(_settings(tmp_path, _criu(tmp_path, version="3.17.1"))) == (str(tmp_path / "criu"), "3.17.1")
    broken = tmp_path / "broken" / "criu"
    broken.parent.mkdir()
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    assert probe_criu(_settings(tmp_path, broken)) == (str(broken), "")
    assert not (tmp_path / "check-runs").exists()  # no `criu check`: a probe only reads the version


def test_version_is_asked_once_per_binary_and_boot(tmp_path: Path) -> None:
    runs = tmp_path / "version-runs"
    path = tmp_path / "criu"

    def write(version: str) -> None:
        path.write_text(f'#!/bin/sh\ncase "$1" in --version) echo run >> {runs}; echo "Version: {version}";; check) echo ok;; esac\n')
        path.chmod(0o755)

    write("4.1.1")
    s = _settings(tmp_path, path)
    assert find_criu(s).version == (4, 1, 1)
    assert find_criu(s).version == (4, 1, 1) and probe_criu(s) == (str(path), "4.1.1")
    assert runs.read_text().count("run") == 1
    import os

    write("4.2.0")  # another binary at the same path: asked again
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert find_criu(s).version == (4, 2, 0) and runs.read_text().count("run") == 2


def test_an_unwritable_cache_still_answers(tmp_path: Path) -> None:
    path = _criu(tmp_path)
    s = _settings(tmp_path, path)
    s.run_dir.mkdir(parents=True, exist_ok=True)
    (s.run_dir / "criu").write_text("not a directory")  # the cache cannot be written there
    assert probe_criu(s) == (str(path), "4.1.1")
