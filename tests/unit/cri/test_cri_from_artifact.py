"""A gpusnap artifact made into a CRI checkpoint image (``cri-image --from-artifact``): the files
containerd/CRI-O read derived from the artifact, and what is refused, leaving the store as it was.
The registry side (pull, base image lookup, push) and the restore itself are in
tests/integration/cri/test_cri_from_artifact.py."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from gpusnap.cri.from_artifact import BaseImage, Source, artifact_to_image, check_convertible, dump_files
from gpusnap.cri.image import ANN_ARCH, ANN_CRIO_NAME, ANN_CRIU_ENGINE, ANN_CRIU_NAME, ANN_CRIU_ROOTFS, goarch
from gpusnap.errors import IncompatibleHostError, UsageError
from gpusnap.metadata import CheckpointMetadata
from gpusnap.packaging import api
from gpusnap.packaging.store import OciStore

DIGEST = "sha256:" + "ab" * 32
BASE = f"reg.local:5000/lib/busybox:1@{DIGEST}"
SPEC = {"ociVersion": "1.0.2", "process": {"args": ["sh", "-c", "x"]}, "mounts": [{"destination": "/proc", "type": "proc"}],
        "annotations": {"io.gpusnap.engine": "runc-direct"}}


def criu_dir(root: Path, *, arch: str = "x86_64", rootfs: str = "busybox") -> Path:
    d = root / "ckpt"
    d.mkdir()
    (d / "inventory.img").write_bytes(b"\x01" * 64)
    (d / "pages-1.img").write_bytes(bytes(range(256)) * 64)
    CheckpointMetadata(container_id="counter", created="2026-11-24T20:00:00.123456+00:00", arch=arch,
                       extra={"container_name": "counter", "image": rootfs}).write(d)
    record = {"record": {"name": "counter", "command": ["sh"], "rootfs": rootfs}, "spec": SPEC}
    (d / "runc-direct.json").write_text(json.dumps(record))
    return d


@pytest.fixture
def store(tmp_path: Path) -> Path:
    s = tmp_path / "store"
    api.store_checkpoint(s, criu_dir(tmp_path), form="criu-dir", ref="local/counter:1")
    return s


def state(store: Path) -> tuple[list[str], list[str]]:
    return sorted(t.ref for t in OciStore(store).tags()), sorted(p.name for p in store.parent.iterdir() if p.name.startswith(".cri-image-"))


def layer_files(store: Path, ref: str) -> dict[str, bytes]:
    s = OciStore(store)
    manifest = s.manifest(s.resolve(ref).digest)
    with tarfile.open(s.blob_path(manifest["layers"][0]["digest"])) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]


def test_runc_direct_artifact_becomes_a_checkpoint_image(store: Path, tmp_path: Path) -> None:
    image = artifact_to_image(store, "local/counter:1", "cri/counter:1", base_image=BASE, arch=goarch("x86_64"))
    files = layer_files(store, image.ref)
    assert {"config.dump", "spec.dump", "status.dump", "checkpoint/gpusnap.json", "checkpoint/pages-1.img",
            "checkpoint/inventory.img", "checkpoint/runc-direct.json"} <= set(files)
    assert files["checkpoint/pages-1.img"] == (tmp_path / "ckpt" / "pages-1.img").read_bytes()
    config = json.loads(files["config.dump"])
    # containerd pulls rootfsImageRef (NAME@DIGEST) and parses rootfsImageName; Go reads RFC 3339 times.
    assert config["rootfsImageRef"] == f"reg.local:5000/lib/busybox@{DIGEST}" and config["rootfsImageName"] == "reg.local:5000/lib/busybox:1"
    assert config["checkpointedTime"] == "2026-11-24T20:00:00Z" and config["name"] == "counter"
    status = json.loads(files["status.dump"])
    assert status["metadata"]["name"] == "counter" and status["image"]["image"] == "reg.local:5000/lib/busybox:1"
    spec = json.loads(files["spec.dump"])
    assert spec["process"] == SPEC["process"] and spec["annotations"]["io.kubernetes.cri-o.Annotations"] == "{}"
    ann = image.annotations
    assert ann[ANN_CRIU_NAME] == ann[ANN_CRIO_NAME] == "counter" and ann[ANN_ARCH] == "amd64"
    assert ann[ANN_CRIU_ROOTFS] == "reg.local:5000/lib/busybox:1" and ann[ANN_CRIU_ENGINE] == "runc"
    assert ann["io.gpusnap.checkpoint.source"] == OciStore(store).resolve("local/counter:1").digest
    assert state(store) == (["cri/counter:1", "local/counter:1"], [])


def test_runc_direct_artifact_without_base_image_is_refused(store: Path) -> None:
    with pytest.raises(UsageError, match="not a registry image; pass --base-image IMAGE"):
        artifact_to_image(store, "local/counter:1", "cri/counter:1", arch="amd64")
    assert state(store) == (["local/counter:1"], [])


def test_artifact_of_another_architecture_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    api.store_checkpoint(store, criu_dir(tmp_path, arch="aarch64"), form="criu-dir", ref="local/arm:1")
    with pytest.raises(IncompatibleHostError, match="is a checkpoint for arm64 and the image would be for amd64"):
        artifact_to_image(store, "local/arm:1", "cri/arm:1", base_image=BASE, arch="amd64")
    assert state(store) == (["local/arm:1"], [])


def test_overlay_over_a_host_directory_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    api.store_checkpoint(store, criu_dir(tmp_path, rootfs="overlay"), form="criu-dir", ref="local/ov:1")
    with pytest.raises(UsageError, match="overlay over a host directory"):
        artifact_to_image(store, "local/ov:1", "cri/ov:1", base_image=BASE, arch="amd64")
    assert state(store) == (["local/ov:1"], [])


def test_unknown_reference_and_runtime_are_refused(store: Path) -> None:
    with pytest.raises(UsageError, match="not in the local store"):
        artifact_to_image(store, "nosuch:1", "cri/x:1", base_image=BASE)
    with pytest.raises(UsageError, match="unknown CRI runtime"):
        artifact_to_image(store, "local/counter:1", "cri/x:1", base_image=BASE, runtime="docker")


def test_crio_reads_rootfs_image_ref_as_an_image_id() -> None:
    src = Source("r", DIGEST, {"container": {"name": "app", "id": "123"}, "created": "2026-11-24T20:00:00Z"}, remote=False)
    base = BaseImage("reg/app:1", f"reg/app@{DIGEST}", "cd" * 32)
    assert json.loads(dump_files(src, base, None, runtime="cri-o")["config.dump"])["rootfsImageRef"] == "cd" * 32
    assert json.loads(dump_files(src, base, None)["config.dump"])["rootfsImageRef"] == f"reg/app@{DIGEST}"
    assert "spec.dump" not in dump_files(src, base, None)


def test_podman_artifact_uses_its_own_image_name() -> None:
    cfg = {"form": "podman-archive", "arch": "x86_64", "engine": {"name": "podman"}, "image": {"name": "quay.io/app:1"}}
    assert check_convertible(Source("r", DIGEST, cfg, remote=False), base_image=None, arch="amd64") == "amd64"
    with pytest.raises(UsageError, match="not a gpusnap checkpoint"):
        check_convertible(Source("r", DIGEST, {**cfg, "form": "oci-image"}, remote=False), base_image=None, arch="amd64")


def test_podman_bind_mount_without_a_containerd_counterpart_is_refused() -> None:
    from gpusnap.cri.from_artifact import check_binds

    src = Source("reg/pm:1", DIGEST, {}, remote=True)
    spec = {"mounts": [{"destination": "/etc/hosts", "type": "bind"}, {"destination": "/run/.containerenv", "type": "bind"}]}
    with pytest.raises(UsageError, match=r"bind mount /run/\.containerenv, which a containerd container never has"):
        check_binds(src, spec, "containerd")
    check_binds(src, spec, "cri-o")  # CRI-O makes one in its containers
    check_binds(src, {"mounts": [{"destination": "/etc/hosts", "type": "bind"}]}, "containerd")


def test_encrypted_artifact_is_refused(tmp_path: Path) -> None:
    import os

    from gpusnap.packaging import crypto

    store = tmp_path / "store"
    api.store_checkpoint(store, criu_dir(tmp_path), form="criu-dir", ref="local/enc:1",
                         encryption=crypto.EncryptionConfig(master=crypto.MasterKey(os.urandom(32))))
    with pytest.raises(UsageError, match="is encrypted and a checkpoint image cannot be"):
        artifact_to_image(store, "local/enc:1", "cri/enc:1", base_image=BASE, arch="amd64")
    assert state(store) == (["local/enc:1"], [])
