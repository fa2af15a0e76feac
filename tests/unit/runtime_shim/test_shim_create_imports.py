"""What `gpusnap-runtime create` loads before it execs runc: every container start pays for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = (
    "import sys, os\n"
    "import gpusnap.runtime_shim.main as m\n"
    "os.execv = lambda *a: (print(' '.join(sorted(sys.modules))), sys.stdout.flush(), os._exit(0))\n"
    "sys.argv = ['gpusnap-runtime', 'create', '--bundle', sys.argv[1], 'c1']\n"
    "sys.exit(m.main())\n"
)


def _create_modules(tmp_path: Path, gpu_env: list[str] | None = None, extra_env: dict[str, str] | None = None) -> list[str]:
    runc = tmp_path / "bin" / "runc"
    runc.parent.mkdir(exist_ok=True)
    runc.write_text("#!/bin/sh\nexit 0\n")
    runc.chmod(0o755)
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    spec = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"cwd": "/", "args": ["true"], "env": ["PATH=/bin", *(gpu_env or [])]}}
    (bundle / "config.json").write_text(json.dumps(spec))
    env = {**os.environ, "PATH": str(runc.parent), "GPUSNAP_CONFIG": str(tmp_path / "none.toml"), "GPUSNAP_RUN_DIR": str(tmp_path / "run"), **(extra_env or {})}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(bundle)], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_create_imports_no_heavy_modules(tmp_path: Path) -> None:
    first = _create_modules(tmp_path)  # generates the validator module under the run dir
    assert "gpusnap.ocispec.spec" in first and list((tmp_path / "run" / "schema").rglob("*.py"))
    loaded = _create_modules(tmp_path)
    assert "gpusnap.runtime_shim.intercept" in loaded and any(m.startswith("_gpusnap_schema_config_") for m in loaded)
    for heavy in ("jsonschema", "fastjsonschema", "typer", "rich", "docker", "typing", "hashlib", "ast", "dis", "tokenize", "ipaddress", "gpusnap.ocispec.gpu_modifiers", "gpusnap.gpu.discovery", "gpusnap.checkpoint.runtime_steps"):
        assert heavy not in loaded, heavy
    # dataclasses imports inspect (with ast, dis, tokenize) only to write docstrings gpusnap's
    # records carry, pathlib urllib.parse (with ipaddress) only for as_uri: the shim defers both
    # (gpusnap.runtime_shim.lazy).


def test_gpu_create_imports_no_third_party_validation_or_cli(tmp_path: Path) -> None:
    """A GPU container (fake NVIDIA host tree) loads the GPU modules, and still no jsonschema."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("the fake GPU tree needs mknod (root)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from fake_gpu_tree import make_nvidia_tree

    make_nvidia_tree(tmp_path / "host")
    hook = tmp_path / "bin" / "gpusnap-hook"
    hook.parent.mkdir()
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o755)
    extra = {"GPUSNAP_ROOT": str(tmp_path / "host"), "GPUSNAP_HOOK": str(hook)}
    _create_modules(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"], extra)
    loaded = _create_modules(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"], extra)
    assert "gpusnap.ocispec.gpu_modifiers" in loaded and "gpusnap.gpu.discovery" in loaded
    for heavy in ("jsonschema", "fastjsonschema", "typer", "rich", "docker", "gpusnap.checkpoint.runtime_steps"):
        assert heavy not in loaded, heavy
