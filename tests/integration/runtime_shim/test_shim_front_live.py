"""bin/gpusnap-runtime, the sh front, with the real runc: passthrough calls never start Python,
create goes through the Python shim (its spec modifiers), and the container behaves as under runc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shimstack import RUNC, Shim, run, unique

from stack.proc import HOST_PATH
from stack.shim import busybox_bundle

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]

FRONT_SRC = Path(__file__).resolve().parents[3] / "bin" / "gpusnap-runtime"


def test_passthrough_without_python_create_through_it(shim: Shim, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    front = bin_dir / "gpusnap-runtime"
    front.write_bytes(FRONT_SRC.read_bytes())
    front.chmod(0o755)
    log = tmp_path / "python-calls"
    # The real launcher's lines plus one that records each call that reached Python.
    (bin_dir / "gpusnap-runtime-py").write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "from gpusnap.runtime_shim.main import main\n"
        "sys.exit(main())\n"
    )
    (bin_dir / "gpusnap-runtime-py").chmod(0o755)
    env = {**shim.env(), "PATH": HOST_PATH, "PYTHONPATH": os.pathsep.join(sys.path)}
    bundle = busybox_bundle(tmp_path / "c", ["sh", "-c", "echo hi; exec sleep 1000"])
    cid = unique("front")
    root = ["--root", str(bundle.root)]
    spec_before = bundle.config()
    try:
        # The container keeps create's stdio: a file, not a pipe that would never reach EOF.
        with open(tmp_path / "container.out", "wb") as out:
            created = subprocess.run([str(front), *root, "create", "--bundle", str(bundle.path), cid], env=env,
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=60, check=False)
        assert created.returncode == 0, (tmp_path / "container.out").read_text()
        assert log.read_text().splitlines() == [f"--root {bundle.root} create --bundle {bundle.path} {cid}"]
        assert bundle.config() != spec_before  # the spec modifiers ran (create is gpusnap's)
        run([str(front), *root, "start", cid], env=env)
        via_front = json.loads(run([str(front), *root, "--log", str(tmp_path / "runc.log"), "--log-format", "json", "state", cid], env=env).stdout)
        via_runc = json.loads(run([RUNC, *root, "state", cid]).stdout)
        assert via_front == via_runc and via_front["status"] == "running"
        assert run([str(front), *root, "ps", "--format", "json", cid], env=env).stdout == run([RUNC, *root, "ps", "--format", "json", cid]).stdout
        run([str(front), *root, "kill", cid, "KILL"], env=env)
        criu_conf = shim.run_dir / "criu" / f"{cid}.conf"
        assert criu_conf.is_file()  # create's CRIU config, which delete drops
        run([str(front), *root, "delete", "--force", cid], env=env)
        assert run([RUNC, *root, "state", cid], check=False).returncode != 0
        assert not criu_conf.exists()
        # Only create started Python; runc's own errors come through unchanged.
        assert len(log.read_text().splitlines()) == 1
        assert (tmp_path / "container.out").read_text() == "hi\n"
        missing = run([str(front), *root, "state", cid], check=False, env=env)
        direct = run([RUNC, *root, "state", cid], check=False)
        assert (missing.returncode, missing.stdout) == (direct.returncode, direct.stdout) and missing.returncode != 0
        assert len(log.read_text().splitlines()) == 1
    finally:
        run([RUNC, *root, "delete", "--force", cid], check=False)
