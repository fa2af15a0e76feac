"""The restore overlaps the pages files with its own preparation (orchestrate.restore,
engines/imagedir.py ImageJob, runc_direct's "wait for the checkpoint images" step)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpusnap.config import Settings
from gpusnap.engines import imagedir, orchestrate
from gpusnap.engines.base import ContainerInfo, RestoreOptions
from gpusnap.engines.runc_direct import WAIT_IMAGES, RuncDirectEngine, RuncDirectRecord
from gpusnap.errors import IntegrityError
from gpusnap.steps import Step, StepFailed, run_steps


def _settings(tmp_path: Path) -> Settings:
    return Settings(run_dir=tmp_path / "run", state_dir=tmp_path / "state", store_dir=tmp_path / "store")


class FakeApi:
    """The store has the checkpoint; materialize writes the small files, calls staged(), then
    writes the pages after ``pages_s`` seconds (or fails there with ``fail``)."""

    def __init__(self, pages_s: float = 0.3, fail: BaseException | None = None) -> None:
        self.pages_s, self.fail = pages_s, fail
        self.wrote_pages = threading.Event()
        self.cancelled = False

    def has_checkpoint(self, store: Path, ref: str) -> bool:
        return True

    def inspect(self, store: Path, ref: str, **kw: Any) -> Any:
        return SimpleNamespace(layers=[], form="criu-dir", container={}, created="", criu_version="", kernel="", arch="",
                               gpus=[], gpu_processes=[], sizes={"total": 1 << 20})

    def materialize_checkpoint(self, store: Path, ref: str, dest: Path, *, form: str, staged: Any = None, cancel: Any = None,
                               landed: Any = None) -> Path:
        tmp = dest.parent / ".partial"
        tmp.mkdir(parents=True)
        (tmp / "runc-direct.json").write_text("{}")
        tmp.rename(dest)
        staged()
        deadline = time.monotonic() + self.pages_s
        while time.monotonic() < deadline:
            if cancel.is_set():
                self.cancelled = True
                import shutil

                shutil.rmtree(dest)
                raise RuntimeError("cancelled")
            time.sleep(0.01)
        if self.fail is not None:
            import shutil

            shutil.rmtree(dest)
            raise self.fail
        (dest / "pages-1.img").write_bytes(b"p" * 4096)
        if landed is not None:
            landed.add("pages-1.img", 0, 4096)
        self.wrote_pages.set()
        return dest


class FakeEngine:
    """An engine whose restore is a step list like runc-direct's: prepare (with undo), wait for
    the images when it overlaps them, then "CRIU" (which needs the pages)."""

    name = "fake"
    form = "criu-dir"

    def __init__(self, overlaps: bool, prepare_s: float = 0.0) -> None:
        self.OVERLAPS_IMAGES = overlaps  # read from the type: see below
        self.prepare_s = prepare_s
        self.log: list[str] = []

    def require(self) -> None:
        pass

    def get(self, name: str) -> None:
        return None

    def restore(self, source: Path, opts: RestoreOptions) -> ContainerInfo:
        def prepare() -> None:
            assert (source / "runc-direct.json").is_file()
            time.sleep(self.prepare_s)
            self.log.append("prepare")

        def criu() -> None:
            assert (source / "pages-1.img").is_file(), "CRIU started before the pages were written"
            self.log.append("criu")

        steps = [Step("prepare", prepare, lambda: self.log.append("undo prepare"))]
        if opts.images_ready is not None:
            steps.append(Step(WAIT_IMAGES, opts.images_ready))
        steps.append(Step("restore the container", criu))
        records = run_steps(steps)
        if opts.timings is not None:
            opts.timings.update({r.name: round(r.seconds, 3) for r in records})
        return ContainerInfo(id="c1", name="c1", engine=self.name, status="running")


def _restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, api: FakeApi, overlaps: bool, prepare_s: float = 0.0) -> tuple[Any, FakeEngine]:
    eng = FakeEngine(overlaps, prepare_s)
    kind = type("Eng", (FakeEngine,), {"OVERLAPS_IMAGES": overlaps})
    eng.__class__ = kind
    monkeypatch.setattr(orchestrate, "packaging_api", lambda: api)
    monkeypatch.setattr(orchestrate, "gather", lambda settings, **kw: SimpleNamespace())
    monkeypatch.setattr(orchestrate, "require_compatible", lambda *a, **kw: None)
    monkeypatch.setattr(orchestrate, "engine_for_form", lambda form, settings: eng)
    monkeypatch.setattr(orchestrate, "_import_packaging", lambda *a: None)
    settings = _settings(tmp_path)
    (settings.store_dir).mkdir(parents=True)
    (settings.store_dir / "index.json").write_text("{}")
    return (lambda: orchestrate.restore(settings, "localhost/gs/ck:1")), eng


def _no_work_left(tmp_path: Path) -> bool:
    return not [p for p in (tmp_path / "state" / "tmp").glob("*")] and not [p for p in (tmp_path / "run" / "tmp").glob("*/*")]


def test_the_engine_prepares_while_the_pages_are_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi(pages_s=0.8)
    run, eng = _restore(tmp_path, monkeypatch, api, overlaps=True, prepare_s=0.6)
    started = time.perf_counter()
    out = run()
    took = time.perf_counter() - started
    assert eng.log == ["prepare", "criu"]
    assert took < 1.25, f"no overlap: {took:.2f} s for 0.8 s of pages and 0.6 s of preparation"
    t = out.timings_s
    assert t["restore: prepare"] >= 0.6
    assert 0.0 < t[f"restore: {WAIT_IMAGES}"] < 0.6  # what the preparation did not cover
    assert t["background: materialize"] >= 0.8  # not a lap: overlapped with the laps
    assert "materialize (all but the pages files)" in t
    assert _no_work_left(tmp_path)


def test_an_engine_that_does_not_overlap_gets_whole_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi(pages_s=0.2)
    run, eng = _restore(tmp_path, monkeypatch, api, overlaps=False)
    out = run()
    assert eng.log == ["prepare", "criu"] and api.wrote_pages.is_set()
    assert out.timings_s[WAIT_IMAGES] >= 0.1 and f"restore: {WAIT_IMAGES}" not in out.timings_s


def test_a_failed_pages_writer_undoes_the_engine_and_says_what_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi(pages_s=0.1, fail=IntegrityError("pages-1.img at 0: piece digest mismatch; the blob is corrupt"))
    run, eng = _restore(tmp_path, monkeypatch, api, overlaps=True)
    with pytest.raises(IntegrityError) as err:
        run()
    assert str(err.value) == "pages-1.img at 0: piece digest mismatch; the blob is corrupt"  # the same line as without overlap
    assert eng.log == ["prepare", "undo prepare"]  # CRIU never started
    assert _no_work_left(tmp_path)


def test_an_engine_failure_stops_the_writer_before_the_directory_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi(pages_s=5.0)
    run, eng = _restore(tmp_path, monkeypatch, api, overlaps=True)

    def broken(source: Path, opts: RestoreOptions) -> ContainerInfo:
        raise RuntimeError("the overlay would not mount")

    monkeypatch.setattr(eng, "restore", broken)
    started = time.perf_counter()
    with pytest.raises(StepFailed, match="overlay would not mount"):
        run()
    assert time.perf_counter() - started < 2.0 and api.cancelled
    assert _no_work_left(tmp_path)


def test_image_job_raises_the_writers_error_where_it_is_waited_for() -> None:
    def write(staged: Any, cancel: threading.Event) -> None:
        raise OSError("disk gone")

    job = imagedir.ImageJob(write).start()
    with pytest.raises(OSError, match="disk gone"):
        job.wait_staged()
    with pytest.raises(OSError, match="disk gone"):
        job.wait()
    assert job.failed
    job.stop()


def test_runc_direct_waits_for_the_images_after_preparing_and_undoes_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = RuncDirectEngine(_settings(tmp_path))
    log: list[str] = []
    monkeypatch.setattr(eng, "runtime_name", lambda: "runc")  # plain runc: no gate, the engine waits itself
    monkeypatch.setattr(eng, "_prepare_bundle", lambda *a: [Step("mount the overlay root filesystem", lambda: log.append("mount"),
                                                                   lambda: log.append("unmount"))])
    monkeypatch.setattr(eng, "_runtime", lambda *a, **kw: log.append("runc " + a[2 if a[0] == "--log" else 0]))

    def images_ready() -> None:
        log.append("wait")
        raise IntegrityError("blob sha256:ab from the registry does not match its digest")

    rec = RuncDirectRecord(name="c1", command=["sh"], rootfs="busybox")
    (eng.container_dir("c1")).mkdir(parents=True)
    with pytest.raises(StepFailed) as err:
        eng._start(rec, restore_from=tmp_path / "images", skip_lock=True, images_ready=images_ready)
    assert err.value.step == WAIT_IMAGES and isinstance(err.value.cause, IntegrityError)
    assert log[0] == "mount" and log[-2:] == ["wait", "unmount"] and not any(x.startswith("runc") for x in log)


def test_a_writer_failing_under_the_engines_preparation_still_reports_its_own_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The writer removes the directory when it fails: a preparation step still reading from it
    # fails too, but the cause the user sees is the writer's.
    api = FakeApi(pages_s=0.05, fail=IntegrityError("blob sha256:ab from the registry does not match its digest"))
    run, eng = _restore(tmp_path, monkeypatch, api, overlaps=True)
    gone = threading.Event()
    real = api.materialize_checkpoint

    def materialize(*a: Any, **kw: Any) -> Path:
        try:
            return real(*a, **kw)
        finally:
            gone.set()

    def restore(source: Path, opts: RestoreOptions) -> ContainerInfo:
        def prepare() -> None:
            gone.wait(5)
            (source / "runc-direct.json").read_text()  # removed by now

        run_steps([Step("prepare", prepare), Step(WAIT_IMAGES, opts.images_ready)])  # type: ignore[arg-type]
        raise AssertionError("not reached")

    monkeypatch.setattr(api, "materialize_checkpoint", materialize)
    monkeypatch.setattr(eng, "restore", restore)
    with pytest.raises(IntegrityError, match="does not match its digest"):
        run()
    assert _no_work_left(tmp_path)


def test_image_job_tells_a_failure_from_a_stop() -> None:
    def stops(staged: Any, cancel: threading.Event) -> None:
        staged()
        cancel.wait(5)
        raise RuntimeError("stopped")

    job = imagedir.ImageJob(stops).start()
    job.wait_staged()
    job.stop()
    assert job.error is not None and not job.failed  # told to stop: not a failure of its own

    go = threading.Event()

    def fails(staged: Any, cancel: threading.Event) -> None:
        staged()
        go.wait(5)
        raise OSError("disk gone")

    job = imagedir.ImageJob(fails).start()
    job.wait_staged()
    go.set()
    with pytest.raises(OSError):
        job.wait()
    job.stop()
    assert job.failed


FAKE_GATED_RUNTIME = """#!/bin/bash
# Stands for gpusnap-runtime: notes when it started, then waits at the gate as the real one does
# just before runc (gpusnap.checkpoint.runtime_steps.gate_steps): "ok", or "rootfs" then "pages".
case " $* " in *" delete "*) echo delete >> {log}; exit 0;; esac
date +%s.%N > {tmp}/runtime-started
eval "read -r word <&$GPUSNAP_RESTORE_GATE_FD"
words=$word
if [ "$word" = rootfs ]; then
    date +%s.%N > {tmp}/runc-let-go
    eval "read -r word <&$GPUSNAP_RESTORE_GATE_FD"
    words="$words $word"
