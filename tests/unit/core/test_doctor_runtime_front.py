"""doctor checks that the sh front has its Python shim beside it (real files)."""

from __future__ import annotations

from pathlib import Path

from gpusnap.admin.doctor import FAIL, OK, _front_check

REPO = Path(__file__).resolve().parents[3]


def _exe(path: Path, body: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)
    path.chmod(0o755)
    return path


def test_front_without_its_python_shim_fails_with_the_fix(tmp_path: Path) -> None:
    front = _exe(tmp_path / "bin" / "gpusnap-runtime", (REPO / "bin" / "gpusnap-runtime").read_bytes())
    check = _front_check(front)
    assert check.status == FAIL and "gpusnap-runtime-py" in check.detail and "reinstall" in check.fix
    _exe(tmp_path / "bin" / "gpusnap-runtime-py", b"#!/usr/bin/python3\n")
    assert _front_check(front).status == OK
    # Reached through a link from elsewhere: the shim beside the link's target counts.
    link = tmp_path / "other" / "gpusnap-runtime"
    link.parent.mkdir()
    link.symlink_to(front)
    assert _front_check(link).status == OK


def test_a_python_launcher_needs_nothing_beside_it(tmp_path: Path) -> None:
    launcher = _exe(tmp_path / "gpusnap-runtime", (REPO / "bin" / "gpusnap-runtime-py").read_bytes())
    assert _front_check(launcher).status == OK
