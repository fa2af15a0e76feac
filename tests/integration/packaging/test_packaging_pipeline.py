"""checkpoint --push's pipelined upload and restore straight from a registry, on a real registry.

The pipelined push uploads each blob as the store commits it (store_checkpoint's on_blob) and
puts the manifest last; fetch_into writes the blobs' pieces straight into the image directory.
Faults: the registry dies in the middle of a download (the fetch resumes), a blob in the
registry's storage is corrupt (refused, nothing left), the disk is full (a small tmpfs).
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from stack.registry import Registry

from gpusnap.errors import GpusnapError, IntegrityError, NotFoundError
from gpusnap.packaging import api
from gpusnap.packaging.fetch import open_remote
from gpusnap.packaging.progress import CountingProgress, NullProgress
from gpusnap.packaging.registry import RegistryClient
from gpusnap.packaging.store import OciStore
from gpusnap.packaging.verify import verify_store

pytestmark = pytest.mark.integration


def _checkpoint_dir(path: Path, mib: int, seed: int = 7) -> Path:
    """A CRIU-like directory: a pages file with random memory, a zero run and a repeated
    region (one blob written to two places), a large non-pages file, small control files."""
    path.mkdir(parents=True)
    rnd = random.Random(seed)
    block = rnd.randbytes(8 << 20)
    with open(path / "pages-1.img", "wb") as f:
        f.write(rnd.randbytes((mib - 24) << 20))
        f.write(bytes(8 << 20))  # zeros: left as a hole
        f.write(block)
        f.write(block)
    (path / "pages-2.img").write_bytes(b"")
    (path / "pstree.img").write_bytes(b"\x19\x43\x56\x54\x30\x30\x27\x50")
    (path / "core-1.img").write_bytes(rnd.randbytes(5000))
    (path / "sub").mkdir()
    (path / "sub" / "big.bin").write_bytes(rnd.randbytes(33 << 20))  # >= 32 MiB: chunked as data
    os.chmod(path / "core-1.img", 0o640)
    return path


def files_of(root: Path) -> dict[str, tuple[bytes, int]]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = (p.read_bytes(), p.stat().st_mode & 0o777)
    return out


def _pipelined_push(store: Path, src: Path, ref: str, remote: str, compress: bool, progress: object = None,
                    processes: int | None = 0) -> object:
    pipe = api.start_push(store, remote, insecure=True, progress=progress, processes=processes)
    seen: list[str] = []

    def on_blob(d: object) -> None:
        seen.append(d.digest)  # type: ignore[attr-defined]
        OciStore(store).open_blob(d.digest).close()  # type: ignore[attr-defined]  # readable from another store object
        pipe.on_blob(d)

    try:
        api.store_checkpoint(store, src, form="criu-dir", ref=ref, compress=compress, on_blob=on_blob)
    except BaseException:
        pipe.cancel()
        raise
    result = pipe.finish(ref)
    manifest = OciStore(store).manifest(OciStore(store).resolve(ref).digest)
    # on_blob saw every blob this store wrote (blobs reused from an earlier checkpoint are not
    # reported; the finish asks the registry about those), and only blobs of the manifest.
    assert set(seen) <= {manifest["config"]["digest"], *(d["digest"] for d in manifest["layers"])}
    assert manifest["config"]["digest"] in seen
    return result


@pytest.fixture(params=[{"processes": 0}, {"processes": 2}, {"processes": 2, "map_files": True}],
                ids=["in-process", "2-processes", "2-processes-mapped"])
def pull_mode(request: pytest.FixtureRequest) -> dict[str, object]:
    """How a restore's downloads run: in the fetching process, or in two transfer processes
    (gpusnap.packaging.transfer_worker; a many-core host's default), writing with pwrite or
    receiving straight into the files' mappings (fetch.FileMaps: a restore's own tmpfs)."""
    return dict(request.param)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "zstd"])
def test_pipelined_push_then_direct_restore_is_bit_exact(tmp_path: Path, registry: Registry, compress: bool, pull_mode: dict[str, object]) -> None:
    src = _checkpoint_dir(tmp_path / "ck", 80)
    store = tmp_path / "store"
    remote = f"{registry.host}/gs-pkg/pipe:v1"
    result = _pipelined_push(store, src, "gs-pkg/pipe", remote, compress)
    assert result.uploaded_bytes > 0 and result.digest == OciStore(store).resolve("gs-pkg/pipe").digest

    # A second pipelined push of the same checkpoint to the same repository uploads only its
    # config (its creation time differs): every layer is found with HEAD.
    again = _pipelined_push(tmp_path / "store-b", src, "gs-pkg/pipe", f"{registry.host}/gs-pkg/pipe:v2", compress)
    assert again.uploaded_bytes < 64 << 10 and again.skipped_bytes >= result.uploaded_bytes - (64 << 10)

    target = tmp_path / "store2"
    rc = open_remote(remote, insecure=True)
    assert rc.direct and rc.digest == result.digest
    prog = CountingProgress()
    out = api.fetch_into(target, rc, tmp_path / "work" / "checkpoint", progress=prog, **pull_mode)
    assert files_of(out.dest) == files_of(src)
    assert prog.done == prog.total and out.bytes_received == prog.total
    # The zero run was not written: the pages file takes less space than its size.
    pages = out.dest / "pages-1.img"
    assert pages.stat().st_blocks * 512 <= pages.stat().st_size - (4 << 20)
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["checkpoint"]
    # The store keeps the manifest and the config, no blob data, no tag.
    s2 = OciStore(target)
    assert s2.tags() == [] and s2.has_blob(rc.digest) and s2.has_blob(rc.config_desc.digest)
    assert sum(p.stat().st_size for p in s2.blobs_dir.iterdir()) < 1 << 20
    assert verify_store(s2).ok


def test_a_checkpoint_with_sha256_pieces_restores_straight_from_the_registry(tmp_path: Path, registry: Registry,
                                                                              pull_mode: dict[str, object],
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint pushed by a gpusnap from before BLAKE3 piece digests (its piece table
    GSPIECE2, every piece's SHA-256) restores bit-exact, each piece checked by its SHA-256, also
    where the transfer processes (started with today's defaults) receive it."""
    from gpusnap.packaging import layout as lay

    src = _checkpoint_dir(tmp_path / "ck", 48, seed=11)
    remote = f"{registry.host}/gs-pkg/sha256:v1"
    monkeypatch.setattr(lay, "PIECE_DIGEST", lay.DIGEST_SHA256)
    _pipelined_push(tmp_path / "store", src, "gs-pkg/sha256", remote, False)
    monkeypatch.undo()
    store = OciStore(tmp_path / "store")
    manifest = store.manifest(store.resolve("gs-pkg/sha256").digest)
    table = next(d["digest"] for d in manifest["layers"] if d["mediaType"] == lay.MEDIA_PIECES)
    assert lay.read_table(store.read_bytes(table))[0] == lay.DIGEST_SHA256
    out = api.fetch_into(tmp_path / "store2", open_remote(remote, insecure=True), tmp_path / "work" / "checkpoint", **pull_mode)
    assert files_of(out.dest) == files_of(src)

    # Ten bytes of its largest pack changed in the registry: its SHA-256 piece check refuses it.
    layer = max((d for d in api.inspect(tmp_path / "store", "gs-pkg/sha256").layers if d.role in ("pages", "pack")), key=lambda d: d.size)
    data_file = registry.root / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / layer.digest[7:9] / layer.digest[7:] / "data"
    raw = bytearray(data_file.read_bytes())
    raw[1000:1010] = b"0123456789"
    data_file.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="does not match its digest"):
        api.fetch_into(tmp_path / "store3", open_remote(remote, insecure=True), tmp_path / "work3" / "checkpoint", **pull_mode)


