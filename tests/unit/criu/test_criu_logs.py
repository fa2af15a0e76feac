"""CRIU's first error, read from the logs runc has it write (gpusnap.criu.logs)."""

from __future__ import annotations

from pathlib import Path

from gpusnap.criu.logs import first_error

RESTORE_LOG = """\
(00.101034) Forking task with 1 pid (flags 0x6c028000)
(00.102402) Running setup-namespaces scripts
(00.197097)      1: Error (criu/cgroup.c:1187): cg: Can't move 1 into unified//process_api/c1/cgroup.procs (-1/-1): No such file or directory
(00.197100)      1: Error (criu/cgroup.c:1300): cg: Can't move into unified//process_api/c1/cgroup.procs (-1/-1): No such file or directory
(00.197633) Error (criu/cr-restore.c:2331): Restoring FAILED.
"""


def test_the_first_error_is_the_cause(tmp_path: Path) -> None:
    (tmp_path / "restore.log").write_text(RESTORE_LOG)
    assert first_error(tmp_path) == "cg: Can't move 1 into unified//process_api/c1/cgroup.procs (-1/-1): No such file or directory"


def test_consequences_and_rlimit_lines_are_not_causes(tmp_path: Path) -> None:
    (tmp_path / "dump.log").write_text("(00.1) Error (criu/util.c:1): Can't set RLIMIT_NOFILE\n"
                                       "(00.2) Error (criu/cr-dump.c:2): Dumping FAILED.\n")
    assert first_error(tmp_path) is None
    assert first_error(tmp_path / "missing") is None


def test_a_failed_restore_through_the_runtime_names_criu_s_cause(tmp_path: Path) -> None:
    from gpusnap.checkpoint.runtime_steps import RuncFailed

    (tmp_path / "restore.log").write_text(RESTORE_LOG)
    err = RuncFailed("runc restore", 1, tmp_path)
    assert str(err) == ("runc restore exited with status 1 (CRIU: cg: Can't move 1 into unified//process_api/c1/cgroup.procs "
                        "(-1/-1): No such file or directory)")
    assert int(err.exit_code) == 1
    assert str(RuncFailed("runc restore", 1, tmp_path / "none")) == "runc restore exited with status 1"
