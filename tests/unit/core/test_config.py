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


def test_store_workers_takes_auto_or_a_count_and_refuses_the_rest(tmp_path):
    absent = tmp_path / "none.toml"
    assert load_settings(env={}, config_file=absent).store_workers is None
    assert load_settings(env={"GPUSNAP_STORE_WORKERS": "auto"}, config_file=absent).store_workers is None
    assert load_settings(env={"GPUSNAP_STORE_WORKERS": "4"}, config_file=absent).store_workers == 4
    cfg = tmp_path / "c.toml"
    cfg.write_text("store_workers = 6\n")
    assert load_settings(env={}, config_file=cfg).store_workers == 6
    for bad in ("0", "257", "-2", "many"):
        with pytest.raises(UsageError, match="store_workers must be auto or a whole number from 1 to 256"):
            load_settings(env={"GPUSNAP_STORE_WORKERS": bad}, config_file=absent)


def test_criu_log_dir_is_an_absolute_path_or_nothing(tmp_path):
    absent = tmp_path / "none.toml"
    assert load_settings(env={}, config_file=absent).criu_log_dir is None
    assert load_settings(env={"GPUSNAP_CRIU_LOG_DIR": ""}, config_file=absent).criu_log_dir is None
    assert load_settings(env={"GPUSNAP_CRIU_LOG_DIR": "/var/log/gpusnap"}, config_file=absent).criu_log_dir == Path("/var/log/gpusnap")
    cfg = tmp_path / "c.toml"
    cfg.write_text('criu_log_dir = "/srv/criu-logs"\n')
    assert load_settings(env={}, config_file=cfg).criu_log_dir == Path("/srv/criu-logs")
    with pytest.raises(UsageError, match="criu_log_dir must be an absolute path"):
        load_settings(env={"GPUSNAP_CRIU_LOG_DIR": "logs"}, config_file=absent)
