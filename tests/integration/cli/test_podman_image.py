"""`--podman-image`: a podman container checkpointed by gpusnap and pushed as podman's own
checkpoint image, which podman restores straight from the registry, without gpusnap; and the
refusal, one line and exit 2 with nothing done, for a checkpoint podman cannot restore."""

from __future__ import annotations

import json
import subprocess

import pytest
import requests

from gpusnap.errors import ExitCode

from .conftest import COUNTER, Gs, podman_logs, unique, wait_numbers
from .test_e2e import assert_continues

pytestmark = pytest.mark.integration


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # runc: podman's default crun cannot start containers on this host's hybrid cgroups.
    proc = subprocess.run(["podman", "--runtime", "runc", *args], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


def has_tag(registry: str, repo: str, tag: str) -> bool:
    r = requests.get(f"http://{registry}/v2/{repo}/manifests/{tag}", timeout=10,
                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    return r.status_code == 200


def test_checkpoint_push_podman_image_then_podman_restores_it_from_the_registry(gs: Gs, registry: str, podman_counter: str) -> None:
    name = podman_counter
    before = wait_numbers(lambda: podman_logs(name), 4)
    assert len(before) >= 4, before
    ref = f"{registry}/{name}:podman-image"
    out = json.loads(gs("checkpoint", name, "--push", ref, "--podman-image", "--insecure", "--compress", "--json").stdout)
    assert out["engine"] == "podman" and out["pushed"] == ref and out["podman_image"] is True, out
    assert podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip() != "running"
    last = wait_numbers(lambda: podman_logs(name), 1)[-1]
    # What the registry holds is podman's checkpoint image, not gpusnap's artifact.
    manifest = requests.get(f"http://{registry}/v2/{name}/manifests/podman-image", timeout=10,
                            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert manifest["annotations"]["io.podman.annotations.checkpoint.name"] == name
    # The local store keeps the artifact under the reference, and no temporary image tag.
    assert [r["ref"] for r in gs.json("ls")] == [ref]  # type: ignore[union-attr,index]

    podman("rm", "-f", name)
    assert podman("container", "exists", name, check=False).returncode != 0
    new = name + "-restored"
    podman("pull", "--tls-verify=false", ref)
    try:
        podman("container", "restore", "--name", new, ref)
        assert podman("inspect", "--format", "{{.State.Status}}", new).stdout.strip() == "running"
        after = wait_numbers(lambda: podman_logs(new), 3)
        after = wait_numbers(lambda: podman_logs(new), len(after) + 2)
        assert_continues(last, after)
    finally:
        podman("rmi", "-f", ref, check=False)


def test_podman_image_of_a_runc_direct_checkpoint_is_refused_with_nothing_done(gs: Gs, registry: str) -> None:
    name = unique("rd")
    gs("run", name, "--", "sh", "-c", COUNTER)
    try:
        assert len(wait_numbers(lambda: gs("logs", name, check=False).stdout, 3)) >= 3
        ref = f"{registry}/{name}:podman-image"

        # gpusnap checkpoint: refused before the container is touched.
        p = gs("checkpoint", name, "--push", ref, "--podman-image", "--insecure", check=False)
        assert p.returncode == ExitCode.USAGE, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "--podman-image" in p.stderr and "podman" in p.stderr, p.stderr
        assert [r["status"] for r in gs.json("ps") if r["name"] == name] == ["running"]  # type: ignore[union-attr,index]
        assert gs.json("ls") == []
        assert not has_tag(registry, name, "podman-image")

        # gpusnap push of a stored runc-direct checkpoint: refused before anything is made or sent.
        gs("checkpoint", name, "--leave-running")  # stored under the default reference
        rows = gs.json("ls")
        assert len(rows) == 1, rows  # type: ignore[arg-type]
        p = gs("push", rows[0]["ref"], ref, "--podman-image", "--insecure", check=False)  # type: ignore[index]
        assert p.returncode == ExitCode.USAGE, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "--podman-image" in p.stderr, p.stderr
        assert gs.json("ls") == rows, "the store must be as it was"
        assert not has_tag(registry, name, "podman-image")
    finally:
        gs("delete", name, check=False)
