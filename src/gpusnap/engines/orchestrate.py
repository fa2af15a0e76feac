"""Checkpoint and restore as users see them: engine + metadata + local store + registry.

Both are step lists (gpusnap.steps) so a failure anywhere rolls back: a checkpoint that fails
after the engine stopped the container brings the container back from what was dumped, and a
restore refuses on an incompatible host before it pulls or starts anything (a checkpoint
already in the store is unpacked into the run's private work dir while the host is examined).
"""

from __future__ import annotations

import io
import json
import os
import platform
import shutil
import socket
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap import __version__
from gpusnap.config import Settings
from gpusnap.engines.base import (
    DAMAGED,
    FORM_PODMAN_ARCHIVE,
    CheckpointOptions,
    ContainerInfo,
    Engine,
    EngineCheckpoint,
    RestoreOptions,
    rfc3339_now,
)
from gpusnap.engines import imagedir, workdirs
from gpusnap.engines.registry import detect_form, engine_for_form, find_container, make_engine, read_json_member
from gpusnap.errors import ExitCode, GpusnapError, MissingDependencyError, NotFoundError, RegistryUnreachable, UsageError
from gpusnap.host.facts import HostFacts, gather, require_compatible
from gpusnap.metadata import METADATA_FILE, CheckpointMetadata, GpuInfo, GpuProcess
from gpusnap.steps import Step, StepFailed, background, run_steps

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class CheckpointOutcome:
    container: ContainerInfo
    engine: str
    form: str
    metadata: CheckpointMetadata
    ref: str = ""  # local store reference, when stored
    output: str = ""  # path, when written with --output
    pushed: str = ""  # remote reference, when pushed
    podman_image: bool = False  # pushed as podman's checkpoint image (push_podman_image)
    digest: str = ""
    size: int = 0
    timings_s: dict[str, float] = field(default_factory=dict)
    stored_while_dumping: int = 0  # bytes of pages packed (and pushed) before the dump ended

    def to_dict(self) -> dict[str, Any]:
        return {
            "container": self.container.name,
            "container_id": self.container.id,
            "engine": self.engine,
            "form": self.form,
            "ref": self.ref,
            "output": self.output,
            "pushed": self.pushed,
            "podman_image": self.podman_image,
            "digest": self.digest,
            "size": self.size,
            "timings_s": self.timings_s,
            "stored_while_dumping": self.stored_while_dumping,
        }


@dataclass
class RestoreOutcome:
    container: ContainerInfo
    engine: str
    source: str
    form: str
    timings_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"container": self.container.name, "container_id": self.container.id, "engine": self.engine,
                "source": self.source, "form": self.form, "status": self.container.status, "timings_s": self.timings_s}


def packaging_api() -> Any:
    try:
        from gpusnap.packaging import api
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("gpusnap"):
            raise MissingDependencyError("checkpoint packaging is not part of this gpusnap build; use --output PATH and restore PATH") from None
        raise MissingDependencyError(f"Python module {exc.name} is missing; reinstall gpusnap (pip install gpusnap) to get its dependencies") from None
    return api


def build_metadata(settings: Settings, info: ContainerInfo, engine: Engine, opts: CheckpointOptions, facts: HostFacts) -> CheckpointMetadata:
    """Metadata for checkpoints whose runtime did not write gpusnap.json (plain runc, crun)."""
    runtime = getattr(engine, "runtime_name", lambda: engine.name)()
    return CheckpointMetadata(
        container_id=info.id,
        created=rfc3339_now(),
        runtime=runtime,
        runtime_version=__version__,
        criu_version=facts.criu_version,
        kernel=facts.kernel,
        arch=facts.arch,
        hostname=socket.gethostname(),
        gpu_backend="none",
        leave_running=opts.leave_running,
        tcp_established=opts.tcp_established,
    )


def _attach_metadata(cp: EngineCheckpoint, meta: CheckpointMetadata) -> None:
    if cp.image_dir is not None:
        meta.write(cp.image_dir)
        return
    if cp.form == FORM_PODMAN_ARCHIVE:
        # podman import ignores files it does not know, so the metadata rides inside the archive.
        data = json.dumps(meta.to_dict(), indent=2, sort_keys=True).encode()
        with tarfile.open(cp.path, "a") as tar:
            member = tarfile.TarInfo(METADATA_FILE)
            member.size = len(data)
            member.mode = 0o644
            tar.addfile(member, io.BytesIO(data))


def read_metadata(path: Path, form: str) -> CheckpointMetadata | None:
    if form == FORM_PODMAN_ARCHIVE:
        data = read_json_member(path, METADATA_FILE)
        return CheckpointMetadata.from_dict(data) if data else None
    for cand in (path, *(p for p in path.iterdir() if p.is_dir())):
        meta = CheckpointMetadata.read(cand)
        if meta is not None:
            return meta
    return None


def _engine_meta(cp: EngineCheckpoint) -> CheckpointMetadata | None:
    return CheckpointMetadata.read(cp.image_dir) if cp.image_dir is not None else None


def default_ref(container: ContainerInfo) -> str:
    stamp = rfc3339_now().replace(":", "").replace("-", "").replace("Z", "")
    return f"localhost/gpusnap/{container.name.lower()}:{stamp.replace('T', '-')}"


