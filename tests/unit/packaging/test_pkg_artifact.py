from __future__ import annotations

import gzip
import io
import json
import random
import tarfile
from pathlib import Path

import pytest
import zstandard

from gpusnap.errors import NotFoundError, UsageError
from gpusnap.metadata import CheckpointMetadata, GpuInfo, GpuProcess
from gpusnap.packaging import api
from gpusnap.packaging import artifact as fmt
from gpusnap.packaging.artifact import iter_archive
from gpusnap.packaging.store import OciStore


def _criu_dir(path: Path, seed: int = 1, pages_mib: int = 6) -> Path:
    path.mkdir(parents=True)
    rnd = random.Random(seed)
    (path / "pages-1.img").write_bytes(b"".join(rnd.randbytes(1 << 20) for _ in range(pages_mib)))
    (path / "pages-2.img").write_bytes(b"")
    (path / "core-1.img").write_bytes(b"core")
    (path / "descriptors.json").write_text('["pipe:[1]","pipe:[2]","pipe:[3]"]')
    (path / "gpusnap.json").write_text(json.dumps(CheckpointMetadata(
        container_id="gs-pkg-c", created="2026-11-22T01:02:03Z", criu_version="4.1.1", kernel="6.18", arch="x86_64",
        runtime_version="0.1", gpus=[GpuInfo(0, "GPU-1", "H200", 1 << 30)],
        processes=[GpuProcess(10, 1, 5 << 20, ["GPU-1"], "python3")], timings_s={"lock": 0.1, "dump": 0.2}).to_dict()))
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_manifest_shape_and_annotations(tmp_path: Path) -> None:
    stored = api.store_checkpoint(tmp_path / "s", _criu_dir(tmp_path / "ck"), form="criu-dir", ref="gs-pkg/a")
    s = OciStore(tmp_path / "s")
    m = s.manifest(stored.digest)
    assert m["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert m["artifactType"] == fmt.ARTIFACT_TYPE
    assert m["config"]["mediaType"] == fmt.MEDIA_CONFIG
    a = m["annotations"]
    assert a["org.opencontainers.image.created"] == "2026-11-22T01:02:03Z"
    assert a["org.criu.checkpoint.container.name"] == "gs-pkg-c"
    assert a["org.criu.checkpoint.criu.version"] == "4.1.1"
    assert a["org.criu.checkpoint.engine.name"] == "runc"
    kinds = [x["mediaType"] for x in m["layers"]]
    assert fmt.base_media(kinds[0]) == fmt.MEDIA_CRIU and kinds[1] == fmt.MEDIA_PIECES and kinds.count(fmt.MEDIA_PACK) >= 1
    config = json.loads(s.read_bytes(m["config"]["digest"]))
    assert config["gpus"][0]["uuid"] == "GPU-1" and config["processes"][0]["gpu_memory_bytes"] == 5 << 20
    assert config["sizes"]["pages"] == 6 << 20
    assert config["timings"] == [{"step": "lock", "seconds": 0.1}, {"step": "dump", "seconds": 0.2}]
    assert config["schemaVersion"] == 2 and config["chunking"]["scheme"] == "pagemap-pages-v2"


@pytest.mark.parametrize("compress", [False, True])
def test_criu_dir_round_trip_is_byte_identical(tmp_path: Path, compress: bool) -> None:
    src = _criu_dir(tmp_path / "ck")
    api.store_checkpoint(tmp_path / "s", src, form="criu-dir", ref="gs-pkg/a", compress=compress)
    out = api.materialize_checkpoint(tmp_path / "s", "gs-pkg/a", tmp_path / "out", form="criu-dir")
    assert _files(out) == _files(src)
    docker = api.materialize_checkpoint(tmp_path / "s", "gs-pkg/a", tmp_path / "docker", form="docker-dir")
    assert _files(docker) == _files(src)


def test_unchanged_memory_is_stored_once(tmp_path: Path) -> None:
    a = _criu_dir(tmp_path / "a", pages_mib=256)
    b = _criu_dir(tmp_path / "b", pages_mib=256)
    pages = bytearray((b / "pages-1.img").read_bytes())
    pages[130 << 20: (130 << 20) + 4096] = b"\xff" * 4096  # one page changed
    (b / "pages-1.img").write_bytes(bytes(pages))
    s1 = api.store_checkpoint(tmp_path / "s", a, form="criu-dir", ref="gs-pkg/a", compress=True)
    s2 = api.store_checkpoint(tmp_path / "s", b, form="criu-dir", ref="gs-pkg/b", compress=True, parent="gs-pkg/a")
    assert s2.new_bytes < 0.25 * s1.new_bytes
    assert api.inspect(tmp_path / "s", "gs-pkg/b").parent == s1.digest


def _podman_export(path: Path, compression: str) -> Path:
    buf = io.BytesIO()
    files = {
        "config.dump": json.dumps({"id": "abc123", "name": "gs-pkg-web", "rootfsImageName": "localhost/gpusnap-busybox:latest",
                                   "rootfsImageID": "d127e4", "runtime": "runc", "checkpointedTime": "2026-11-22T01:00:00Z"}).encode(),
        "spec.dump": b"{}",
        "rootfs-diff.tar": random.Random(9).randbytes(2 << 20),
        "checkpoint/pages-1.img": random.Random(8).randbytes(3 << 20),
        "checkpoint/inventory.img": b"inv",
    }
    with tarfile.open(fileobj=buf, mode="w") as tar:
        d = tarfile.TarInfo("checkpoint")
        d.type = tarfile.DIRTYPE
        d.mode = 0o700
        tar.addfile(d)
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o600, 1_700_000_000
            tar.addfile(ti, io.BytesIO(data))
    raw = buf.getvalue()
    path.write_bytes(zstandard.ZstdCompressor().compress(raw) if compression == "zstd" else gzip.compress(raw) if compression == "gzip" else raw)
    return path


def _archive_files(path: Path) -> dict[str, bytes]:
    return {e.name: e.stream.read() for e in iter_archive(path) if e.stream is not None}


@pytest.mark.parametrize("compression", ["zstd", "gzip", "none"])
def test_podman_archive_round_trip(tmp_path: Path, compression: str) -> None:
    src = _podman_export(tmp_path / "export.tar", compression)
    stored = api.store_checkpoint(tmp_path / "s", src, form="podman-archive", ref="gs-pkg/p")
    info = api.inspect(tmp_path / "s", stored.ref)
    assert info.engine["name"] == "podman" and info.container == {"id": "abc123", "name": "gs-pkg-web"}
    assert info.image["name"] == "localhost/gpusnap-busybox:latest" and info.created == "2026-11-22T01:00:00Z"
    assert {la.role for la in info.layers} >= {"criu", "engine", "pieces", "pages", "rootfs-diff"}
    assert info.sizes["pages"] == 3 << 20 and info.sizes["rootfsDiff"] == 2 << 20
    for name in ("out.tar.zst", "out.tar.gz", "out.tar"):
        out = api.materialize_checkpoint(tmp_path / "s", stored.ref, tmp_path / name, form="podman-archive")
        assert _archive_files(out) == _archive_files(src)
    criu = api.materialize_checkpoint(tmp_path / "s", stored.ref, tmp_path / "criu", form="criu-dir")
    assert sorted(p.name for p in criu.iterdir()) == ["inventory.img", "pages-1.img"]


def test_podman_archive_from_a_criu_dir_is_refused(tmp_path: Path) -> None:
    api.store_checkpoint(tmp_path / "s", _criu_dir(tmp_path / "ck"), form="criu-dir", ref="gs-pkg/a")
    with pytest.raises(UsageError, match="podman"):
        api.materialize_checkpoint(tmp_path / "s", "gs-pkg/a", tmp_path / "x.tar.zst", form="podman-archive")
    assert not (tmp_path / "x.tar.zst").exists()


def test_existing_destination_is_refused_and_left_alone(tmp_path: Path) -> None:
    api.store_checkpoint(tmp_path / "s", _criu_dir(tmp_path / "ck"), form="criu-dir", ref="gs-pkg/a")
    dest = tmp_path / "busy"
    dest.mkdir()
    (dest / "mine").write_text("keep")
    with pytest.raises(UsageError, match="already exists"):
        api.materialize_checkpoint(tmp_path / "s", "gs-pkg/a", dest, form="criu-dir")
    assert _files(dest) == {"mine": b"keep"}


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown checkpoint form"):
        api.store_checkpoint(tmp_path / "s", tmp_path, form="zip", ref="x")
    with pytest.raises(NotFoundError):
        api.store_checkpoint(tmp_path / "s", tmp_path / "missing", form="criu-dir", ref="x")
    (tmp_path / "notar").write_bytes(b"this is not a tar archive at all" * 40)
    with pytest.raises(UsageError, match="not a tar"):
        api.store_checkpoint(tmp_path / "s", tmp_path / "notar", form="podman-archive", ref="x")
    with pytest.raises(NotFoundError):
        api.materialize_checkpoint(tmp_path / "s", "nothing", tmp_path / "o", form="criu-dir")


def test_podman_image_has_one_layer_and_podman_annotations(tmp_path: Path) -> None:
    src = _podman_export(tmp_path / "export.tar.zst", "zstd")
    api.store_checkpoint(tmp_path / "s", src, form="podman-archive", ref="gs-pkg/p")
    img = api.make_podman_image(tmp_path / "s", "gs-pkg/p", "gs-pkg/p-image")
    s = OciStore(tmp_path / "s")
    m = s.manifest(img.digest)
    assert len(m["layers"]) == 1 and m["layers"][0]["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    assert m["annotations"]["io.podman.annotations.checkpoint.name"] == "gs-pkg-web"
    assert m["annotations"]["io.podman.annotations.checkpoint.runtime.name"] == "runc"
    cfg = json.loads(s.read_bytes(m["config"]["digest"]))
    assert cfg["rootfs"]["diff_ids"] == [m["layers"][0]["digest"]]
    with s.open_blob(m["layers"][0]["digest"]) as f, tarfile.open(fileobj=f) as tar:
        assert {"config.dump", "rootfs-diff.tar", "checkpoint/pages-1.img"} <= set(tar.getnames())
