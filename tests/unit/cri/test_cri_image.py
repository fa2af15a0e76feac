"""Kubelet checkpoint archives: what is read from them, what is refused, and the checkpoint image
made from one (layer = the archive byte for byte, the annotations containerd 2.x and CRI-O read)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import pytest

from gpusnap.cri.image import (
    ANN_ARCH,
    ANN_CRIO_NAME,
    ANN_CRIU_NAME,
    ANN_CRIU_NAMESPACE,
    ANN_CRIU_POD,
    ANN_CRIU_ROOTFS,
    ANN_GPUS,
    ANN_METADATA,
    archive_to_image,
    is_checkpoint_manifest,
    metadata_from_annotations,
    read_archive,
)
from gpusnap.errors import IntegrityError, UsageError
from gpusnap.metadata import CheckpointMetadata, GpuInfo, GpuProcess
from gpusnap.packaging.store import OciStore, sha256_digest

CONFIG = {"id": "abc", "name": "trainer_job_default_uid_0", "rootfsImageName": "registry.local/app:1",
          "rootfsImageRef": "registry.local/app@sha256:" + "0" * 64, "runtime": "io.containerd.runc.v2",
          "checkpointedTime": "2026-11-24T16:19:30Z"}
SPEC = {"ociVersion": "1.2.0", "annotations": {"io.kubernetes.cri.sandbox-name": "job", "io.kubernetes.cri.sandbox-namespace": "ml",
                                                "io.kubernetes.cri.container-name": "trainer"}}
STATUS = {"metadata": {"name": "trainer"}, "image": {"image": "registry.local/app:1"}}


def meta() -> CheckpointMetadata:
    return CheckpointMetadata(container_id="abc", created="2026-11-24T16:19:31Z", arch="x86_64", gpu_backend="nvidia",
                              gpus=[GpuInfo(0, "GPU-1", "NVIDIA H200", 150 << 30, "580.159.04", "13.0")],
                              processes=[GpuProcess(host_pid=4242, ns_pid=1, gpu_memory_bytes=1 << 30, gpu_uuids=["GPU-1"])])


def add(tar: tarfile.TarFile, name: str, data: bytes = b"", **kw: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in kw.items():
        setattr(info, k, v)
    tar.addfile(info, io.BytesIO(data) if data else None)


def archive(path: Path, *, extra: list[tuple[str, dict]] = (), skip: tuple[str, ...] = (), with_meta: bool = True,  # type: ignore[assignment]
            compress: bool = False) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        files = {"config.dump": json.dumps(CONFIG).encode(), "spec.dump": json.dumps(SPEC).encode(),
                 "status.dump": json.dumps(STATUS).encode(), "rootfs-diff.tar": b"x" * 1024}
        add(tar, "checkpoint", type=tarfile.DIRTYPE, mode=0o700)
        add(tar, "checkpoint/pages-1.img", b"\x00" * 4096)
        if with_meta:
            files["checkpoint/gpusnap.json"] = json.dumps(meta().to_dict()).encode()
        for name, data in files.items():
            if name not in skip:
                add(tar, name, data)
        for name, kw in extra:
            add(tar, name, **kw)
    data = buf.getvalue()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def test_reads_what_the_runtime_wrote(tmp_path: Path) -> None:
    a = read_archive(archive(tmp_path / "checkpoint-job_ml-trainer-2026.tar"))
    assert a.container_name == "trainer" and a.pod == ("job", "ml") and a.compression == "none"
    assert a.meta is not None and a.meta.gpus[0].name == "NVIDIA H200" and a.arch == "amd64"
    assert "checkpoint/pages-1.img" in a.names and "rootfs-diff.tar" in a.names


def test_plain_runc_archive_has_no_gpusnap_record(tmp_path: Path) -> None:
    a = read_archive(archive(tmp_path / "a.tar", with_meta=False))
    assert a.meta is None and a.arch == ""


@pytest.mark.parametrize("name, kw, words", [
    ("/etc/cron.d/x", {}, "absolute path"),
    ("checkpoint/../../etc/passwd", {}, "contains '..'"),
    ("checkpoint/link", {"type": tarfile.SYMTYPE, "linkname": "/etc"}, "is a link"),
    ("checkpoint/up", {"type": tarfile.SYMTYPE, "linkname": "../../.."}, "is a link"),
    ("checkpoint/hard", {"type": tarfile.LNKTYPE, "linkname": "config.dump"}, "is a link"),
    ("checkpoint/null", {"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}, "device, fifo"),
])
def test_unsafe_entries_refuse_the_whole_archive(tmp_path: Path, name: str, kw: dict, words: str) -> None:
    path = archive(tmp_path / "bad.tar", extra=[(name, kw)])
    with pytest.raises(IntegrityError) as err:
        read_archive(path)
    assert words in str(err.value) and "refusing" in str(err.value)
    with pytest.raises(IntegrityError):  # and no image is made of it
        archive_to_image(tmp_path / "store", path, "local/bad:1")
    assert not OciStore(tmp_path / "store").tags()


@pytest.mark.parametrize("missing", ["config.dump", "spec.dump"])
def test_not_a_kubelet_archive(tmp_path: Path, missing: str) -> None:
    with pytest.raises(UsageError, match=f"lacks {missing}: not a kubelet checkpoint archive"):
        read_archive(archive(tmp_path / "a.tar", skip=(missing,)))


def test_garbage_and_truncation(tmp_path: Path) -> None:
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(IntegrityError, match="not a readable tar archive"):
        read_archive(tmp_path / "junk.tar")
    whole = archive(tmp_path / "a.tar", compress=True).read_bytes()
    (tmp_path / "cut.tar.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(IntegrityError):
        read_archive(tmp_path / "cut.tar.gz")


def test_image_is_the_archive_with_runtime_annotations(tmp_path: Path) -> None:
    path = archive(tmp_path / "checkpoint-job_ml-trainer-2026.tar")
    img = archive_to_image(tmp_path / "store", path, "local/trainer:1")
    store = OciStore(tmp_path / "store")
    manifest = store.manifest(store.resolve("local/trainer:1").digest)
    layer = manifest["layers"][0]
    assert layer["digest"] == sha256_digest(path.read_bytes()) and layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    config = json.loads(store.read_bytes(manifest["config"]["digest"]))
    assert config["rootfs"]["diff_ids"] == [layer["digest"]] and config["architecture"] == "amd64" and config["os"] == "linux"
    ann = manifest["annotations"]
    assert ann[ANN_CRIU_NAME] == ann[ANN_CRIO_NAME] == "trainer"
    assert (ann[ANN_CRIU_POD], ann[ANN_CRIU_NAMESPACE], ann[ANN_CRIU_ROOTFS]) == ("job", "ml", "registry.local/app:1")
    assert ann[ANN_ARCH] == "amd64" and ann[ANN_GPUS] == "1x NVIDIA H200"
    back = metadata_from_annotations(ann)
    assert back is not None and back.processes[0].ns_pid == 1 and back.gpus[0].driver_version == "580.159.04"
    assert is_checkpoint_manifest(manifest) and img.annotations == ann


def test_gzip_archive_is_stored_uncompressed(tmp_path: Path) -> None:
    plain = archive(tmp_path / "a.tar").read_bytes()
    path = tmp_path / "a.tar.gz"
    path.write_bytes(gzip.compress(plain))
    img = archive_to_image(tmp_path / "store", path, "local/a:1", arch="arm64")
    store = OciStore(tmp_path / "store")
    manifest = store.manifest(img.digest)
    assert manifest["layers"][0]["digest"] == sha256_digest(plain)
    assert json.loads(store.read_bytes(manifest["config"]["digest"]))["architecture"] == "arm64"


def test_bad_metadata_annotation(tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match="not gpusnap checkpoint metadata"):
        metadata_from_annotations({ANN_METADATA: "{not json"})
    assert metadata_from_annotations({}) is None
