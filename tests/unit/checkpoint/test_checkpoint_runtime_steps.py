"""The checkpoint/restore flows' use of steps, with a stand-in runc and CRIU (executable scripts).

The real runc and CRIU run in tests/integration; here a script that records its command line
stands in so the order of the GPU plan's steps, rollback and exit codes can be checked exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpusnap.checkpoint.runtime_steps import RuncCall, checkpoint, failure_exit_code, restore
from gpusnap.config import HostPaths, Settings
from gpusnap.errors import ExitCode, UnsupportedError
from gpusnap.gpu.base import ContainerRef
from gpusnap.metadata import CheckpointMetadata
from gpusnap.runc.argv import parse
from gpusnap.steps import Step, StepFailed

FAKE_RUNC = """#!/bin/sh
echo "$* PATH=$PATH" >> {log}
case " $* " in
  *" --version "*) echo "runc version 9.9.9";;
  *" state "*) [ -e {tmp}/gone ] && exit 1; echo '{{"id":"c1","status":"'"$(cat {tmp}/status 2>/dev/null || echo running)"'","pid":4242,"bundle":"{tmp}","annotations":'"$(cat {tmp}/annotations.json 2>/dev/null || echo '{{}}')"'}}';;
  *" checkpoint "*) env | grep '^KFD_' | sort > {tmp}/criu-env.checkpoint; [ -n "$FAKE_RC" ] && {{ echo "runc: checkpoint failed" >&2; exit $FAKE_RC; }}; touch {tmp}/gone;;
  *" restore "*) env | grep '^KFD_' | sort > {tmp}/criu-env.restore; [ -e {run}/restoring/c1 ] && {{ echo marker-present >> {log}; mkdir -p {run}/restore-hooks; echo '{{"stage": "prestart", "seconds": 0.05}}' >> {run}/restore-hooks/c1; }}; [ -n "$FAKE_RC" ] && exit $FAKE_RC; rm -f {tmp}/gone;;
  *" delete "*) touch {tmp}/gone;;
  *" pause "*) echo paused > {tmp}/status; echo "EVENT pause" >> {tmp}/events;;
  *" resume "*) echo running > {tmp}/status; echo "EVENT resume" >> {tmp}/events;;