def work_dir(settings: Settings) -> Path:
    """A work dir its caller removes (or leaves to be swept once it has exited): the demo's
    --output target. Checkpoint and restore hold theirs (:func:`workdirs.claim`)."""
    base = settings.state_dir / "tmp"
    base.mkdir(parents=True, exist_ok=True)
    # No recovery here (no store to put it in): a dead run's checkpoint is kept for the next one.
    workdirs.sweep(base, recover=None, container_running=lambda record: _container_running(settings, record))
    return Path(tempfile.mkdtemp(prefix=f"work-{os.getpid()}-", dir=base))


def recover_interrupted(settings: Settings, notice: Progress = _quiet) -> list[workdirs.Swept]:
    """Sweep the work dirs of gpusnap runs that died (kill -9, OOM, power loss): a checkpoint
    whose dump finished and whose container it stopped is stored (under the reference the dead
    run was given, or ``<that>-recovered-<time>`` if taken) and ``notice`` gets one line saying
    how to restore it; what cannot be stored now is kept, with the command to import it; the
    rest is removed. Runs at the start of every checkpoint and restore, and from `gpusnap ls`."""
    base = settings.state_dir / "tmp"
    if not base.is_dir():
        return []
    # packaging_api() only when there is something to store (a build without packaging keeps
    # the dir and the notice says how to import it elsewhere).
    recover = lambda work, record: _store_recovered(settings, packaging_api(), record)  # noqa: E731
    done = workdirs.sweep(base, recover=recover, container_running=lambda record: _container_running(settings, record))
    for swept in done:
        line = _recovery_notice(swept)
        if line:
            notice(line)
    return done


def _recovery_ref(record: workdirs.WorkRecord) -> str:
    stamp = rfc3339_now().replace(":", "").replace("-", "").replace("Z", "").replace("T", "-")
    if not record.ref:
        return f"localhost/gpusnap/{(record.container or 'checkpoint').lower()}:recovered-{stamp}"
    repo, _, tag = record.ref.split("@", 1)[0].rpartition(":")
    if "/" in tag or not repo:  # no tag: host:port/repo
        repo, tag = record.ref.split("@", 1)[0], "latest"
    return f"{repo}:{tag[:100]}-recovered-{stamp}"


def _store_recovered(settings: Settings, api: Any, record: workdirs.WorkRecord) -> str:
    path = Path(record.checkpoint)
    if record.stage == workdirs.STARTED:
        # The dump finished after gpusnap died (workdirs.decide): the engine takes the steps
        # that run did not live to take before the images can be stored.
        complete = getattr(make_engine(record.engine, settings), "complete_interrupted", None)
        if complete is None or not complete(path, record.container):
            raise GpusnapError(f"the checkpoint of {record.container} in {path} lacks what {record.engine} adds after a dump")
    meta = read_metadata(path, record.form) if path.is_dir() or record.form == FORM_PODMAN_ARCHIVE else None
    wanted = record.ref
    taken = bool(wanted) and _in_store(api, settings, wanted)
    ref = _recovery_ref(record) if taken or not wanted else wanted
    stored = api.store_checkpoint(settings.store_dir, path, form=record.form, ref=ref, metadata=meta)
    if taken:
        # Killed after its tag landed but before it said so: the same checkpoint is there already.
        # (The manifests differ by their creation time: compare what they hold.)
        if _content(api.inspect(settings.store_dir, wanted)) == _content(api.inspect(settings.store_dir, ref)):
            api.remove(settings.store_dir, ref)
            return wanted
    return str(stored.ref)


def _content(info: Any) -> tuple[Any, ...]:
    return (info.form, info.created, info.container, [(layer.digest, layer.size, layer.file) for layer in info.layers])


def _container_running(settings: Settings, record: workdirs.WorkRecord) -> bool | None:
    try:
        eng, info = find_container(record.container, record.engine or "auto", settings)
        return bool(eng.is_running(info))
    except NotFoundError:
        return False
    except Exception:  # noqa: BLE001 - an engine that does not answer: cannot tell
        return None


def _recovery_notice(swept: workdirs.Swept) -> str:
    record, verdict = swept.record, swept.verdict
    if record is None or record.op != "checkpoint":
        return ""
    who = f"an interrupted gpusnap checkpoint of {record.container} (pid {record.pid})"
    if verdict.action == "recover":
        push = f", push it with: gpusnap push {swept.note} {record.push}" if record.push else ""
        return f"gpusnap: {who} left its checkpoint in {swept.work}; stored it as {swept.note}: restore it with: gpusnap restore {swept.note}{push}"
    if verdict.action == "keep":
        image = record.checkpoint or str(swept.work)
        return (f"gpusnap: {who} left a checkpoint in {image} ({verdict.reason}); store it with: gpusnap import {image} REF, "
                f"then remove {swept.work}")
    if record.stage == workdirs.STORED and record.push:
        return (f"gpusnap: {who} stored {record.ref} but may not have pushed it to {record.push}; "
                f"push it with: gpusnap push {record.ref} {record.push}")
    return ""