class _KillAfter(NullProgress):
    """Kills the registry once ``limit`` bytes moved, restarts it ``pause`` s later (None: not)."""

    def __init__(self, reg: Registry, limit: int, pause: float | None) -> None:
        self.reg, self.limit, self.pause = reg, limit, pause
        self.moved = 0
        self.killed = threading.Event()
        self._lock = threading.Lock()

    def advance(self, n: int) -> None:
        with self._lock:
            self.moved += n
            if self.moved < self.limit or self.killed.is_set():
                return
            self.killed.set()
        self.reg.kill()
        if self.pause is not None:
            threading.Timer(self.pause, self.reg.start).start()


def test_direct_restore_resumes_after_registry_restart(tmp_path: Path, registry: Registry, pull_mode: dict[str, object]) -> None:
    src = _checkpoint_dir(tmp_path / "ck", 96, seed=11)
    store = tmp_path / "store"
    remote = f"{registry.host}/gs-pkg/resume-fetch:v1"
    _pipelined_push(store, src, "gs-pkg/resume-fetch", remote, compress=True)
    client = RegistryClient(registry.host, insecure=True, retries=8, backoff_s=0.3, workers=3)
    rc = open_remote(remote, client=client)
    killer = _KillAfter(registry, 40 << 20, pause=1.0)
    out = api.fetch_into(tmp_path / "store2", rc, tmp_path / "out", progress=killer, **pull_mode)
    assert killer.killed.is_set()
    assert files_of(out.dest) == files_of(src)