esac
"""


class RecordingPlan:
    def __init__(self, events: list[str], fail_after_restore: bool = False) -> None:
        self.events = events
        self.fail_after_restore = fail_after_restore

    def _step(self, name: str, undo: bool = True) -> Step:
        return Step(name, lambda: self.events.append(name), (lambda: self.events.append(f"undo {name}")) if undo else None)

    def dump_failure(self, ref: ContainerRef, criu_error: str | None) -> Exception | None:
        self.events.append(f"dump failed: {criu_error}")
        return None

    def before_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata) -> list[Step]:
        self.events.append(f"pids {ref.init_pid}")
        return [self._step("gpu lock"), self._step("gpu checkpoint")]

    def after_dump(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata, leave_running: bool) -> list[Step]:
        return [self._step(f"gpu after dump leave_running={leave_running}")]

    def before_restore(self, image_dir: Path, meta: CheckpointMetadata | None, ref: ContainerRef | None = None) -> list[Step]:
        name = f"gpu host check meta={meta is not None}"

        def check() -> None:
            assert ref is not None  # the flow hands the plan its ContainerRef
            gpus = ref.annotations.get("gpusnap.io/assigned-gpus")
            self.events.append(name + (f" gpus={gpus}" if gpus else ""))

        return [Step(name, check, lambda: self.events.append(f"undo {name}"))]

    def after_restore(self, ref: ContainerRef, image_dir: Path, meta: CheckpointMetadata | None) -> list[Step]:
        def do() -> None:
            self.events.append(f"gpu restore pid {ref.init_pid}")
            if self.fail_after_restore:
                raise RuntimeError("device restore failed")

        return [Step("gpu restore", do)]


@pytest.fixture
def rig(tmp_path: Path):
    log = tmp_path / "runc.log"
    run_dir = tmp_path / "run"
    runc = tmp_path / "bin" / "runc"
    runc.parent.mkdir()
    runc.write_text(FAKE_RUNC.format(log=log, tmp=tmp_path, run=run_dir))
    runc.chmod(0o755)
    criu = tmp_path / "criu-bin" / "criu"
    criu.parent.mkdir()
    criu.write_text('#!/bin/sh\ncase "$1" in --version) echo "Version: 4.1.1";; check) echo "Looks good.";; esac\n')
    criu.chmod(0o755)
    settings = Settings(host=HostPaths(tmp_path / "host"), run_dir=run_dir, criu=str(criu))

    def call(argv: list[str], **env: str) -> RuncCall:
        return RuncCall(runc=str(runc), inv=parse(argv), env={"PATH": "/usr/bin:/bin", **env}, cwd=tmp_path)

    return settings, call, log, criu


def test_checkpoint_runs_plan_around_runc(rig, tmp_path: Path) -> None:
    settings, call, log, criu = rig
    events: list[str] = []
    assert checkpoint(call(["--root", "/r", "checkpoint", "--leave-running", "--image-path", "img", "c1"]), settings, RecordingPlan(events)) == 0
    assert events == ["pids 4242", "gpu lock", "gpu checkpoint", "gpu after dump leave_running=True"]
    dump = [ln for ln in log.read_text().splitlines() if " checkpoint " in f" {ln} "][0]
    assert dump.startswith(f"--criu {criu} --root /r checkpoint --leave-running --image-path img c1 PATH={criu.parent}:/usr/bin:/bin")
    meta = CheckpointMetadata.read(tmp_path / "img")
    assert meta is not None and meta.criu_version == "4.1.1" and meta.runc_version == "9.9.9" and meta.leave_running
    steps = {k for k in meta.timings_s if not k.startswith("before: ")}
    assert steps == {"gpu lock", "gpu checkpoint", "runc checkpoint", "gpu after dump leave_running=True"}
    # what came before the steps, named (the plan was given: no GPU backend to load)
    assert {k for k in meta.timings_s if k.startswith("before: ")} == {
        "before: start-up and imports", "before: runc state", "before: find CRIU", "before: metadata",
        "before: lock, look for leftovers of a killed run"}
    assert all(v >= 0 for v in meta.timings_s.values())


class ExplainingPlan(RecordingPlan):
    """A plan that can tell what the failed dump was about (as CudaPlan does for device files)."""

    def dump_failure(self, ref: ContainerRef, criu_error: str | None) -> Exception | None:
        super().dump_failure(ref, criu_error)
        return UnsupportedError("host PID 7 holds NVIDIA device files; nothing was changed")


@pytest.mark.parametrize(("plan", "runc_rc", "code"), [(RecordingPlan, "7", 7), (ExplainingPlan, "1", ExitCode.UNSUPPORTED)],
                         ids=["runc's status kept", "the plan's explanation"])
def test_failed_runc_checkpoint_rolls_back_gpu(rig, tmp_path: Path, plan: type[RecordingPlan], runc_rc: str, code: int) -> None:
    settings, call, log, _ = rig
    events: list[str] = []
    with pytest.raises(StepFailed) as err:
        checkpoint(call(["checkpoint", "--image-path", "img", "c1"], FAKE_RC=runc_rc), settings, plan(events))
    assert events == ["pids 4242", "gpu lock", "gpu checkpoint", "dump failed: None", "undo gpu checkpoint", "undo gpu lock"]
    assert failure_exit_code(err.value, ExitCode.CHECKPOINT_FAILED) == code
    assert not (tmp_path / "img" / "gpusnap.json").exists()
    if plan is ExplainingPlan:
        assert "holds NVIDIA device files" in str(err.value)


def test_unknown_container_lets_runc_answer(rig, tmp_path: Path) -> None:
    settings, call, log, _ = rig
    (tmp_path / "gone").touch()
    events: list[str] = []
    assert checkpoint(call(["checkpoint", "c1"]), settings, RecordingPlan(events)) == 0
    assert events == []  # no GPU step ran: runc itself reported on the unknown container
    assert log.read_text().splitlines()[-1].startswith("checkpoint c1 ")


def test_restore_marker_plan_order_and_ref(rig, tmp_path: Path) -> None:
    settings, call, log, _ = rig
    (tmp_path / "img").mkdir()
    CheckpointMetadata(container_id="c1", created="now").write(tmp_path / "img")
    events: list[str] = []
    spec_step = Step("spec", lambda: events.append("spec"), lambda: events.append("undo spec"))
    (tmp_path / "gone").touch()
    assert restore(call(["restore", "-d", "--image-path", "img", "c1"]), settings, [spec_step], RecordingPlan(events)) == 0
    assert events == ["spec", "gpu host check meta=True", "gpu restore pid 4242"]
    assert "marker-present" in log.read_text()
    assert not (settings.run_dir / "restoring" / "c1").exists()


def test_restore_records_its_steps_hooks_and_start_up_in_the_image_dir(rig, tmp_path: Path) -> None:
    settings, call, log, _ = rig
    (tmp_path / "img").mkdir()
    CheckpointMetadata(container_id="c1", created="now").write(tmp_path / "img")
    (settings.run_dir / "restore-hooks").mkdir(parents=True)
    (settings.run_dir / "restore-hooks" / "c1").write_text('{"stage": "prestart", "seconds": 9}\n')  # a killed restore's
    (tmp_path / "img" / "gpusnap-restore.json").write_text('{"hooks_s": {"stale": 1}, "timings_s": {"gpu_restore": 9}}')  # an earlier restore's
    events: list[str] = []
    (tmp_path / "gone").touch()
    call_ = call(["restore", "-d", "--image-path", "img", "c1"])
    assert restore(call_, settings, [Step("spec", lambda: None)], RecordingPlan(events), planned_s=0.25) == 0
    timings = json.loads((tmp_path / "img" / "gpusnap-restore.json").read_text())
    assert set(timings["steps_s"]) >= {"spec", "restore marker", "runc restore", "gpu restore", "gpu host check meta=True"}
    assert timings["hooks_s"] == {"prestart": 0.05} and "timings_s" not in timings  # this restore's only
    assert timings["before_steps_s"]["plan the spec"] == 0.25 and timings["before_steps_s"]["start-up and imports"] >= -0.25
    assert timings["total_s"] >= timings["steps_s"]["runc restore"]
    assert not (settings.run_dir / "restore-hooks" / "c1").exists()


def test_failed_after_restore_deletes_container_and_undoes(rig, tmp_path: Path) -> None:
    settings, call, log, _ = rig
    events: list[str] = []
    spec_step = Step("spec", lambda: events.append("spec"), lambda: events.append("undo spec"))
    with pytest.raises(StepFailed) as err:
        restore(call(["restore", "-d", "c1"]), settings, [spec_step], RecordingPlan(events, fail_after_restore=True))
    assert events == ["spec", "gpu host check meta=False", "gpu restore pid 4242", "undo gpu host check meta=False", "undo spec"]
    assert "delete --force c1" in log.read_text()
    assert failure_exit_code(err.value, ExitCode.RESTORE_FAILED) == ExitCode.RESTORE_FAILED
    assert not (settings.run_dir / "restoring" / "c1").exists()


def test_failed_runc_restore_keeps_runc_status(rig, tmp_path: Path) -> None:
    settings, call, log, _ = rig
    events: list[str] = []
    with pytest.raises(StepFailed) as err:
        restore(call(["restore", "-d", "c1"], FAKE_RC="5"), settings, [], RecordingPlan(events))
    assert failure_exit_code(err.value, ExitCode.RESTORE_FAILED) == 5
    assert events == ["gpu host check meta=False", "undo gpu host check meta=False"]


def test_metadata_is_json(rig, tmp_path: Path) -> None:
    settings, call, _, _ = rig
    checkpoint(call(["checkpoint", "c1"]), settings, RecordingPlan([]))
    data = json.loads((tmp_path / "checkpoint" / "gpusnap.json").read_text())
    assert data["container_id"] == "c1" and data["runtime"] == "gpusnap-runtime"


def _dev_image(path: Path, nodes: dict[str, tuple[int, int]]) -> None:
    import gzip
    import io
    import tarfile

    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, (major, minor) in nodes.items():
            ti = tarfile.TarInfo(f"./{name}")
            ti.type, ti.devmajor, ti.devminor, ti.mode = tarfile.CHRTYPE, major, minor, 0o666
            t.addfile(ti)
    path.write_bytes(buf.getvalue())


def _dev_nodes(path: Path) -> dict[str, tuple[int, int]]:
    import tarfile

    with tarfile.open(path, "r:gz") as t:
        return {m.name: (m.devmajor, m.devminor) for m in t.getmembers() if m.ischr()}


RESTORED_SPEC = {
    "annotations": {"gpusnap.io/assigned-gpus": "GPU-b", "gpusnap.io/gpu-vendor": "nvidia"},
    "linux": {"devices": [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
                          {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1, "fileMode": 438}]},
}


@pytest.mark.parametrize("runc_rc", ["", "5"])
def test_restore_gives_the_plan_the_restored_gpus_and_retargets_dev_nodes(rig, tmp_path: Path, runc_rc: str) -> None:
    """The spec the modifiers wrote names the GPUs of the restore (for the plan's pairing) and
    its nodes, which replace the checkpoint's per-GPU nodes in CRIU's /dev image before runc
    restore; a failed restore puts the image back as it was."""
    settings, call, log, _ = rig
    (tmp_path / "img").mkdir()
    CheckpointMetadata(container_id="c1", created="now").write(tmp_path / "img")
    dev = tmp_path / "img" / "tmpfs-dev-7.tar.gz.img"
    _dev_image(dev, {"nvidiactl": (195, 255), "nvidia0": (195, 0), "null": (1, 3)})
    original = dev.read_bytes()
    (tmp_path / "config.json").write_text(json.dumps(RESTORED_SPEC))
    events: list[str] = []
    seen: dict[str, dict[str, tuple[int, int]]] = {}
    spec_step = Step("spec", lambda: seen.setdefault("at spec", _dev_nodes(dev)))
    argv = ["restore", "-d", "--image-path", "img", "c1"]
    if runc_rc:
        with pytest.raises(StepFailed):
            restore(call(argv, FAKE_RC=runc_rc), settings, [spec_step], RecordingPlan(events))
        assert dev.read_bytes() == original
        assert events == ["gpu host check meta=True gpus=GPU-b", "undo gpu host check meta=True"]
        return
    assert restore(call(argv), settings, [spec_step], RecordingPlan(events)) == 0
    assert events == ["gpu host check meta=True gpus=GPU-b", "gpu restore pid 4242"]
    assert seen["at spec"] == {"./nvidiactl": (195, 255), "./nvidia0": (195, 0), "./null": (1, 3)}
    assert _dev_nodes(dev) == {"./nvidiactl": (195, 255), "./null": (1, 3), "./nvidia1": (195, 1)}
# ---- the restore flow's device retargeting and CRIU environment -----------------------------

RESTORE_SPEC = {
    "ociVersion": "1.0.2",
    "root": {"path": "rootfs"},
    "annotations": {"gpusnap.io/criu-env": '{"KFD_FW_VER_CHECK":"0","KFD_NUMA_CHECK":"0"}'},
    "linux": {"devices": [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}, {"path": "/dev/nvidia-uvm", "type": "c", "major": 240, "minor": 0}]},
}


def _checkpoint_with_dev_image(img: Path) -> Path:
    from tests.unit.gpu.test_gpu_devnodes import dev_image

    img.mkdir(exist_ok=True)
    CheckpointMetadata(container_id="c1", created="now").write(img)
    # The bundle's config.json as the spec modifiers wrote it (the flow may read it back there).
    (img.parent / "config.json").write_text(json.dumps(RESTORE_SPEC))
    dev = img / "tmpfs-dev-46.tar.gz.img"
    dev_image(dev, {"nvidiactl": (195, 255), "nvidia-uvm": (237, 0), "null": (1, 3)})
    return dev


def test_restore_retargets_dev_image_and_passes_criu_env(rig, tmp_path: Path) -> None:
    """The refreshed spec's numbers reach CRIU's /dev image before runc restore; KFD_* reach runc."""
    from tests.unit.gpu.test_gpu_devnodes import read_nodes

    settings, call, log, _ = rig
    dev = _checkpoint_with_dev_image(tmp_path / "img")
    events: list[str] = []
    (tmp_path / "gone").touch()
    assert restore(call(["restore", "-d", "--image-path", "img", "c1"], KFD_FW_VER_CHECK="1"), settings, [], RecordingPlan(events), spec=RESTORE_SPEC) == 0
    assert read_nodes(dev) == {"./nvidiactl": (195, 255), "./nvidia-uvm": (240, 0), "./null": (1, 3)}
    # The annotation (worked out at restore from this host and the container) wins over the caller's.
    assert (tmp_path / "criu-env.restore").read_text().split() == ["KFD_FW_VER_CHECK=0", "KFD_NUMA_CHECK=0"]


def test_failed_restore_puts_dev_image_back(rig, tmp_path: Path) -> None:
    settings, call, log, _ = rig
    dev = _checkpoint_with_dev_image(tmp_path / "img")
    before = dev.read_bytes()
    with pytest.raises(StepFailed) as err:
        restore(call(["restore", "-d", "--image-path", "img", "c1"], FAKE_RC="5"), settings, [], RecordingPlan([]), spec=RESTORE_SPEC)
    assert failure_exit_code(err.value, ExitCode.RESTORE_FAILED) == 5
    assert "retarget GPU device nodes" in " ".join(err.value.undone)
    assert dev.read_bytes() == before


def test_checkpoint_passes_criu_env_from_container_annotations(rig, tmp_path: Path) -> None:
    settings, call, log, _ = rig
    (tmp_path / "annotations.json").write_text(json.dumps({"gpusnap.io/criu-env": '{"KFD_CAPABILITY_CHECK":"0"}'}))
    assert checkpoint(call(["checkpoint", "--image-path", "img", "c1"]), settings, RecordingPlan([])) == 0
    assert (tmp_path / "criu-env.checkpoint").read_text().split() == ["KFD_CAPABILITY_CHECK=0"]
    # Without the annotation runc gets no KFD_* of ours.
    (tmp_path / "annotations.json").unlink()
    (tmp_path / "gone").unlink()
    assert checkpoint(call(["checkpoint", "--image-path", "img2", "c1"]), settings, RecordingPlan([])) == 0
    assert (tmp_path / "criu-env.checkpoint").read_text() == ""


@pytest.mark.parametrize("raw", ['{"LD_PRELOAD":"/tmp/x.so"}', '{"KFD_X;rm":"1"}', "not json"])
def test_criu_env_annotation_other_than_kfd_is_refused(rig, tmp_path: Path, raw: str) -> None:
    from gpusnap.errors import UsageError

    settings, call, log, _ = rig
    (tmp_path / "annotations.json").write_text(json.dumps({"gpusnap.io/criu-env": raw}))
    events: list[str] = []
    with pytest.raises(UsageError, match="gpusnap.io/criu-env"):
        checkpoint(call(["checkpoint", "c1"]), settings, RecordingPlan(events))
    assert events == [] and " checkpoint " not in f" {log.read_text()} "
    with pytest.raises(UsageError, match="gpusnap.io/criu-env"):
        restore(call(["restore", "-d", "c1"]), settings, [], RecordingPlan(events), spec={"annotations": {"gpusnap.io/criu-env": raw}})
    assert " restore " not in f" {log.read_text()} "


class FreezeAwarePlan(RecordingPlan):
    """Records each GPU step with the container's state as runc reports it at that moment."""

    def __init__(self, events: list[str], tmp: Path, fail_checkpoint: bool = False) -> None:
        super().__init__(events)
        self.tmp = tmp
        self.fail_checkpoint = fail_checkpoint

    def _step(self, name: str, undo: bool = True) -> Step:
        def state() -> str:
            f = self.tmp / "status"
            return f.read_text().strip() if f.exists() else "running"

        def do() -> None:
            self.events.append(f"{name} ({state()})")
            if self.fail_checkpoint and name == "gpu checkpoint":
                raise RuntimeError("driver failed")

        return Step(name, do, (lambda: self.events.append(f"undo {name} ({state()})")) if undo else None)


def test_paused_container_is_thawed_for_the_gpu_steps_only(rig, tmp_path: Path) -> None:
    """containerd pauses a container before every checkpoint; the CUDA driver cannot act on a
    frozen process, so the GPU steps run thawed, CRIU dumps it frozen, and it is left paused."""
    settings, call, log, _ = rig
    (tmp_path / "status").write_text("paused\n")
    events: list[str] = []
    assert checkpoint(call(["checkpoint", "--leave-running", "--image-path", "img", "c1"]), settings, FreezeAwarePlan(events, tmp_path)) == 0
    assert events == ["pids 4242", "gpu lock (running)", "gpu checkpoint (running)", "gpu after dump leave_running=True (running)"]
    verbs = [ln.split()[0] if not ln.startswith("--") else next(w for w in ln.split() if w in ("pause", "resume", "checkpoint"))
             for ln in log.read_text().splitlines() if any(f" {v} " in f" {ln} " for v in ("pause", "resume", "checkpoint"))]
    assert verbs == ["resume", "pause", "checkpoint", "resume", "pause"]
    assert (tmp_path / "status").read_text().strip() == "paused"


def test_running_container_is_not_paused_or_resumed(rig, tmp_path: Path) -> None:
    settings, call, log, _ = rig
    events: list[str] = []
    assert checkpoint(call(["checkpoint", "--leave-running", "--image-path", "img", "c1"]), settings, FreezeAwarePlan(events, tmp_path)) == 0
    assert not any(f" {v} " in f" {ln} " for ln in log.read_text().splitlines() for v in ("pause", "resume"))


def test_failed_gpu_step_of_paused_container_leaves_it_paused_and_running_on_gpu(rig, tmp_path: Path) -> None:
    settings, call, log, _ = rig
    (tmp_path / "status").write_text("paused\n")
    events: list[str] = []
    with pytest.raises(StepFailed):
        checkpoint(call(["checkpoint", "--image-path", "img", "c1"]), settings, FreezeAwarePlan(events, tmp_path, fail_checkpoint=True))
    assert events == ["pids 4242", "gpu lock (running)", "gpu checkpoint (running)", "undo gpu lock (running)"]
    assert (tmp_path / "status").read_text().strip() == "paused"
    assert not any(" checkpoint " in f" {ln} " for ln in log.read_text().splitlines())


def test_failed_dump_of_paused_container_undoes_gpu_steps_thawed(rig, tmp_path: Path) -> None:
    settings, call, log, _ = rig
    (tmp_path / "status").write_text("paused\n")
    events: list[str] = []
    with pytest.raises(StepFailed):
        checkpoint(call(["checkpoint", "--image-path", "img", "c1"], FAKE_RC="3"), settings, FreezeAwarePlan(events, tmp_path))
    assert events == ["pids 4242", "gpu lock (running)", "gpu checkpoint (running)", "dump failed: None", "undo gpu checkpoint (running)", "undo gpu lock (running)"]
    assert (tmp_path / "status").read_text().strip() == "paused"