def checkpoint(
    settings: Settings,
    container: str,
    *,
    engine: str = "auto",
    opts: CheckpointOptions | None = None,
    push: str | None = None,
    output: Path | None = None,
    insecure: bool = False,
    progress: Progress = _quiet,
    ref: str | None = None,
    encryption: Any = None,
    podman_image: bool = False,
    notice: Progress | None = None,
) -> CheckpointOutcome:
    """``notice``: one-line messages for the user that are not progress (what a killed earlier
    run left and how it was recovered: :func:`recover_interrupted`); default: ``progress``.
    ``encryption``: a gpusnap.packaging.crypto.EncryptionConfig; every stored layer is sealed.
    ``podman_image``: push podman's own checkpoint image (:func:`push_podman_image`) rather than
    the artifact; only for podman containers, refused before anything is dumped otherwise."""
    opts = opts or CheckpointOptions()
    if encryption is not None and output is not None:
        raise UsageError("--encrypt-key/--recipient apply to the store and registry, not to --output; drop one")
    if push and output:
        raise UsageError("--push and --output exclude each other; pick one")
    if podman_image and not push:
        raise UsageError("--podman-image says how --push uploads the checkpoint; add --push REF")
    if podman_image and encryption is not None:
        raise UsageError(PODMAN_IMAGE_ENCRYPTED)
    begun = time.perf_counter()
    if output is not None and output.exists():
        raise UsageError(f"{output} already exists; pick a new --output path or remove it")
    api = None if output is not None else packaging_api()
    if api is not None:
        # What the store and the push import (numpy, requests: a while the first time) loads
        # while the engine dumps, on a thread that gives way to the dump like the store's own
        # threads (host/priority.py): on a host with no core to spare the dump goes first.
        modules = ["gpusnap.packaging.pack", *(["gpusnap.packaging.registry"] if push else [])]
        background(lambda: _preload(*modules, nice=settings.store_nice), name="gpusnap-import")
    eng, info = find_container(container, engine, settings)
    if podman_image and eng.form != FORM_PODMAN_ARCHIVE:
        raise UsageError(f"--podman-image needs a podman container; {info.name} runs in {eng.name} (push it without --podman-image "
                         "and restore it with gpusnap restore)")
    if info.status == DAMAGED:
        raise UsageError(f"{info.name} is damaged: its lazy restore ended before all its memory was in; delete it and restore its checkpoint again")
    if not info.running:  # find_container just asked the engine; asking again costs a runtime call
        raise UsageError(f"{info.name} is not running ({info.status or 'stopped'}) in {eng.name}; start it before checkpointing")
    facts = gather(settings, with_gpus=False)
    require_compatible(None, facts, what=info.name)  # CRIU present and new enough
    recover_interrupted(settings, notice or progress)
    prepared = round(time.perf_counter() - begun, 3)
    with workdirs.claim(settings.state_dir / "tmp") as work:
        outcome = _checkpoint_in(work, settings, eng, info, facts, opts=opts, push=push, output=output, insecure=insecure,
                                 progress=progress, ref=ref, encryption=encryption, podman_image=podman_image, api=api)
    outcome.timings_s = {PREPARE_CHECKPOINT: prepared, **outcome.timings_s}
    return outcome


PREPARE_CHECKPOINT = "find the container, check the host"  # before any step (timings_s)
# A step of the checkpoint; its phases are reported as "<step>: <phase>" (inside it, not laps).
STORE_STEP = "store the checkpoint"
PUSH_STEP = "push the checkpoint"


