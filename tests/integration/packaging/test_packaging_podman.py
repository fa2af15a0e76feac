"""podman export → artifact → registry → podman restore; and podman's own checkpoint image format."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from gs_pkg_containers import COUNTER, podman, podman_count, podman_wait_count, run
from stack.registry import Registry

from gpusnap.packaging import api
from gpusnap.packaging.artifact import iter_archive

pytestmark = pytest.mark.integration
IMAGE = "localhost/gpusnap-busybox:latest"


@pytest.fixture
def podman_counter() -> Iterator[str]:
    if not shutil.which("podman") or podman("image", "exists", IMAGE, check=False).returncode != 0:
        pytest.skip("podman or the busybox image missing (run tests/host/provision.sh)")
    name = f"gs-pkg-{uuid.uuid4().hex[:8]}"
    try:
        podman("run", "-d", "--name", name, IMAGE, "sh", "-c", COUNTER)
        yield name
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)


def _tree(archive: Path, dest: Path) -> dict[str, bytes]:
    out = {}
    for e in iter_archive(archive):
        if e.stream is not None:
            out[e.name] = e.stream.read()
    return out


@pytest.mark.parametrize("compression", ["zstd", "gzip"])
def test_podman_export_roundtrip_through_registry(tmp_path: Path, registry: Registry, podman_counter: str, compression: str) -> None:
    name = podman_counter
    podman_wait_count(name, 3)
    export = tmp_path / f"export.tar.{'zst' if compression == 'zstd' else 'gz'}"
    podman("container", "checkpoint", "--compress", compression, "--export", str(export), name)
    at_checkpoint = podman_count(name) or 0
    original = _tree(export, tmp_path)
    podman("rm", "-f", name)

    store = tmp_path / "store"
    stored = api.store_checkpoint(store, export, form="podman-archive", ref="gs-pkg/podman", compress=True)
    info = api.inspect(store, stored.ref)
    assert info.engine["name"] == "podman" and info.container["name"] == name
    assert info.image["name"].startswith("localhost/gpusnap-busybox")
    remote = f"{registry.host}/gs-pkg/podman:{compression}"
    api.push(store, stored.ref, remote, insecure=True)
    shutil.rmtree(store)

    store2 = tmp_path / "store2"
    local = api.pull(store2, remote, insecure=True)
    rebuilt = api.materialize_checkpoint(store2, local, tmp_path / "rebuilt.tar.zst", form="podman-archive")
    assert _tree(rebuilt, tmp_path) == original  # every file of the export, byte for byte

    podman("container", "restore", "--import", str(rebuilt))
    try:
        assert podman_wait_count(name, at_checkpoint + 3) >= at_checkpoint + 3
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)

    # The CRIU directory alone can be taken out of a podman artifact.
    criu = api.materialize_checkpoint(store2, local, tmp_path / "criu", form="criu-dir")
    assert (criu / "pstree.img").is_file() and not (criu / "config.dump").exists()


def test_podman_checkpoint_image_restores_from_registry(tmp_path: Path, registry: Registry, podman_counter: str) -> None:
    name = podman_counter
    podman_wait_count(name, 3)
    export = tmp_path / "export.tar.zst"
    podman("container", "checkpoint", "--export", str(export), name)
    at_checkpoint = podman_count(name) or 0
    podman("rm", "-f", name)

    store = tmp_path / "store"
    stored = api.store_checkpoint(store, export, form="podman-archive", ref="gs-pkg/podman-src")
    image = api.make_podman_image(store, stored.ref, "gs-pkg/podman-image")
    remote = f"{registry.host}/gs-pkg/podman-image:v1"
    api.push(store, image.ref, remote, insecure=True)

    inspected = json.loads(run("skopeo", "inspect", "--tls-verify=false", f"docker://{remote}").stdout)
    assert inspected["Digest"] == image.digest

    # Attach the gpusnap artifact to the podman image through `subject` (referrers fallback tag).
    attached = api.push(store, stored.ref, f"{registry.host}/gs-pkg/podman-image:artifact", insecure=True, subject=remote)
    if shutil.which("oras"):
        refs = json.loads(run("oras", "discover", "--plain-http", "--format", "json", remote).stdout)
        found = refs.get("manifests") or refs.get("referrers") or []
        assert attached.digest in [m["digest"] for m in found]

    podman("pull", "--tls-verify=false", remote)
    try:
        podman("container", "restore", remote)
        assert podman_wait_count(name, at_checkpoint + 3) >= at_checkpoint + 3
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)
        podman("rmi", "-f", remote, check=False)