def test_corrupt_blob_is_refused_and_nothing_is_left(tmp_path: Path, registry: Registry, pull_mode: dict[str, object]) -> None:
    src = _checkpoint_dir(tmp_path / "ck", 40, seed=5)
    store = tmp_path / "store"
    remote = f"{registry.host}/gs-pkg/bad-fetch:v1"
    _pipelined_push(store, src, "gs-pkg/bad-fetch", remote, compress=False)
    layer = max((d for d in api.inspect(store, "gs-pkg/bad-fetch").layers if d.role in ("pages", "pack")), key=lambda d: d.size)
    data_file = registry.root / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / layer.digest[7:9] / layer.digest[7:] / "data"
    raw = bytearray(data_file.read_bytes())
    raw[1000:1010] = b"0123456789"  # same size, other bytes
    data_file.write_bytes(bytes(raw))

    work = tmp_path / "work"
    work.mkdir()
    rc = open_remote(remote, insecure=True)
    with pytest.raises(IntegrityError, match="does not match its digest"):
        api.fetch_into(tmp_path / "store2", rc, work / "checkpoint", **pull_mode)
    assert list(work.iterdir()) == []  # neither the image directory nor a partial one
    s2 = OciStore(tmp_path / "store2")
    assert s2.tags() == [] and list(s2.blobs_dir.iterdir()) == [] and list(s2.ingest_dir.iterdir()) == []


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_during_direct_restore_leaves_store_and_work_dir_clean(tmp_path: Path, registry: Registry, small_tmpfs: Path, pull_mode: dict[str, object]) -> None:
    src = _checkpoint_dir(tmp_path / "ck", 64, seed=9)
    remote = f"{registry.host}/gs-pkg/enospc-fetch:v1"
    _pipelined_push(tmp_path / "store", src, "gs-pkg/enospc-fetch", remote, compress=False)
    store = small_tmpfs / "store"
    work = small_tmpfs / "work"
    work.mkdir()
    rc = open_remote(remote, insecure=True)
    with pytest.raises(GpusnapError, match="no space left"):
        api.fetch_into(store, rc, work / "checkpoint", **pull_mode)
    assert list(work.iterdir()) == []
    s2 = OciStore(store)
    assert s2.tags() == [] and list(s2.blobs_dir.iterdir()) == [] and list(s2.ingest_dir.iterdir()) == []
    assert verify_store(s2).ok
    assert os.statvfs(small_tmpfs).f_bfree * os.statvfs(small_tmpfs).f_frsize > 40 << 20  # everything written was removed


def test_full_disk_during_pipelined_push_leaves_no_tag_on_the_registry(tmp_path: Path, registry: Registry, small_tmpfs: Path) -> None:
    src = _checkpoint_dir(tmp_path / "ck", 80, seed=13)
    store = small_tmpfs / "store"
    remote = f"{registry.host}/gs-pkg/enospc-push:v1"
    with pytest.raises(GpusnapError, match="no space left"):
        _pipelined_push(store, src, "gs-pkg/enospc-push", remote, compress=False)
    with pytest.raises(NotFoundError):
        open_remote(remote, insecure=True)
    s = OciStore(store)
    assert s.tags() == [] and list(s.ingest_dir.iterdir()) == []
    assert verify_store(s).ok