def _checkpoint_in(work: Path, settings: Settings, eng: Engine, info: ContainerInfo, facts: HostFacts, *, opts: CheckpointOptions,
                   push: str | None, output: Path | None, insecure: bool, progress: Progress, ref: str | None, encryption: Any,
                   podman_image: bool, api: Any) -> CheckpointOutcome:
    state: dict[str, Any] = {}
    dest = work / ("checkpoint.tar" if eng.form == FORM_PODMAN_ARCHIVE else "checkpoint")
    local = ref or push or default_ref(info) if output is None else ""
    # What this work dir holds, for a run that finds it after this one was killed
    # (engines/workdirs.py): from the end of the dump until the store has tagged it, the
    # images here are the only copy of a container the checkpoint stopped.
    record = workdirs.WorkRecord(pid=os.getpid(), op="checkpoint", container=info.name, engine=eng.name, form=eng.form,
                                 checkpoint=str(dest), ref=local, push=push or "", leave_running=opts.leave_running)
    record.write(work)

    def stage(name: str) -> None:
        record.stage = name
        record.write(work)

    def dump() -> None:
        progress(f"checkpointing {info.name} through {eng.name}")
        state["cp"] = eng.checkpoint(info, dest, opts)
        if "follower" in state:
            state["while_dumping"] = state["follower"].bytes_while_dumping
        record.checkpoint = str(state["cp"].path)
        stage(workdirs.DUMPED)

    def bring_back() -> None:
        # The engine stopped the container; start it again from what it just dumped so a
        # failed checkpoint leaves the container running, as it was.
        if opts.leave_running:
            return
        if eng.get(info.id) is not None:
            eng.remove(info)
        eng.restore(state["cp"].path, RestoreOptions(name=info.name, tcp_established=opts.tcp_established))

    def describe() -> None:
        cp: EngineCheckpoint = state["cp"]
        meta = _engine_meta(cp) or build_metadata(settings, info, eng, opts, facts)
        meta.extra.setdefault("engine", eng.name)
        meta.extra.setdefault("container_name", info.name)
        meta.extra.setdefault("image", info.image)
        meta.extra.setdefault("command", info.command)
        engine_extra = getattr(eng, "checkpoint_extra", None)  # runc-direct: its network record
        if engine_extra is not None:
            for key, value in engine_extra(cp).items():
                meta.extra.setdefault(key, value)
        _attach_metadata(cp, meta)
        state["meta"] = meta
        stage(workdirs.DESCRIBED)

    def write_output() -> None:
        assert output is not None
        progress(f"writing {output}")
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(state["cp"].path), str(output))

    # checkpoint --push of a plain artifact: each blob goes up as soon as the store commits
    # it (api.start_push), so the push step only waits for the last uploads and sends the
    # manifest. An encrypted store seals blobs after building them and a podman image is
    # built from the stored artifact: those push after the store, as before.
    # Also when the checkpoint stops the container: the uploads only read what the store
    # committed (on_blob queues them and returns), so the tag lands when the store is done
    # whatever the registry does, and a run killed before that leaves a work dir the next
    # run stores (recover_interrupted).
    pipelined = bool(push) and not podman_image and encryption is None and hasattr(api, "start_push")
    # An engine whose CRIU writes into ``dest`` lets the store (and the pipelined push) start
    # with the dump: the pages files are packed, and their packs uploaded, as CRIU writes them.
    follows = (settings.store_while_dumping and output is None and encryption is None and not podman_image
               and getattr(eng, "DUMPS_INTO_DEST", False) and hasattr(api, "follow_checkpoint"))
    transfer: list[Any] = []

    def start_pipeline(nice: int = 0) -> Any:
        cm = _transfer(progress, f"push {push}")
        bar = cm.__enter__()
        transfer.append(cm)
        state["pipeline"] = api.start_push(settings.store_dir, push, insecure=insecure, progress=bar, nice=nice,
                                             processes=settings.push_processes)
        return state["pipeline"]

    def follow() -> None:
        on_blob = None
        if pipelined:
            # Made on a thread: the registry client's imports may still be loading (_preload),
            # and the dump need not wait for them; the first pack is ready seconds later.
            # Its uploads give way to the dump, like the store's threads (gpusnap.host.priority).
            nice = settings.store_nice if settings.push_nice is None else settings.push_nice
            ready = state["pipeline_ready"] = background(lambda: start_pipeline(nice), name="gpusnap-push-start")

            def on_blob(desc: Any) -> None:
                ready.result().on_blob(desc)
        state["follower"] = api.follow_checkpoint(settings.store_dir, dest, compress=opts.compress, on_blob=on_blob,
                                                  nice=settings.store_nice, workers=settings.store_workers)

    def unfollow() -> None:
        follower = state.pop("follower", None)
        if follower is not None:
            follower.close()
        end_pipeline()

    def store() -> None:
        progress(f"storing {local}" + (f" and pushing it to {push}" if pipelined else ""))
        sealed = {"encryption": encryption} if encryption is not None else {}
        if pipelined:
            if "pipeline_ready" in state:
                state.pop("pipeline_ready").result()
            else:
                start_pipeline()
            sealed["on_blob"] = state["pipeline"].on_blob
        try:
            stored = api.store_checkpoint(settings.store_dir, state["cp"].path, form=eng.form, ref=local, metadata=state["meta"],
                                          compress=opts.compress, follower=state.pop("follower", None),
                                          workers=settings.store_workers, timings=state.setdefault("store_phases", {}),
                                          **sealed)
        except BaseException:
            end_pipeline()
            raise
        state["ref"] = local
        state["stored"] = stored
        stage(workdirs.STORED)

    def end_pipeline() -> None:
        ready = state.pop("pipeline_ready", None)
        if ready is not None:
            try:
                ready.result()
            except Exception:  # noqa: BLE001 - it never started: nothing to cancel
                pass
        pipeline = state.pop("pipeline", None)
        if pipeline is not None:
            pipeline.cancel()
        while transfer:
            transfer.pop().__exit__(None, None, None)

    def unstore() -> None:
        end_pipeline()
        remove_ref = getattr(api, "remove", None)
        if remove_ref is not None and "ref" in state:
            remove_ref(settings.store_dir, state["ref"])
            stage(workdirs.DESCRIBED)

    def do_push() -> None:
        if pipelined:
            progress(f"pushing the rest of {push}")
            try:
                pipeline = state["pipeline"]
                state["pushed"] = pipeline.finish(state["ref"])
                state["push_phases"] = dict(getattr(pipeline, "phases", {}))
            finally:
                end_pipeline()
            return
        progress(f"pushing {push}")
        with _transfer(progress, f"push {push}") as bar:
            if podman_image:
                state["pushed"] = push_podman_image(api, settings.store_dir, state["ref"], push, insecure=insecure, progress=bar)
            else:
                state["pushed"] = api.push(settings.store_dir, state["ref"], push, insecure=insecure, progress=bar,
                                             processes=settings.push_processes)

    steps = [Step("checkpoint", dump, bring_back), Step("write metadata", describe)]
    if follows:
        steps.insert(0, Step("store while dumping", follow, unfollow))
    if output is not None:
        steps.append(Step("write the checkpoint", write_output))
    else:
        steps.append(Step(STORE_STEP, store, unstore))
        if push:
            steps.append(Step(PUSH_STEP, do_push))
    try:
        records = run_steps(steps)
    except StepFailed as exc:
        if not _lost_without(work, record, exc):
            workdirs.release(work)
        raise
    except BaseException:
        workdirs.release(work)
        raise
    cleanup = time.perf_counter()
    workdirs.release(work, background=True)  # stored (or written out): the image is of no more use
    stored = state.get("stored")
    outcome = CheckpointOutcome(
        container=info,
        engine=eng.name,
        form=eng.form,
        metadata=state["meta"],
        ref=state.get("ref", ""),
        output=str(output) if output is not None else "",
        pushed=push or "",
        podman_image=bool(push and podman_image),
        digest=str(getattr(stored, "digest", "") or ""),
        size=int(getattr(stored, "size", 0) or 0) if stored is not None else _path_size(output),
        timings_s={**{r.name: round(r.seconds, 3) for r in records}, "remove the work dir": round(time.perf_counter() - cleanup, 3),
                   **{f"{STORE_STEP}: {k}": v for k, v in state.get("store_phases", {}).items()},
                   **{f"{PUSH_STEP}: {k}": v for k, v in state.get("push_phases", {}).items()},
                   # what the runtime recorded of its own steps (GPU lock, copy to host, runc checkpoint, …)
                   **{f"checkpoint: runtime: {k}": round(v, 3) for k, v in state["meta"].timings_s.items()},
                   **{f"checkpoint: engine: {k}": round(v, 3) for k, v in getattr(state.get("cp"), "timings_s", {}).items()}},
        stored_while_dumping=int(state.get("while_dumping", 0)),
    )
    return outcome


