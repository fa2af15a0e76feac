import os
import signal

import pytest

from gpusnap.errors import ExitCode, NotFoundError
from gpusnap.steps import Interrupted, Step, StepFailed, run_steps, signals_as_exceptions


def recorder():
    log: list[str] = []

    def step(name: str, fail: bool = False, undo_fails: bool = False, undoable: bool = True) -> Step:
        def do() -> str:
            log.append(f"do {name}")
            if fail:
                raise RuntimeError(f"{name} broke")
            return name.upper()

        def undo() -> None:
            log.append(f"undo {name}")
            if undo_fails:
                raise OSError(f"cannot undo {name}")

        return Step(name, do, undo if undoable else None)

    return log, step


def test_all_steps_run_in_order_and_are_timed():
    log, step = recorder()
    records = run_steps([step("a"), step("b")], clock=iter([0.0, 1.5, 2.0, 2.25]).__next__)
    assert log == ["do a", "do b"]
    assert [(r.name, r.seconds, r.result) for r in records] == [("a", 1.5, "A"), ("b", 0.25, "B")]


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_failure_undoes_completed_steps_newest_first(failing):
    log, step = recorder()
    steps = [step(n, fail=(i == failing)) for i, n in enumerate("abc")]
    with pytest.raises(StepFailed) as info:
        run_steps(steps)
    done = list("abc")[:failing]
    assert log == [f"do {n}" for n in done] + [f"do {'abc'[failing]}"] + [f"undo {n}" for n in reversed(done)]
    assert info.value.step == "abc"[failing]
    assert info.value.undone == list(reversed(done))
    assert "broke" in str(info.value)
    assert "\n" not in str(info.value)


def test_steps_without_undo_are_skipped_in_rollback():
    log, step = recorder()
    with pytest.raises(StepFailed):
        run_steps([step("a"), step("b", undoable=False), step("c", fail=True)])
    assert log == ["do a", "do b", "do c", "undo a"]


def test_failing_undo_does_not_stop_other_undos_and_is_reported():
    log, step = recorder()
    with pytest.raises(StepFailed) as info:
        run_steps([step("a"), step("b", undo_fails=True), step("c", fail=True)])
    assert log == ["do a", "do b", "do c", "undo b", "undo a"]
    assert info.value.exit_code == ExitCode.ROLLBACK_FAILED
    assert "rollback incomplete" in str(info.value) and "cannot undo b" in str(info.value)


def test_exit_code_of_a_gpusnap_cause_is_kept():
    def missing() -> None:
        raise NotFoundError("no such container x; list them with gpusnap ps")

    with pytest.raises(StepFailed) as info:
        run_steps([Step("find", missing)])
    assert info.value.exit_code == ExitCode.NOT_FOUND


def test_a_signal_mid_sequence_rolls_back():
    log, step = recorder()

    def sigterm_self() -> None:
        log.append("do kill")
        os.kill(os.getpid(), signal.SIGTERM)

    with signals_as_exceptions():
        with pytest.raises(StepFailed) as info:
            run_steps([step("a"), Step("kill", sigterm_self), step("never")])
    assert isinstance(info.value.cause, Interrupted)
    assert "SIGTERM" in str(info.value)
    assert log == ["do a", "do kill", "undo a"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_process_age_reads_the_kernels_start_time(tmp_path):
    from gpusnap.steps import process_age_s

    age = process_age_s()
    assert age is not None and 0 <= age < 3600
    fake = tmp_path / "self"
    fake.mkdir()
    ticks = os.sysconf("SC_CLK_TCK")
    import time

    # A command name with spaces and ')' must not shift the fields; started 2 s ago.
    started = int((time.clock_gettime(time.CLOCK_BOOTTIME) - 2.0) * ticks)
    fields = ["S"] + ["0"] * 18 + [str(started)] + ["0"] * 10
    (fake / "stat").write_text(f"4242 (odd ) name) {' '.join(fields)}\n")
    assert 1.9 <= process_age_s(str(tmp_path)) <= 2.5
    (fake / "stat").write_text("garbage")
    assert process_age_s(str(tmp_path)) is None
    assert process_age_s(str(tmp_path / "missing")) is None