@pytest.mark.parametrize("processes", [0, 2], ids=["in-process", "2-processes"])
def test_registry_dying_during_pipelined_push_leaves_no_tag(tmp_path: Path, registry: Registry, processes: int) -> None:
    """The uploads fail while the store is still going: the failure stops the store (on_blob
    raises it) or the finish; either way the manifest is never put. Also with the uploads in
    transfer processes: the workers' error is raised here, and they end."""
    from gpusnap.errors import RegistryError
    from gpusnap.packaging.registry import PipelinedPush

    src = _checkpoint_dir(tmp_path / "ck", 96, seed=17)
    remote = f"{registry.host}/gs-pkg/dying-push:v1"
    client = RegistryClient(registry.host, insecure=True, retries=2, backoff_s=0.1, workers=2)
    killer = _KillAfter(registry, 20 << 20, pause=None)
    pipe = PipelinedPush(OciStore(tmp_path / "store"), remote, progress=killer, client=client, processes=processes)
    with pytest.raises(RegistryError):
        try:
            api.store_checkpoint(tmp_path / "store", src, form="criu-dir", ref="gs-pkg/dying-push", on_blob=pipe.on_blob)
        except BaseException:
            pipe.cancel()
            raise
        pipe.finish("gs-pkg/dying-push")
    assert killer.killed.is_set()
    if processes:
        assert all(w.proc.poll() is not None for w in pipe.sender.procs.workers)
    registry.start()
    assert not registry.has_tag("gs-pkg/dying-push", "v1")


@pytest.mark.parametrize("pipelined", [True, False], ids=["checkpoint-push", "push"])
def test_uploads_in_transfer_processes_restore_bit_exact(tmp_path: Path, registry: Registry, pipelined: bool) -> None:
    """The uploads run in two transfer processes (a host of 4 cores or more): the registry gets
    the same artifact, progress counts every byte once, the processes run at the pusher's nice
    value and end with the push; a second push of the same checkpoint sends only its config."""
    from gpusnap.packaging.registry import push_artifact

    src = _checkpoint_dir(tmp_path / "ck", 80, seed=23)
    store = tmp_path / "store"
    remote = f"{registry.host}/gs-pkg/procs-push:v1"
    prog = CountingProgress()
    if pipelined:
        result = _pipelined_push(store, src, "gs-pkg/procs-push", remote, False, progress=prog, processes=2)
    else:
        api.store_checkpoint(store, src, form="criu-dir", ref="gs-pkg/procs-push")
        result = api.push(store, "gs-pkg/procs-push", remote, insecure=True, progress=prog, processes=2)
    assert result.uploaded_bytes > 70 << 20 and prog.done == prog.total == result.uploaded_bytes  # type: ignore[attr-defined]
    again = push_artifact(OciStore(store), "gs-pkg/procs-push", f"{registry.host}/gs-pkg/procs-push:v2", insecure=True,
                          progress=NullProgress(), processes=2)
    assert again.uploaded_bytes == 0 and again.skipped_bytes == result.uploaded_bytes + result.skipped_bytes  # type: ignore[attr-defined]
    out = api.fetch_into(tmp_path / "store2", open_remote(remote, insecure=True), tmp_path / "work" / "checkpoint", processes=0)
    assert files_of(out.dest) == files_of(src)


