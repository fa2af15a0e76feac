"""runc checkpoint → store → push → delete local → pull → byte-identical → runc restore; peers read it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from gs_pkg_containers import COUNTER, RuncContainer, busybox_rootfs, files_of, run
from stack.registry import Registry

from gpusnap.errors import RegistryError
from gpusnap.metadata import CheckpointMetadata, GpuInfo, GpuProcess
from gpusnap.packaging import api
from gpusnap.packaging.artifact import ARTIFACT_TYPE
from gpusnap.packaging.progress import CountingProgress

pytestmark = pytest.mark.integration


@pytest.fixture
def counter(tmp_path: Path):
    c = RuncContainer(tmp_path / "ctr", busybox_rootfs(tmp_path / "ctr" / "rootfs"), ["sh", "-c", COUNTER])
    try:
        c.start()
        yield c
    finally:
        c.destroy()


def _metadata(container_id: str) -> CheckpointMetadata:
    return CheckpointMetadata(
        container_id=container_id, created="2026-11-22T02:00:00Z", criu_version="4.1.1", kernel="6.18", arch="x86_64",
        runtime="runc", runtime_version="1.1.5", gpu_backend="standin",
        gpus=[GpuInfo(0, "GPU-0000", "Stand-in", 80 << 30)],
        processes=[GpuProcess(host_pid=4242, ns_pid=1, gpu_memory_bytes=2 << 30, gpu_uuids=["GPU-0000"], comm="sh")],
        timings_s={"gpu_lock": 0.001, "criu_dump": 0.5},
    )


def test_runc_checkpoint_travels_through_registry_and_restores(tmp_path: Path, registry: Registry, counter: RuncContainer) -> None:
    counter.wait_count(3)
    image = tmp_path / "image"
    counter.checkpoint(image)
    at_checkpoint = counter.count()
    original = files_of(image)

    store = tmp_path / "store"
    stored = api.store_checkpoint(store, image, form="criu-dir", ref="gs-pkg/counter:1", metadata=_metadata(counter.name), compress=True)
    remote = f"{registry.host}/gs-pkg/counter:v1"
    pushed = api.push(store, stored.ref, remote, insecure=True)
    assert pushed.digest == stored.digest and pushed.uploaded_bytes > 0

    shutil.rmtree(store)  # delete local: everything must come back from the registry
    shutil.rmtree(image)
    store2 = tmp_path / "store2"
    prog = CountingProgress()
    local = api.pull(store2, remote, insecure=True, progress=prog)
    assert prog.done == prog.total > 0
    out = api.materialize_checkpoint(store2, local, tmp_path / "restored-image", form="criu-dir")
    assert files_of(out) == original  # byte-identical, file by file

    info = api.inspect(store2, local)
    assert info.container["id"] == counter.name
    assert [p["comm"] for p in info.process_tree][:1] == ["sh"]
    assert info.gpu_processes[0]["gpu_memory_bytes"] == 2 << 30
    assert info.timings["criu_dump"] == 0.5

    counter.runc("delete", counter.name, check=False)
    counter.restore(out)
    assert counter.status() == "running"
    # The counter continues from its checkpointed value: it did not start again at 1.
    after = counter.wait_count(at_checkpoint + 3)
    assert after >= at_checkpoint + 3


def test_peer_tools_read_what_gpusnap_pushed(tmp_path: Path, registry: Registry, counter: RuncContainer) -> None:
    counter.wait_count(2)
    image = tmp_path / "image"
    counter.checkpoint(image, leave_running=True)
    store = tmp_path / "store"
    stored = api.store_checkpoint(store, image, form="criu-dir", ref="gs-pkg/peer")
    remote = f"{registry.host}/gs-pkg/peer:v1"
    api.push(store, stored.ref, remote, insecure=True)
    ours = json.loads((store / "blobs" / "sha256" / stored.digest.split(":")[1]).read_bytes())

    if shutil.which("skopeo"):
        raw = run("skopeo", "inspect", "--tls-verify=false", "--raw", f"docker://{remote}").stdout
        assert json.loads(raw) == ours
        assert json.loads(raw)["artifactType"] == ARTIFACT_TYPE
    if shutil.which("oras"):
        fetched = run("oras", "manifest", "fetch", "--plain-http", remote).stdout
        assert json.loads(fetched) == ours
        desc = json.loads(run("oras", "manifest", "fetch", "--plain-http", "--descriptor", remote).stdout)
        assert desc["digest"] == stored.digest


def test_credentials_from_docker_config_and_auth_json(tmp_path: Path, auth_registry: Registry) -> None:
    import base64

    src = tmp_path / "ck"
    src.mkdir()
    (src / "inventory.img").write_bytes(b"\x19\x43\x56\x54" + b"\0" * 60)
    (src / "pages-1.img").write_bytes(bytes(range(256)) * 4096)
    store = tmp_path / "store"
    api.store_checkpoint(store, src, form="criu-dir", ref="gs-pkg/auth")
    remote = f"{auth_registry.host}/gs-pkg/auth:v1"
    home = Path(subprocess.os.environ["HOME"])

    with pytest.raises(RegistryError, match="requires a login"):
        api.push(store, "gs-pkg/auth", remote, insecure=True)

    docker_cfg = home / ".docker" / "config.json"
    docker_cfg.parent.mkdir(parents=True, exist_ok=True)
    bad = base64.b64encode(b"gs-pkg-user:wrong").decode()
    docker_cfg.write_text(json.dumps({"auths": {f"http://{auth_registry.host}": {"auth": bad}}}))
    with pytest.raises(RegistryError, match="refused the credentials") as exc:
        api.push(store, "gs-pkg/auth", remote, insecure=True)
    assert str(docker_cfg) in str(exc.value) and "\n" not in str(exc.value)

    good = base64.b64encode(b"gs-pkg-user:gs-pkg-secret").decode()
    docker_cfg.write_text(json.dumps({"auths": {auth_registry.host: {"auth": good}}}))
    assert api.push(store, "gs-pkg/auth", remote, insecure=True).uploaded_bytes > 0

    # podman's auth.json alone is enough too.
    docker_cfg.unlink()
    auth_json = home / ".config" / "containers" / "auth.json"
    auth_json.parent.mkdir(parents=True)
    auth_json.write_text(json.dumps({"auths": {auth_registry.host: {"auth": good}}}))
    local = api.pull(tmp_path / "store2", remote, insecure=True)
    out = api.materialize_checkpoint(tmp_path / "store2", local, tmp_path / "out", form="criu-dir")
    assert files_of(out) == files_of(src)


def test_unreachable_registry_fails_cleanly(tmp_path: Path) -> None:
    src = tmp_path / "ck"
    src.mkdir()
    (src / "pages-1.img").write_bytes(b"x" * 1000)
    store = tmp_path / "store"
    api.store_checkpoint(store, src, form="criu-dir", ref="gs-pkg/x")
    from stack.registry import PKG_PORTS, free_port

    port = free_port(PKG_PORTS)
    t0 = time.monotonic()
    with pytest.raises(RegistryError, match="cannot reach registry"):
        from gpusnap.packaging.registry import RegistryClient, push_artifact
        from gpusnap.packaging.store import OciStore

        push_artifact(OciStore(store), "gs-pkg/x", f"127.0.0.1:{port}/gs-pkg/x:v1",
                      client=RegistryClient(f"127.0.0.1:{port}", insecure=True, retries=2, backoff_s=0.05))
    assert time.monotonic() - t0 < 30