def _lost_without(work: Path, record: workdirs.WorkRecord, exc: StepFailed) -> bool:
    """Whether the work dir is all that is left of the container: the checkpoint stopped it,
    and bringing it back failed. Then it stays, and the next gpusnap run stores it."""
    kept = (not record.leave_running and record.stage in (workdirs.DUMPED, workdirs.DESCRIBED)
            and any(name == "checkpoint" for name, _ in exc.undo_errors))
    if kept:
        exc.args = (f"{exc}; the checkpoint stays in {work} and the next gpusnap run stores it",)
    return kept


PODMAN_IMAGE_ENCRYPTED = "--podman-image and --encrypt-key/--recipient exclude each other: podman restores only plain images; drop one"


def push_podman_image(api: Any, store_dir: Path, ref: str, remote: str, *, insecure: bool = False, progress: Any = None,
                      subject: str | None = None) -> Any:
    """Push podman's own checkpoint image of the stored podman checkpoint ``ref`` to ``remote``
    (``make_podman_image``): ``podman pull REMOTE`` then ``podman container restore REMOTE``
    restore it, without gpusnap. A checkpoint of another engine, or an encrypted one, is refused
    (UsageError) before anything is written. The image is tagged in the store only while it is
    pushed; its blobs stay until ``gpusnap gc``. Returns the push's PushResult."""
    from gpusnap.packaging.crypto import is_encrypted

    info = api.inspect(store_dir, ref)
    if info.form != FORM_PODMAN_ARCHIVE:
        raise UsageError(f"--podman-image needs a podman checkpoint; {ref} is a {info.form} checkpoint (push it without --podman-image)")
    if any(is_encrypted(layer.media_type) for layer in info.layers):
        raise UsageError(f"--podman-image needs a plain checkpoint; {ref} is encrypted and podman restores only plain images")
    image = f"localhost/gpusnap/podman-image:{os.getpid()}-{uuid.uuid4().hex[:8]}"
    api.make_podman_image(store_dir, ref, image)
    try:
        return api.push(store_dir, image, remote, insecure=insecure, progress=progress, subject=subject)
    finally:
        api.remove(store_dir, image)


