"""Finding the real runc on fake PATH trees (real files, real stat/realpath)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpusnap.errors import ExitCode, MissingDependencyError
from gpusnap.runc.invoke import find_runc
from gpusnap.runtime_shim.fastconfig import fast_settings


def _exe(path: Path, body: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(0o755)
    return path


def test_skips_itself_on_path(tmp_path: Path) -> None:
    shim = _exe(tmp_path / "venv" / "gpusnap-runtime")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "runc").symlink_to(shim)
    real = _exe(tmp_path / "b" / "runc")
    env = {"PATH": f"{tmp_path / 'a'}:{tmp_path / 'b'}"}
    assert find_runc(None, env, str(tmp_path / "a" / "runc")) == str(real)
    # Called by its bare name, the shim is found on PATH and still skipped.
    assert find_runc(None, env, "runc") == str(real)


def test_configured_runc_wins(tmp_path: Path) -> None:
    mine = _exe(tmp_path / "opt" / "runc-1.2")
    _exe(tmp_path / "bin" / "runc")
    assert find_runc(str(mine), {"PATH": str(tmp_path / "bin")}, "/x/gpusnap-runtime") == str(mine)


@pytest.mark.parametrize("configured", [None, "/nonexistent/runc"])
def test_missing_runc_names_the_fix(tmp_path: Path, configured: str | None) -> None:
    with pytest.raises(MissingDependencyError) as err:
        find_runc(configured, {"PATH": str(tmp_path)}, "/x/gpusnap-runtime")
    assert err.value.exit_code == ExitCode.MISSING_DEPENDENCY and "install runc" in str(err.value)


def test_non_executable_is_not_runc(tmp_path: Path) -> None:
    (tmp_path / "runc").write_text("not executable")
    with pytest.raises(MissingDependencyError):
        find_runc(None, {"PATH": str(tmp_path)}, "/x/gpusnap-runtime")


def test_fast_settings_precedence(tmp_path: Path) -> None:
    conf = tmp_path / "config.toml"
    conf.write_text('runc = "/from/file/runc"\nrun_dir = "/from/file/run"\n')
    assert fast_settings({"GPUSNAP_CONFIG": str(conf)}) == {"runc": "/from/file/runc", "run_dir": "/from/file/run"}
    assert fast_settings({"GPUSNAP_CONFIG": str(conf), "GPUSNAP_RUNC": "/env/runc"})["runc"] == "/env/runc"
    assert fast_settings({"GPUSNAP_CONFIG": str(tmp_path / "none.toml")}) == {"runc": None, "run_dir": "/run/gpusnap"}


def test_passthrough_imports_only_the_standard_library(tmp_path: Path) -> None:
    """`gpusnap-runtime list` must not load third-party or heavy modules before exec."""
    import subprocess
    import sys

    probe = (
        "import sys, os\n"
        "import gpusnap.runtime_shim.main as m\n"
        "os.execv = lambda *a: (print(' '.join(sorted(sys.modules))), sys.exit(0))\n"
        "sys.argv = ['gpusnap-runtime', 'list']\n"
        "m.main()\n"
    )
    _exe(tmp_path / "runc")
    env = {**os.environ, "PATH": str(tmp_path), "GPUSNAP_CONFIG": str(tmp_path / "none.toml")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout.split()
    assert "gpusnap.runtime_shim.main" in out
    for heavy in ("jsonschema", "typer", "rich", "docker", "dataclasses", "gpusnap.config", "gpusnap.errors", "subprocess", "shutil", "signal", "enum", "typing", "re"):
        assert heavy not in out


def test_features_fallback_when_runc_lacks_it(tmp_path: Path) -> None:
    """An old runc answers `features` with urfave/cli's unknown-command text: the shim answers instead."""
    import json
    import subprocess
    import sys

    _exe(tmp_path / "runc", "#!/bin/sh\necho \"No help topic for 'features'\" >&2\nexit 3\n")
    env = {**os.environ, "PATH": str(tmp_path), "GPUSNAP_CONFIG": str(tmp_path / "none.toml"), "GPUSNAP_RUN_DIR": str(tmp_path / "run")}
    proc = subprocess.run([sys.executable, "-m", "gpusnap.runtime_shim.main", "features"], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ociVersionMin"] == "1.0.0" and "prestart" in doc["hooks"] and doc["annotations"]["io.gpusnap.runtime.features"] == "fallback"
    # Any other failure of runc's stays runc's.
    _exe(tmp_path / "runc", "#!/bin/sh\necho 'permission denied' >&2\nexit 9\n")
    proc = subprocess.run([sys.executable, "-m", "gpusnap.runtime_shim.main", "features"], capture_output=True, text=True, env=env, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (9, "", "permission denied\n")


def test_create_undoes_its_edits_when_runc_cannot_start(tmp_path: Path) -> None:
    """exec of runc failing (a broken runc) leaves config.json and the run dir as they were."""
    import json
    import subprocess
    import sys

    _exe(tmp_path / "bin" / "runc", "#!/nonexistent/interpreter\n")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    config = bundle / "config.json"
    config.write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"cwd": "/", "args": ["true"]}}))
    before = config.read_bytes()
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "GPUSNAP_CONFIG": str(tmp_path / "none.toml"), "GPUSNAP_RUN_DIR": str(tmp_path / "run")}
    proc = subprocess.run([sys.executable, "-m", "gpusnap.runtime_shim.main", "create", "--bundle", str(bundle), "c1"], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("gpusnap-runtime: exec runc failed:") and "rolled back" in proc.stderr
    assert config.read_bytes() == before
    assert list((tmp_path / "run").rglob("*.conf")) == []


def test_runc_starts_with_default_signal_dispositions(tmp_path: Path) -> None:
    """Python ignores SIGPIPE/SIGXFSZ; runc exec'd by the shim must not inherit that."""
    import subprocess
    import sys

    runc = _exe(tmp_path / "runc", "#!/bin/sh\nPATH=/usr/bin:/bin grep SigIgn /proc/$$/status\n")
    env = {**os.environ, "PATH": str(tmp_path), "GPUSNAP_CONFIG": str(tmp_path / "none.toml")}
    direct = subprocess.run([str(runc)], capture_output=True, text=True, env=env, check=True).stdout
    via_shim = subprocess.run([sys.executable, "-m", "gpusnap.runtime_shim.main", "list"], capture_output=True, text=True, env=env, check=True).stdout
    assert via_shim == direct
