"""The two settings the passthrough path needs (``runc``, ``run_dir``), read without gpusnap.config.

``gpusnap.config`` builds on dataclasses and pathlib, about 14 ms of imports measured with
``python -X importtime``; the passthrough path must stay within a few milliseconds of runc, so it
reads the same sources with the same precedence (environment over config file over default)
itself. Any problem with the file is left to :func:`gpusnap.config.load_settings`, which
reports it properly.
"""

from __future__ import annotations

import os
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Mapping

DEFAULT_CONFIG_FILE = "/etc/gpusnap/config.toml"
DEFAULT_RUN_DIR = "/run/gpusnap"
_ENV = {"runc": "GPUSNAP_RUNC", "run_dir": "GPUSNAP_RUN_DIR"}


def fast_settings(env: Mapping[str, str]) -> dict[str, str | None]:
    """``{"runc": path or None, "run_dir": path}`` from GPUSNAP_* variables and the config file."""
    values: dict[str, str | None] = {"runc": None, "run_dir": DEFAULT_RUN_DIR}
    path = env.get("GPUSNAP_CONFIG") or DEFAULT_CONFIG_FILE
    if os.path.isfile(path):
        from gpusnap.config import load_settings  # the file may be malformed: let it say how

        settings = load_settings(env)
        values = {"runc": settings.runc, "run_dir": str(settings.run_dir)}
    for key, var in _ENV.items():
        if env.get(var):
            values[key] = env[var]
    return values