def _path_size(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def restore(
    settings: Settings,
    source: str,
    *,
    name: str | None = None,
    engine: str = "auto",
    tcp_established: bool = False,
    insecure: bool = False,
    progress: Progress = _quiet,
    ip: str | None = None,
    decryption: Any = None,
    notice: Progress | None = None,
    lazy_pages: bool | None = None,
) -> RestoreOutcome:
    """``decryption``: gpusnap.packaging.crypto.DecryptionKeys for an encrypted checkpoint.
    ``notice``: as for :func:`checkpoint`. ``lazy_pages``: True asks for a lazy restore (refused
    by engines that cannot), None leaves it to ``settings.lazy_pages`` where the engine can."""
    keys = {"decryption": decryption} if decryption is not None else {}
    path = Path(source)
    clock = _StageClock()
    # The host's facts (CRIU's version, the GPUs through NVML: a driver call that can take a
    # while) are gathered beside the reading of the checkpoint; every check that uses them
    # still comes before anything is downloaded or CRIU starts.
    facts_job = background(lambda: gather(settings), "gpusnap-host-facts")
    if not path.exists():
        # gpusnap.packaging (requests, zstandard, cryptography...) takes a while to import the
        # first time: started now, it loads while the work dirs are swept.
        background(lambda: _import_packaging(settings, source), name="gpusnap-import")
    # First, so that a checkpoint a killed run left is in the store before this looks there.
    recover_interrupted(settings, notice or progress)
    claimed = workdirs.claim(settings.state_dir / "tmp")
    work = claimed.__enter__()
    memory: ExitStack = ExitStack()  # the in-memory work dir, when the image goes there (_image_dir)
    # The image directory is written on a thread of its own (engines/imagedir.py ImageJob):
    # every file but the pages files first, then the pages files while the host is checked and
    # the engine prepares the container; the engine waits for them just before CRIU starts.
    images: imagedir.ImageJob | None = None
    pull_phases: dict[str, float] = {}  # the pull's own phases (fetch_into), beside the laps
    clock.lap("sweep the work dirs")
    try:
        # What of the pages files is in, as the writer goes (a lazy restore's CRIU and page
        # server need not wait for all of it: gpusnap.criu.landed). Kept by every image job,
        # since the engine, and so whether the restore is lazy, is known only after it started.
        from gpusnap.criu.landed import LEDGER_NAME, LandedPages

        landed = LandedPages(work / LEDGER_NAME)
        memory.callback(landed.close)
        if path.exists():
            form = detect_form(path)
            meta = read_metadata(path, form)
            clock.lap("read the checkpoint's metadata")
            facts = clock.wait("check the host", facts_job)
            require_compatible(meta, facts, what=source)
            local = path
        else:
            if source.startswith(("/", "./", "../", "~")) or ("/" not in source and ":" not in source and "@" not in source):
                raise NotFoundError(f"{source} is neither a file nor a reference like host/repo:tag; check the path or reference")
            api = packaging_api()
            clock.lap("load the packaging code")
            remote = None
            in_store = _in_store(api, settings, source)
            clock.lap("look in the store")
            if not in_store:
                # Refuse before anything is downloaded or the store changes: the artifact's
                # config (its metadata) is a small blob read straight from the registry.
                progress(f"checking {source}")
                with _not_in_store_either(source, settings.store_dir):
                    if hasattr(api, "open_remote"):
                        remote = api.open_remote(source, insecure=insecure)
                    if remote is not None and remote.direct:
                        if decryption:
                            _refuse_plain(source)  # direct means plain: refused before anything is downloaded
                        remote_meta = _config_metadata(remote.config)
                    else:
                        remote_meta = _remote_metadata(source, insecure, decryption)
                clock.lap("read the checkpoint's metadata")
                require_compatible(remote_meta, clock.wait("check the host", facts_job), what=source)
            if remote is not None and remote.direct:
                # A directory checkpoint straight from the registry into the image directory:
                # each byte written once, verified as it lands (packaging.fetch).
                form = str(remote.config["form"])
                local, reserved = _image_dir(settings, work, imagedir.image_bytes_of(remote.config), progress, memory)
                progress(f"pulling {source} into the checkpoint directory")
                fetch_into, rc, bars = api.fetch_into, remote, _transfer(progress, f"pull {source}")

                def fetch(staged: Callable[[], None], cancel: threading.Event) -> Any:
                    with bars as bar:  # the progress bar ends with the download
                        return fetch_into(settings.store_dir, rc, local, progress=bar, staged=staged, cancel=cancel,
                                          processes=settings.fetch_processes, map_files=reserved, timings=pull_phases, landed=landed)

                images = imagedir.ImageJob(fetch, name="gpusnap-fetch", landed=landed).start()
                images.what = "pull into the image directory"
                images.wait_staged()
                clock.lap(f"{images.what} (all but the pages files)")
            else:
                ref = source if in_store else _local_or_pull(api, settings, source, insecure, progress, **keys)
                clock.lap("find in the store (or pull into it)")
                info = api.inspect(settings.store_dir, ref, file_rows=False, **keys)
                if decryption and not any(str(layer.media_type).endswith("+encrypted") for layer in info.layers):
                    _refuse_plain(source)
                form = _artifact_form(info)
                meta = _artifact_metadata(info)
                clock.lap("read the checkpoint's metadata")
                # Materializing writes only this run's private work dir (removed below whatever
                # happens), so it goes on while the host's facts are still being gathered; the
                # host check still comes before the engine prepares anything or CRIU starts.
                local, _ = _image_dir(settings, work, int((info.sizes or {}).get("total", 0)), progress, memory)
                progress(f"unpacking {source}")
                materialize = api.materialize_checkpoint
                images = imagedir.ImageJob(lambda staged, cancel: materialize(settings.store_dir, ref, local, form=form, staged=staged,
                                                                              cancel=cancel, landed=landed, **keys),
                                           name="gpusnap-materialize", landed=landed).start()
                images.what = "materialize"
                images.wait_staged()
                clock.lap(f"{images.what} (all but the pages files)")
                require_compatible(meta, clock.wait("check the host", facts_job), what=source)
        eng = engine_for_form(form, settings) if engine == "auto" else make_engine(engine, settings)
        if eng.form != form:
            raise UsageError(f"{source} is a {form} checkpoint, which the {eng.name} engine cannot restore; use --engine auto")
        eng.require()
        if name and eng.get(name) is not None:
            raise UsageError(f"{eng.name} already has a container named {name}; pick another --name")
        progress(f"restoring through {eng.name}")
        clock.lap("prepare the engine")
        lazy = _lazy_pages(settings, eng, source, lazy_pages, progress)
        engine_steps: dict[str, float] = {}
        opts = RestoreOptions(name=name, tcp_established=tcp_established, ip=ip, timings=engine_steps, lazy_pages=lazy)
        if images is not None:
            if getattr(type(eng), "OVERLAPS_IMAGES", False):
                opts.images_ready = images.wait  # the engine prepares the container meanwhile
                opts.pages_landed = landed if lazy else None
            else:
                images.wait()
                clock.lap(WAIT_IMAGES)
        try:
            records = run_steps([Step("restore", lambda: eng.restore(local, opts))])
        except StepFailed as exc:
            # The images failed while the engine prepared or waited for them (maybe removed
            # under a step that read them): the engine undid its preparation, and the user gets
            # the writer's own error, as when nothing overlapped.
            if images is not None:
                images.stop()
                if images.failed and exc.exit_code != ExitCode.ROLLBACK_FAILED:
                    raise images.error from None  # type: ignore[misc]
            raise
        container = records[0].result
        timings = {**clock.laps, **{r.name: round(r.seconds, 3) for r in records},
                   **{f"restore: {k}": v for k, v in engine_steps.items()}}
        if images is not None:
            # Not a lap: how long the image directory took on its own thread, overlapped with
            # the laps above (bench/e2e.py shows it beside them, not in their sum).
            timings[f"{BACKGROUND}{images.what}"] = round(images.seconds, 3)
            for phase, secs in pull_phases.items():
                timings[f"{BACKGROUND}{images.what}: {phase}"] = secs
        return RestoreOutcome(container=container, engine=eng.name, source=source, form=form, timings_s=timings)
    finally:
        if images is not None:
            images.stop()  # never remove the image directory under a thread still writing it
        memory.close()
        workdirs.release(work)
        claimed.__exit__(None, None, None)


def _lazy_pages(settings: Settings, eng: Engine, source: str, asked: bool | None, progress: Progress) -> bool:
    """Whether this restore is lazy (RestoreOptions.lazy_pages): ``asked`` (the command line) or
    the setting decides; "auto" (None in both) means wherever the engine and the kernel can."""
    wanted = settings.lazy_pages if asked is None else asked
    if wanted is False:
        return False
    capable = bool(getattr(type(eng), "LAZY_PAGES", False))
    if not capable:
        if wanted:
            raise UsageError(f"lazy pages work with the runc-direct engine only, and {source} restores through {eng.name}; "
                             "restore with --eager-pages (or set lazy_pages to auto)")
        return False
    from gpusnap.criu.lazy_pages import host_support

    ok, why = host_support()
    if not ok:
        if wanted:
            raise MissingDependencyError(f"lazy pages need the kernel's userfaultfd with its events, and here {why}; restore with --eager-pages")
        progress(f"eager pages: {why}")
        return False
    return True


WAIT_IMAGES = "wait for the checkpoint images"
BACKGROUND = "background: "  # timings_s keys that are not laps (work overlapped with them)


def _import_packaging(settings: Settings, source: str) -> None:
    """gpusnap.packaging, and its registry client (requests) when ``source`` is not in the store."""
    if _preload("gpusnap.packaging.api"):
        from gpusnap.packaging import api

        if not api.has_checkpoint(settings.store_dir, source):
            _preload("gpusnap.packaging.fetch")


def _preload(*modules: str, nice: int = 0) -> bool:
    """Import ``modules`` (on a background thread, ahead of their use, at nice value ``nice``);
    False if one fails: the import where it is needed says what is missing (packaging_api())."""
    import importlib

    from gpusnap.host.priority import yield_cpu

    yield_cpu(nice)
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception:  # noqa: BLE001 - reported where the module is used
        return False
    return True


def _image_dir(settings: Settings, work: Path, image_bytes: int, progress: Progress, memory: ExitStack) -> tuple[Path, bool]:
    """Where a restore writes the image directory, and whether it is on a tmpfs of its own
    (room for the whole image reserved: the pull may write through mappings, fetch.FileMaps).
    engines/imagedir.py has the rule: a tmpfs under the run dir when the image fits comfortably
    in free memory (a work dir there, claimed and removed through ``memory``), else the state
    dir's work dir. No fsync either way: the image is scratch, rebuilt from the store or
    registry after a crash."""
    base = settings.run_dir / "tmp"
    if base.is_dir():  # a killed restore's image: in memory until removed
        workdirs.sweep(base, recover=None, container_running=lambda record: _container_running(settings, record))
    if imagedir.on_memory(work):
        return _in_memory(work, image_bytes, progress, f"{work} is on a tmpfs")
    choice = imagedir.choose_base(base, image_bytes)
    if not choice.memory:
        progress(f"image directory on disk: {choice.reason}")
        return work / "checkpoint", False
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    memory_work = memory.enter_context(workdirs.claim(base))
    memory.callback(workdirs.release, memory_work)  # unmounts its image tmpfs first
    return _in_memory(memory_work, image_bytes, progress, choice.reason)


def _in_memory(work: Path, image_bytes: int, progress: Progress, reason: str) -> tuple[Path, bool]:
    """The image directory in memory under ``work``: on a huge-page tmpfs of its own
    (imagedir.mount_tmpfs) where one can be mounted, else on ``work``'s tmpfs. Unmounted
    when ``work`` is released (workdirs.release), by this run or by the sweep after a kill."""
    mounted = imagedir.mount_tmpfs(work, image_bytes)
    progress(f"image directory in memory: {reason}{'; a huge-page tmpfs of its own' if mounted else ''}")
    return (mounted or work) / "checkpoint", mounted is not None


class _StageClock:
    """Seconds per stage of a restore (``RestoreOutcome.timings_s``, printed by --json and read
    by bench/e2e.py): each lap is the time since the previous one."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(self.laps.get(name, 0.0) + now - self._last, 3)
        self._last = now

    def wait(self, name: str, job: "Future[HostFacts]") -> HostFacts:
        """The result of ``job``; the time spent waiting for it is a lap of its own."""
        result = job.result()
        self.lap(name)
        return result


def _refuse_plain(source: str) -> None:
    """A restore given --decrypt-key expects an encrypted checkpoint; a plain one in its place
    could be anyone's (only an encrypted one under the user's own key proves its origin)."""
    from gpusnap.errors import IntegrityError

    raise IntegrityError(f"{source} is not encrypted, but --decrypt-key was given: refusing a checkpoint that may have been replaced; "
                         "restore without --decrypt-key only if you expect a plain checkpoint there")


def _in_store(api: Any, settings: Settings, ref: str) -> bool:
    if not (settings.store_dir / "index.json").is_file():
        return False  # asking the store would create an empty one
    if hasattr(api, "has_checkpoint"):  # not a checkpoint restored from a registry: its blobs are there
        return bool(api.has_checkpoint(settings.store_dir, ref))
    try:
        api.inspect(settings.store_dir, ref)
        return True
    except NotFoundError:
        return False


def _remote_metadata(remote: str, insecure: bool, decryption: Any = None) -> CheckpointMetadata:
    """The checkpoint metadata in a remote artifact's config blob, without pulling its layers."""
    _digest, manifest, config = packaging_api().remote_config(remote, insecure=insecure, decryption=decryption)
    if decryption and not str(manifest["config"].get("mediaType", "")).endswith("+encrypted"):
        _refuse_plain(remote)
    return _config_metadata(config)