fi
echo "$words" > {tmp}/gate-word
case "$words" in ok|"rootfs pages") ;; *) exit 7;; esac
"""


def _gated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, images_ready: Any, *, criu_before_pages: bool = True,
           ) -> tuple[RuncDirectEngine, list[str], Any]:
    import dataclasses

    from gpusnap.engines import runc_direct

    eng = RuncDirectEngine(dataclasses.replace(_settings(tmp_path), criu_before_pages=criu_before_pages))
    log: list[str] = []
    runtime = tmp_path / "fake-runtime"
    runtime.write_text(FAKE_GATED_RUNTIME.format(log=tmp_path / "runtime.log", tmp=tmp_path))
    runtime.chmod(0o755)
    monkeypatch.setattr(runc_direct, "runtime_command", lambda settings: ([str(runtime)], "gpusnap-runtime"))

    def mount() -> None:
        time.sleep(0.4)  # the writable layer being unpacked
        log.append(f"mounted {time.time()}")

    def prepare(rec: Any, spec: Any, upper: Any, skip: bool, beside: list[Step] | None = None) -> list[Step]:
        assert beside is not None, "through gpusnap-runtime the root filesystem is mounted beside the runtime"
        beside.append(Step("mount the overlay root filesystem", mount, lambda: log.append("unmount")))
        return []

    monkeypatch.setattr(eng, "_prepare_bundle", prepare)
    rec = RuncDirectRecord(name="c1", command=["sh"], rootfs="busybox")
    eng.container_dir("c1").mkdir(parents=True)
    timings: dict[str, float] = {}

    def start() -> None:
        eng._start(rec, restore_from=tmp_path / "images", skip_lock=True, images_ready=images_ready, timings=timings)

    return eng, log, (start, timings)


def test_through_the_runtime_the_root_filesystem_and_images_are_readied_beside_its_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[float] = []
    eng, log, (start, timings) = _gated(tmp_path, monkeypatch, lambda: waited.append(time.time()))
    start()
    started = float((tmp_path / "runtime-started").read_text())
    mounted = float(log[0].split()[1])
    assert started < mounted  # the runtime was on its way before the root filesystem was there
    # runc let go once the root filesystem was there, the pages still being written (CRIU is
    # held before it reads them: gpusnap.checkpoint.pages_hold), then "pages" once written
    assert (tmp_path / "gate-word").read_text().strip() == "rootfs pages" and waited and waited[0] >= mounted
    assert mounted <= float((tmp_path / "runc-let-go").read_text())
    assert {"beside the runtime: mount the overlay root filesystem", "beside the runtime: wait for the checkpoint images",
            "prepare the root filesystem and images beside the runtime", "restore the container"} <= set(timings)
    assert timings["beside the runtime: mount the overlay root filesystem"] >= 0.35
    assert "unmount" not in log


def test_images_failing_beside_the_runtime_stop_it_and_undo_the_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def images_ready() -> None:
        raise IntegrityError("blob sha256:ab from the registry does not match its digest")

    eng, log, (start, _) = _gated(tmp_path, monkeypatch, images_ready)
    with pytest.raises(StepFailed) as err:
        start()
    assert err.value.step == "restore the container" and isinstance(err.value.cause, IntegrityError)  # the writer's error, not the runtime's
    assert (tmp_path / "gate-word").read_text().strip() == "rootfs stop"
    assert log[-1] == "unmount"  # the runtime undid its own steps; the mount beside it is undone here


def test_with_nothing_left_to_write_the_gate_says_ok_once_the_root_filesystem_is_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng, log, (start, _) = _gated(tmp_path, monkeypatch, None)
    start()
    assert (tmp_path / "gate-word").read_text().strip() == "ok"
    assert not (tmp_path / "runc-let-go").exists()


def test_a_root_filesystem_that_fails_stops_the_runtime_before_runc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusnap.errors import GpusnapError

    waited: list[float] = []
    eng, log, (start, _) = _gated(tmp_path, monkeypatch, lambda: waited.append(time.time()))

    def prepare(rec: Any, spec: Any, upper: Any, skip: bool, beside: list[Step] | None = None) -> list[Step]:
        assert beside is not None
        beside.append(Step("mount the overlay root filesystem", lambda: (_ for _ in ()).throw(GpusnapError("overlay: no space left"))))
        return []

    monkeypatch.setattr(eng, "_prepare_bundle", prepare)
    with pytest.raises(StepFailed) as err:
        start()
    assert "no space left" in str(err.value.cause)
    assert (tmp_path / "gate-word").read_text().strip() == "stop"  # runc never let go
    assert not (tmp_path / "runc-let-go").exists() and not waited


def test_criu_before_pages_off_starts_runc_only_once_the_pages_are_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _settings(tmp_path).criu_before_pages  # the default
    waited: list[float] = []
    eng, log, (start, _) = _gated(tmp_path, monkeypatch, lambda: waited.append(time.time()), criu_before_pages=False)
    start()
    assert (tmp_path / "gate-word").read_text().strip() == "ok" and waited
    assert not (tmp_path / "runc-let-go").exists()