def test_a_push_whose_transfer_processes_die_goes_on_in_its_own_process(tmp_path: Path, registry: Registry) -> None:
    """The workers killed (OOM, an operator) before and during the store: their blobs, and the
    rest, are uploaded from the pushing process instead; the artifact on the registry is whole."""
    from gpusnap.packaging.registry import PipelinedPush

    src = _checkpoint_dir(tmp_path / "ck", 80, seed=29)
    remote = f"{registry.host}/gs-pkg/procs-died:v1"
    pipe = PipelinedPush(OciStore(tmp_path / "store"), remote, insecure=True, progress=NullProgress(), processes=2)
    pipe.sender.procs.workers[0].proc.kill()
    killed = []

    def on_blob(d: object) -> None:
        if not killed:  # the other one once the first blob is out
            killed.append(True)
            pipe.sender.procs.workers[1].proc.kill()
        pipe.on_blob(d)

    try:
        api.store_checkpoint(tmp_path / "store", src, form="criu-dir", ref="gs-pkg/procs-died", on_blob=on_blob)
    except BaseException:
        pipe.cancel()
        raise
    result = pipe.finish("gs-pkg/procs-died")
    assert killed and all(w.dead for w in pipe.sender.procs.workers)
    assert result.uploaded_bytes > 70 << 20
    out = api.fetch_into(tmp_path / "store2", open_remote(remote, insecure=True), tmp_path / "work" / "checkpoint", processes=0)
    assert files_of(out.dest) == files_of(src)


def test_push_workers_take_the_pushers_nice_value(tmp_path: Path, registry: Registry) -> None:
    from gpusnap.packaging.registry import PipelinedPush

    pipe = PipelinedPush(OciStore(tmp_path / "store"), f"{registry.host}/gs-pkg/nice:v1", insecure=True,
                         progress=NullProgress(), nice=7, processes=2)
    try:
        workers = pipe.sender.procs.workers
        import time

        deadline = time.monotonic() + 30
        # The worker lowers its priority once it has read its init line: wait for that.
        while time.monotonic() < deadline and any(os.getpriority(os.PRIO_PROCESS, w.proc.pid) != 7 for w in workers):
            time.sleep(0.02)
        assert [os.getpriority(os.PRIO_PROCESS, w.proc.pid) for w in workers] == [7, 7]
    finally:
        pipe.cancel()
    assert all(w.proc.poll() is not None for w in workers)


