from pathlib import Path

import pytest

from gpusnap.config import HostPaths, load_settings
from gpusnap.errors import ExitCode, UsageError


def test_defaults_without_file_or_env(tmp_path):
    s = load_settings(env={}, config_file=tmp_path / "absent.toml")
    assert s.host == HostPaths(Path("/"))
    assert s.run_dir == Path("/run/gpusnap")
    assert s.store_dir == Path("/var/lib/gpusnap/store")
    assert s.gpu_backend == "auto"


def test_file_then_env_then_overrides(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('runc = "/opt/runc"\nroot = "/fake"\nstate_dir = "/srv/gs"\nlock_timeout_ms = 500\n')
    s = load_settings(env={"GPUSNAP_RUNC": "/env/runc"}, config_file=cfg)
    assert s.runc == "/env/runc"
    assert s.host.dev == Path("/fake/dev") and s.host.proc == Path("/fake/proc")
    assert s.state_dir == Path("/srv/gs") and s.store_dir == Path("/srv/gs/store")
    assert s.lock_timeout_ms == 500
    s2 = load_settings(env={"GPUSNAP_RUNC": "/env/runc"}, config_file=cfg, runc="/arg/runc", host=Path("/other"))
    assert s2.runc == "/arg/runc" and s2.host.root == Path("/other")


def test_config_file_named_by_env(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('gpu_backend = "none"\n')
    assert load_settings(env={"GPUSNAP_CONFIG": str(cfg)}).gpu_backend == "none"


@pytest.mark.parametrize(
    "text, fragment",
    [("runc = ", "not valid TOML"), ('bogus = 1\n', "unknown setting(s) bogus"), ("lock_timeout_ms = 'x'\n", "whole number")],
)
def test_bad_config_file_is_one_line_usage_error(tmp_path, text, fragment):
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    with pytest.raises(UsageError) as info:
        load_settings(env={}, config_file=cfg)
    assert fragment in str(info.value) and str(cfg) in str(info.value)
    assert "\n" not in str(info.value)
    assert info.value.exit_code == ExitCode.USAGE