def _config_metadata(config: dict[str, Any]) -> CheckpointMetadata:
    """Metadata from an artifact config (the format packaging writes: docs/artifact-format.md)."""
    meta = config.get("gpusnap") or {}
    gpus = config.get("gpus") or meta.get("gpus") or []
    procs = config.get("processes") or meta.get("processes") or []
    return CheckpointMetadata.from_dict({
        "container_id": str((config.get("container") or {}).get("id", "")),
        "created": str(config.get("created", "")),
        "criu_version": str(config.get("criuVersion", "")),
        "kernel": str(config.get("kernel", "")),
        "arch": str(config.get("arch", "")),
        "gpus": [_gpu_fields(g) for g in gpus],
        "processes": [_proc_fields(p) for p in procs],
    })


def _gpu_fields(g: dict[str, Any]) -> dict[str, Any]:
    keys = GpuInfo.__dataclass_fields__
    return {k: v for k, v in g.items() if k in keys}


def _proc_fields(p: dict[str, Any]) -> dict[str, Any]:
    keys = GpuProcess.__dataclass_fields__
    return {k: v for k, v in p.items() if k in keys}


@contextmanager
def _not_in_store_either(source: str, store_dir: Path) -> Iterator[None]:
    """A reference not in the local store was looked for in its registry, which did not answer:
    say both, since gpusnap's own names (localhost/gpusnap/NAME:TAG) look like registry
    references, and a mistyped tag of a local checkpoint would otherwise read as a network
    problem."""
    try:
        yield
    except RegistryUnreachable as exc:
        raise RegistryUnreachable(f"{source} is not in the local store {store_dir} (`gpusnap ls` lists what it holds), "
                                  f"and {exc}") from None


