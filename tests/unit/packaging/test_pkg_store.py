from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpusnap.errors import IntegrityError, NotFoundError, UsageError
from gpusnap.packaging.store import MEDIA_OCI_MANIFEST, Descriptor, OciStore, normalize_ref, sha256_digest


def _manifest(store: OciStore, layers: list[bytes]) -> Descriptor:
    descs = [Descriptor("application/octet-stream", store.put_bytes(b), len(b)).to_dict() for b in layers]
    cfg = store.put_bytes(b"{}")
    m = json.dumps({"schemaVersion": 2, "mediaType": MEDIA_OCI_MANIFEST,
                    "config": {"mediaType": "application/json", "digest": cfg, "size": 2}, "layers": descs}).encode()
    return Descriptor(MEDIA_OCI_MANIFEST, store.put_bytes(m), len(m))


def test_layout_files_exist(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    assert json.loads((tmp_path / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    assert json.loads((tmp_path / "index.json").read_text())["manifests"] == []
    assert s.tags() == []


def test_blob_with_wrong_digest_is_rejected_and_never_visible(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    wrong = sha256_digest(b"something else")
    with pytest.raises(IntegrityError, match="digest mismatch"):
        s.put_bytes(b"payload", wrong)
    assert not s.has_blob(wrong) and not s.has_blob(sha256_digest(b"payload"))
    assert list(s.ingest_dir.iterdir()) == []


def test_blob_with_wrong_size_is_rejected(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    w = s.writer()
    w.write(b"abc")
    with pytest.raises(IntegrityError, match="size mismatch"):
        w.commit(sha256_digest(b"abc"), 4)
    assert not s.has_blob(sha256_digest(b"abc"))
    assert list(s.ingest_dir.iterdir()) == []


def test_identical_content_is_stored_once(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    d1 = s.put_bytes(b"same bytes")
    d2 = s.put_bytes(b"same bytes")
    s.publish()
    assert d1 == d2 and len(list(s.blobs_dir.iterdir())) == 1
    assert s.put_bytes(b"same bytes") == d1 and list(s.ingest_dir.iterdir()) == []


def test_blobs_become_visible_only_when_published(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    d = s.put_bytes(b"pending")
    assert s.has_blob(d)  # this operation sees it (dedup) ...
    assert not OciStore(tmp_path).has_blob(d)  # ... nobody else does yet
    s.discard_pending()
    assert not s.has_blob(d) and list(s.ingest_dir.iterdir()) == []
    d = s.put_bytes(b"published")
    s.publish()
    assert OciStore(tmp_path).has_blob(d)


def test_tag_resolve_untag(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    m = _manifest(s, [b"layer"])
    s.tag("gs-pkg/a", m)
    s.tag("gs-pkg/a:two", m)
    assert [t.ref for t in s.tags()] == ["gs-pkg/a:latest", "gs-pkg/a:two"]
    assert s.resolve("gs-pkg/a").digest == m.digest
    assert s.resolve(m.digest).digest == m.digest
    s.untag("gs-pkg/a:latest")
    with pytest.raises(NotFoundError):
        s.resolve("gs-pkg/a:latest")
    assert s.resolve("gs-pkg/a:two").digest == m.digest


def test_retag_replaces_the_old_target(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    a, b = _manifest(s, [b"a"]), _manifest(s, [b"b"])
    s.tag("x:1", a)
    s.tag("x:1", b)
    assert [t.descriptor.digest for t in s.tags()] == [b.digest]


def test_gc_keeps_what_tags_use(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    keep = _manifest(s, [b"shared", b"only-keep"])
    drop = _manifest(s, [b"shared", b"only-drop"])
    s.tag("keep", keep)
    s.tag("drop", drop)
    s.untag("drop")
    (s.ingest_dir / "blob-stale").write_bytes(b"debris")
    removed, freed = s.gc()
    assert removed == 2 and freed > 0  # drop's manifest and its own layer
    assert s.has_blob(sha256_digest(b"shared")) and s.has_blob(sha256_digest(b"only-keep"))
    assert not s.has_blob(sha256_digest(b"only-drop")) and not s.has_blob(drop.digest)
    assert list(s.ingest_dir.iterdir()) == []


def test_corrupt_blob_is_detected_on_read(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    d = s.put_bytes(b'{"a": 1}')
    s.blob_path(d).write_bytes(b'{"a": 2}')
    with pytest.raises(IntegrityError, match="corrupt"):
        s.read_bytes(d)


@pytest.mark.parametrize("bad", ["", "../x", "/abs", "a b", "x\n"])
def test_bad_references_are_refused(bad: str) -> None:
    with pytest.raises(UsageError):
        normalize_ref(bad)


def test_reference_normalization() -> None:
    assert normalize_ref("a") == "a:latest"
    assert normalize_ref("127.0.0.1:5100/a/b") == "127.0.0.1:5100/a/b:latest"
    assert normalize_ref("127.0.0.1:5100/a/b:v1") == "127.0.0.1:5100/a/b:v1"


@pytest.mark.parametrize("size", [float("inf"), 1.5, True, -1, "12", None])
def test_descriptor_size_must_be_a_non_negative_integer(size: object) -> None:
    from gpusnap.errors import IntegrityError
    from gpusnap.packaging.store import Descriptor

    d = {"mediaType": "application/octet-stream", "digest": "sha256:" + "a" * 64, "size": size}
    with pytest.raises(IntegrityError, match="malformed OCI descriptor"):
        Descriptor.from_dict(d)
    assert Descriptor.from_dict({**d, "size": 0}).size == 0


def test_synced_blobs_are_published_without_syncfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """writer(sync=True) fdatasyncs each blob itself; publish then only renames. A few unsynced
    blobs are fdatasynced one by one at publish, more than SYNC_EACH_MAX on threads, more than
    SYNC_PARALLEL_MAX with one syncfs."""
    import gpusnap.packaging.store as store_mod

    calls = {"syncfs": 0, "fdatasync": 0}
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        calls["fdatasync"] += 1
        real_fdatasync(fd)

    monkeypatch.setattr(store_mod, "_syncfs", lambda path: calls.__setitem__("syncfs", calls["syncfs"] + 1))
    monkeypatch.setattr(store_mod.os, "fdatasync", fdatasync)
    s = OciStore(tmp_path)
    d1 = s.put_bytes(b"synced one", sync=True)
    with s.writer(sync=True, buffered=False) as w:
        w.write(b"synced two")
        d2 = w.commit()
    s.publish()
    assert calls == {"syncfs": 0, "fdatasync": 2}
    assert OciStore(tmp_path).has_blob(d1) and OciStore(tmp_path).has_blob(d2)
    s.put_bytes(b"unsynced", sync=False)
    s.put_bytes(b"synced three", sync=True)
    s.publish()
    assert calls == {"syncfs": 0, "fdatasync": 4}  # the unsynced one at publish
    for i in range(store_mod.SYNC_EACH_MAX + 1):  # more: fdatasynced on threads
        s.put_bytes(b"many %d" % i, sync=False)
    s.publish()
    assert calls == {"syncfs": 0, "fdatasync": 4 + store_mod.SYNC_EACH_MAX + 1}
    calls["fdatasync"] = 4
    monkeypatch.setattr(store_mod, "SYNC_PARALLEL_MAX", store_mod.SYNC_EACH_MAX + 4)
    for i in range(store_mod.SYNC_EACH_MAX + 5):  # more still: one syncfs
        s.put_bytes(b"more %d" % i, sync=False)
    s.publish()
    assert calls == {"syncfs": 1, "fdatasync": 4}
    s.put_bytes(b"after a discard", sync=False)
    s.discard_pending()
    s.put_bytes(b"synced four", sync=True)
    s.publish()
    assert calls == {"syncfs": 1, "fdatasync": 5}, "a discarded unsynced blob must not be synced later"


def test_unbuffered_writer_completes_short_writes(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    w = s.writer(buffered=False)
    real_write = w._file.write

    class Trickle:  # a raw file that takes at most 3 bytes per call, as write(2) may
        def __getattr__(self, name: str) -> object:
            return getattr(w._file_real, name)

        def write(self, data: bytes) -> int:
            return real_write(memoryview(data)[:3])

    w._file_real = w._file  # type: ignore[attr-defined]
    w._file = Trickle()  # type: ignore[assignment]
    payload = bytes(range(256)) * 5
    w.write(payload)
    w._file = w._file_real  # type: ignore[attr-defined]
    d = w.commit(sha256_digest(payload), len(payload))
    assert s.blob_path(d).read_bytes() == payload


def test_synced_writer_starts_writeback_as_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A synced writer hands every WRITEBACK_EVERY bytes to the kernel as they are written,
    contiguous and in order; an unsynced writer (store_checkpoint) never does."""
    import gpusnap.packaging.store as store_mod

    ranges: list[tuple[int, int]] = []
    monkeypatch.setattr(store_mod, "WRITEBACK_EVERY", 1000)
    monkeypatch.setattr(store_mod, "_start_writeback", lambda fd, off, n: ranges.append((off, n)))
    s = OciStore(tmp_path)
    payload = bytes(range(256)) * 20  # 5120 bytes
    with s.writer(sync=True, buffered=False) as w:
        for i in range(0, len(payload), 700):
            w.write(payload[i:i + 700])
        d = w.commit(sha256_digest(payload), len(payload))
    # 700-byte writes: a range after every second one; the last 920 bytes are left to fdatasync
    assert ranges == [(0, 1400), (1400, 1400), (2800, 1400)]
    assert s.blob_path(d).read_bytes() == payload
    ranges.clear()
    with s.writer() as w:
        w.write(payload * 2)
        w.commit()
    assert ranges == []


@pytest.mark.parametrize("order", ["in order", "out of order"])
def test_placed_writer_gives_the_digest_of_what_is_in_the_file(tmp_path: Path, order: str) -> None:
    # In order it hashes as it writes; out of order it reads the file back at commit. Either
    # way the blob appears only at publish, under the digest of its bytes.
    s = OciStore(tmp_path)
    parts = [os.urandom(5000), bytearray(os.urandom(70000)), memoryview(os.urandom(3))]
    offsets = [0, 5000, 75000]
    w = s.placed_writer(sync=True)
    writes = list(zip(parts, offsets))
    if order == "out of order":
        writes.reverse()
    for data, off in writes:
        assert w.pwrite([data], off) == len(data)
    whole = b"".join(bytes(p) for p in parts)
    digest = w.commit(len(whole))
    assert digest == sha256_digest(whole)
    s.publish()
    assert s.read_bytes(digest) == whole and list(s.ingest_dir.iterdir()) == []


def test_placed_writer_refuses_a_file_of_the_wrong_size_and_leaves_nothing(tmp_path: Path) -> None:
    s = OciStore(tmp_path)
    w = s.placed_writer(sync=False)
    w.pwrite([b"abc", b"def"], 0)
    with pytest.raises(IntegrityError, match="a write was lost"):
        w.commit(7)
    s.publish()
    assert list(s.ingest_dir.iterdir()) == [] and list(s.blobs_dir.iterdir()) == []