def test_direct_restore_of_a_checkpoint_sharing_packs_fetches_only_what_it_uses(tmp_path: Path, registry: Registry, pull_mode: dict[str, object]) -> None:
    """The second checkpoint references pieces in the first one's packs (dedup); its restore
    asks the registry only for the byte span of each pack that holds pieces it uses."""
    first = _checkpoint_dir(tmp_path / "ck1", 80, seed=21)
    second = tmp_path / "ck2"
    second.mkdir()
    data = (first / "pages-1.img").read_bytes()
    (second / "pages-1.img").write_bytes(data[len(data) // 2:])
    (second / "pstree.img").write_bytes((first / "pstree.img").read_bytes())
    store = tmp_path / "store"
    _pipelined_push(store, first, "gs-pkg/share:1", f"{registry.host}/gs-pkg/share:1", compress=False)
    _pipelined_push(store, second, "gs-pkg/share:2", f"{registry.host}/gs-pkg/share:2", compress=False)
    rc = open_remote(f"{registry.host}/gs-pkg/share:2", insecure=True)
    out = api.fetch_into(tmp_path / "store2", rc, tmp_path / "out", **pull_mode)
    assert files_of(out.dest) == files_of(second)
    layers = sum(d["size"] for d in rc.manifest["layers"])
    print(f"received {out.bytes_received} of {layers} bytes of layers")
    assert out.bytes_received < layers


@pytest.mark.parametrize("corrupt", [False, True])
def test_staged_fetch_puts_all_but_the_pages_in_place_first(tmp_path: Path, registry: Registry, corrupt: bool, pull_mode: dict[str, object]) -> None:
    """As a restore fetches (orchestrate.restore): the tar layers and every blob with a byte of
    a non-pages file first, the directory renamed into place and ``staged()`` called, then the
    pages; a pages blob that fails its digest after that still leaves nothing behind."""
    from gpusnap.packaging import layout as lay

    src = _checkpoint_dir(tmp_path / "ck", 128, seed=21)  # pages over several 32 MiB packs: some hold pages only
    store = tmp_path / "store"
    remote = f"{registry.host}/gs-pkg/staged-fetch:v1"
    _pipelined_push(store, src, "gs-pkg/staged-fetch", remote, compress=False)
    rc = open_remote(remote, insecure=True)
    dest = tmp_path / "work" / "checkpoint"
    seen: dict[str, tuple[bytes, int]] = {}

    def staged() -> None:
        seen.update({k: v for k, v in files_of(dest).items() if not k.startswith("pages-")})

    from gpusnap.packaging import artifact as fmt

    layout = lay.layout_of(OciStore(store), fmt.load(OciStore(store), OciStore(store).resolve("gs-pkg/staged-fetch").digest))
    _, pages_only = lay.split_stages(layout.blobs, {f.path for f in layout.files if f.role == "pages"})
    assert pages_only, "the checkpoint has no blob of pages alone: nothing to overlap"
    if corrupt:  # a blob holding pages pieces only
        digest = pages_only[0].descriptor.digest
        data_file = registry.root / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / digest[7:9] / digest[7:] / "data"
        raw = bytearray(data_file.read_bytes())
        raw[len(raw) // 2] ^= 0x55
        data_file.write_bytes(bytes(raw))
        import threading

        cancel = threading.Event()
        with pytest.raises(IntegrityError):
            api.fetch_into(tmp_path / "store2", rc, dest, staged=staged, cancel=cancel, **pull_mode)
        assert not cancel.is_set()  # a failure is told apart from the caller's stop (ImageJob.failed)
        assert list((tmp_path / "work").iterdir()) == []  # neither the image directory nor a partial one
        assert not (tmp_path / "store2" / "restored.json").exists()
        return
    out = api.fetch_into(tmp_path / "store2", rc, dest, staged=staged, **pull_mode)
    want = files_of(src)
    assert seen == {k: v for k, v in want.items() if not k.startswith("pages-")} and "sub/big.bin" in seen
    assert files_of(out.dest) == want


def _transfer_processes(parent: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"gpusnap.packaging.transfer_worker" in cmd and ppid == parent:
            found.append(int(d.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill9_while_transferring(code: str, args: list[str], what: str) -> None:
    """Run ``code`` (a push or a fetch with two transfer processes) in a process of its own,
    kill -9 it once both workers are up, and see that they end with it."""
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", code, *args])
    try:
        deadline = time.monotonic() + 30
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            workers = _transfer_processes(proc.pid)
            time.sleep(0.005)
        assert len(workers) == 2, f"the {what} did not start its two transfer processes"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers)


def test_kill9_of_a_push_leaves_no_transfer_process_behind(tmp_path: Path, registry: Registry) -> None:
    """gpusnap killed while its transfer processes upload: they end with it, and no tag is put."""
    src = _checkpoint_dir(tmp_path / "ck", 256, seed=37)
    api.store_checkpoint(tmp_path / "store", src, form="criu-dir", ref="gs-pkg/kill-push")
    remote = f"{registry.host}/gs-pkg/kill-push:v1"
    code = ("import sys; from pathlib import Path; from gpusnap.packaging import api; "
            "api.push(Path(sys.argv[1]), 'gs-pkg/kill-push', sys.argv[2], insecure=True, processes=2)")
    _kill9_while_transferring(code, [str(tmp_path / "store"), remote], "push")
    assert not registry.has_tag("gs-pkg/kill-push", "v1")


def test_kill9_of_a_fetch_leaves_no_transfer_process_behind(tmp_path: Path, registry: Registry) -> None:
    """gpusnap killed (kill -9, OOM) while its transfer processes download: they end with it
    (each watches its parent), so nothing writes into the image directory the next run sweeps."""
    src = _checkpoint_dir(tmp_path / "ck", 256, seed=31)
    remote = f"{registry.host}/gs-pkg/kill-fetch:v1"
    _pipelined_push(tmp_path / "store", src, "gs-pkg/kill-fetch", remote, compress=False)
    code = ("import sys; from pathlib import Path; from gpusnap.packaging import api; "
            "from gpusnap.packaging.fetch import open_remote; "
            "api.fetch_into(Path(sys.argv[1]), open_remote(sys.argv[2], insecure=True), Path(sys.argv[3]), processes=2)")
    _kill9_while_transferring(code, [str(tmp_path / "store2"), remote, str(tmp_path / "work" / "checkpoint")], "fetch")