def _local_or_pull(api: Any, settings: Settings, ref: str, insecure: bool, progress: Progress, **keys: Any) -> str:
    """The reference in the local store, pulling it (only missing blobs) when it is not there."""
    if _in_store(api, settings, ref):
        return ref
    progress(f"pulling {ref}")
    with _transfer(progress, f"pull {ref}") as bar:
        pulled = api.pull(settings.store_dir, ref, insecure=insecure, progress=bar, **keys)
    return str(pulled or ref)


@contextmanager
def _transfer(progress: Progress, description: str) -> Iterator[Any]:
    """A byte progress bar from the caller's reporter when it offers one (the CLI on a TTY)."""
    factory = getattr(progress, "transfer", None)
    bar = factory(description) if factory is not None else None
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


def _artifact_form(info: Any) -> str:
    form = getattr(info, "form", None)
    if not form:
        raise GpusnapError("the checkpoint's artifact does not say which engine wrote it; it cannot be restored")
    return str(form)


def _artifact_metadata(info: Any) -> CheckpointMetadata:
    """What the host check needs, from packaging's ArtifactInfo (GPUs, GPU processes, host)."""
    return _config_metadata({
        "container": getattr(info, "container", None) or {},
        "created": getattr(info, "created", ""),
        "criuVersion": getattr(info, "criu_version", ""),
        "kernel": getattr(info, "kernel", ""),
        "arch": getattr(info, "arch", ""),
        "gpus": getattr(info, "gpus", None) or [],
        "processes": getattr(info, "gpu_processes", None) or [],
    })


def host_arch() -> str:
    return platform.machine()
