"""GPU device injection through gpusnap-runtime on the real stack (runc, podman), against a fake
NVIDIA host tree: real character nodes made with mknod, a fake /proc and driver-library dir."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from devstack import (
    PODMAN_IMAGE,
    PROBE,
    RUNC,
    SHIM,
    STABLE,
    GpuShim,
    expected_libs,
    expected_mounts,
    expected_nodes,
    make_bundle,
    make_gpu_shim,
    parse_probe,
    run,
    unique,
)


pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root and the real container stack (sudo bash tests/run.sh)"),
]


def _dev_image_nodes(images: Path) -> dict[str, tuple[int, int]]:
    """Character devices in CRIU's /dev tmpfs image: name (without ./) -> (major, minor)."""
    import tarfile

    nodes: dict[str, tuple[int, int]] = {}
    for image in images.glob("tmpfs-dev-*.tar.gz.img"):  # /dev, and tmpfs mounts below it
        with tarfile.open(image, "r:gz") as tar:
            nodes.update({m.name.removeprefix("./"): (m.devmajor, m.devminor) for m in tar.getmembers() if m.ischr()})
    return nodes


@pytest.fixture
def gpu_shim(tmp_path: Path) -> GpuShim:
    return make_gpu_shim(tmp_path / "shim")


def assert_sees_injection(view, shim: GpuShim, gpus: list[int] | None) -> None:
    tree = shim.tree
    assert view.nodes == expected_nodes(tree, gpus)
    libs = expected_libs(tree)
    assert view.libs == libs
    assert set(view.mounts) == expected_mounts()
    assert all(opts.split(",")[0] == "ro" for opts in view.mounts.values()), view.mounts
    assert view.env["LD_LIBRARY_PATH"].split(":")[0] == f"{STABLE}lib"
    assert view.env["PATH"].endswith(f":{STABLE}bin")
    chosen = tree.uuids if gpus is None else [tree.uuids[i] for i in gpus]
    assert view.env["GPUSNAP_ASSIGNED_GPUS"] == ",".join(chosen)


# ---- runc direct ---------------------------------------------------------------------------


@pytest.mark.parametrize("request_env,gpus", [("NVIDIA_VISIBLE_DEVICES=all", None), ("NVIDIA_VISIBLE_DEVICES=1", [1]),
                                               ("GPUSNAP_VISIBLE_DEVICES=GPU-00000000-1111-2222-3333-000000000000", [0])])
def test_runc_container_sees_exactly_the_injected_devices(tmp_path: Path, gpu_shim: GpuShim, request_env: str, gpus: list[int] | None) -> None:
    b = make_bundle(tmp_path, ["sh", "-c", PROBE], [request_env])
    cid = unique("runc")
    try:
        out = run([SHIM, "--root", str(b.root), "run", "--bundle", str(b.path), cid], env=gpu_shim.env(), stdin=-3)
    finally:
        run([RUNC, "--root", str(b.root), "delete", "-f", cid], check=False)
    assert_sees_injection(parse_probe(out.stdout), gpu_shim, gpus)
    assert gpu_shim.records() == {}  # createRuntime recorded it, poststop removed it


def test_none_gives_driver_but_no_gpu_and_void_gives_nothing(tmp_path: Path, gpu_shim: GpuShim) -> None:
    for value, want_ctl in (("none", True), ("void", False)):
        b = make_bundle(tmp_path / value, ["sh", "-c", PROBE], [f"NVIDIA_VISIBLE_DEVICES={value}"])
        cid = unique(value)
        try:
            out = run([SHIM, "--root", str(b.root), "run", "--bundle", str(b.path), cid], env=gpu_shim.env(), stdin=-3)
        finally:
            run([RUNC, "--root", str(b.root), "delete", "-f", cid], check=False)
        view = parse_probe(out.stdout)
        assert not any(p.rstrip("0123456789") == "/dev/nvidia" for p in view.nodes), view.nodes
        assert ("/dev/nvidiactl" in view.nodes) is want_ctl
        assert bool(view.libs) is want_ctl


@pytest.mark.parametrize("bad,needle", [("7", "no GPU '7'"), ("GPU-not-here", "no GPU 'GPU-not-here'"), ("0,", "empty item")])
def test_bad_request_fails_at_create_and_leaves_no_container(tmp_path: Path, gpu_shim: GpuShim, bad: str, needle: str) -> None:
    b = make_bundle(tmp_path, ["sh", "-c", "sleep 100"], [f"NVIDIA_VISIBLE_DEVICES={bad}"])
    before = (b.path / "config.json").read_bytes()
    cid = unique("bad")
    try:
        proc = run([SHIM, "--root", str(b.root), "create", "--bundle", str(b.path), cid], env=gpu_shim.env(), check=False, stdin=-3)
    finally:
        leftover = run([RUNC, "--root", str(b.root), "list", "-q"]).stdout.split()
        run([RUNC, "--root", str(b.root), "delete", "-f", cid], check=False)
    assert proc.returncode == 2
    assert needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    if bad == "7":
        assert all(u in proc.stderr for u in gpu_shim.tree.uuids)  # names the GPUs that exist
    assert leftover == []
    assert (b.path / "config.json").read_bytes() == before  # nothing half-done


def test_runc_checkpoint_restore_keeps_devices(tmp_path: Path, gpu_shim: GpuShim) -> None:
    b = make_bundle(tmp_path, ["sh", "-c", "while true; do sleep 0.2; done"], ["NVIDIA_VISIBLE_DEVICES=all"])
    cid = unique("cr")
    images = tmp_path / "images"
    env = gpu_shim.env()
    fds = [os.pipe() for _ in range(2)]
    os.set_blocking(fds[1][0], False)

    def detached(cmd: list[str]) -> None:
        # The container keeps runc's stdio: pipes (CRIU restores them through runc's inherit-fd).
        proc = subprocess.run(cmd, env=env, stdin=fds[0][0], stdout=fds[1][1], stderr=fds[1][1], timeout=120, check=False)
        if proc.returncode != 0:
            with contextlib.suppress(BlockingIOError):
                raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}: {os.read(fds[1][0], 65536).decode()}")
            raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}")

    try:
        detached([SHIM, "--root", str(b.root), "run", "-d", "--bundle", str(b.path), cid])
        before = parse_probe(run([RUNC, "--root", str(b.root), "exec", cid, "sh", "-c", PROBE]).stdout)
        assert_sees_injection(before, gpu_shim, None)
        assert list(gpu_shim.records()) == [cid]
        run([SHIM, "--root", str(b.root), "checkpoint", "--image-path", str(images), cid], env=env)
        assert gpu_shim.records() == {}  # the checkpointed container stopped: poststop cleaned up
        detached([SHIM, "--root", str(b.root), "restore", "-d", "--image-path", str(images), "--bundle", str(b.path), cid])
        after = parse_probe(run([RUNC, "--root", str(b.root), "exec", cid, "sh", "-c", PROBE]).stdout)
        assert after == before
        rec = gpu_shim.records()[cid]
        assert rec["restores"] == 1 and rec["gpus"] == gpu_shim.tree.uuids  # the hook knew it ran in a restore
        assert sum(1 for d in b.config()["linux"]["devices"] if d["path"] == "/dev/nvidiactl") == 1
    finally:
        run([RUNC, "--root", str(b.root), "delete", "-f", cid], check=False)
        for r, w in fds:
            for fd in (r, w):
                with contextlib.suppress(OSError):
                    os.close(fd)
    assert gpu_shim.records() == {}


def test_restore_on_a_host_with_another_driver_and_uvm_major(tmp_path: Path) -> None:
    """Checkpoint under driver 580 (UVM major 237), restore under driver 590 (UVM major 240): the
    restored container finds the new host's libraries behind the same stable path and the new
    host's device numbers: the shim's restore flow rewrites CRIU's /dev image
    (gpusnap.gpu.devnodes.retarget_step) between its spec modifiers and runc restore."""
    old = make_gpu_shim(tmp_path / "shim", "gs-dev-rt-old", host="host-old")
    new = make_gpu_shim(tmp_path / "shim", "gs-dev-rt-new", host="host-new", driver_version="590.10.02", uvm_major=240)
    b = make_bundle(tmp_path, ["sh", "-c", "while true; do sleep 0.2; done"], ["NVIDIA_VISIBLE_DEVICES=all"])
    cid = unique("move")
    images = tmp_path / "images"
    fds = [os.pipe() for _ in range(2)]
    os.set_blocking(fds[1][0], False)

    def detached(shim: GpuShim, cmd: list[str]) -> None:
        proc = subprocess.run([str(shim.wrapper), *cmd], env=shim.env(), stdin=fds[0][0], stdout=fds[1][1], stderr=fds[1][1], timeout=120, check=False)
        if proc.returncode != 0:
            with contextlib.suppress(BlockingIOError):
                raise AssertionError(f"{cmd} exited {proc.returncode}: {os.read(fds[1][0], 65536).decode()}")
            raise AssertionError(f"{cmd} exited {proc.returncode}")

    try:
        detached(old, ["--root", str(b.root), "run", "-d", "--bundle", str(b.path), cid])
        assert_sees_injection(parse_probe(run([RUNC, "--root", str(b.root), "exec", cid, "sh", "-c", PROBE]).stdout), old, None)
        run([str(old.wrapper), "--root", str(b.root), "checkpoint", "--image-path", str(images), cid], env=old.env())
        assert _dev_image_nodes(images)["nvidia-uvm"][0] == 237  # as CRIU dumped it
        detached(new, ["--root", str(b.root), "restore", "-d", "--image-path", str(images), "--bundle", str(b.path), cid])
        after = parse_probe(run([RUNC, "--root", str(b.root), "exec", cid, "sh", "-c", PROBE]).stdout)
        assert after.nodes == expected_nodes(new.tree, None)
        assert after.nodes["/dev/nvidia-uvm"][0] == 240
        uvm = {name: nums for name, nums in _dev_image_nodes(images).items() if name.startswith("nvidia-uvm")}
        assert uvm == {"nvidia-uvm": (240, 0), "nvidia-uvm-tools": (240, 1)}  # the flow rewrote the image
        assert after.libs == expected_libs(new.tree)
        assert after.libs[f"{STABLE}lib/libcuda.so.1"] == "fake libcuda.so 590.10.02"
    finally:
        run([RUNC, "--root", str(b.root), "delete", "-f", cid], check=False)
        for r, w in fds:
            for fd in (r, w):
                with contextlib.suppress(OSError):
                    os.close(fd)


def test_restore_with_another_gpu_given_swaps_the_gpu_node(tmp_path: Path, gpu_shim: GpuShim) -> None:
    """Checkpointed with GPU 0 (NVIDIA_VISIBLE_DEVICES=0), restored with GPU 1 given instead: CRIU
    unpacks /dev from the image, so gpusnap-runtime's restore rewrites the image's per-GPU node —
    the restored container has /dev/nvidia1 with the host's numbers, no /dev/nvidia0, and its
    device cgroup (from the restored spec) lets it open /dev/nvidia1 but not GPU 0's numbers."""
    b = make_bundle(tmp_path, ["sh", "-c", "while true; do sleep 0.2; done"], ["NVIDIA_VISIBLE_DEVICES=0"])
    cid = unique("swap")
    images = tmp_path / "images"
    env = gpu_shim.env()
    fds = [os.pipe() for _ in range(2)]
    os.set_blocking(fds[1][0], False)

    def detached(cmd: list[str]) -> None:
        proc = subprocess.run(cmd, env=env, stdin=fds[0][0], stdout=fds[1][1], stderr=fds[1][1], timeout=120, check=False)
        if proc.returncode != 0:
            with contextlib.suppress(BlockingIOError):
                raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}: {os.read(fds[1][0], 65536).decode()}")
            raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}")

    try:
        detached([SHIM, "--root", str(b.root), "run", "-d", "--bundle", str(b.path), cid])
        before = parse_probe(run([RUNC, "--root", str(b.root), "exec", cid, "sh", "-c", PROBE]).stdout)
        assert before.nodes == expected_nodes(gpu_shim.tree, [0])
        run([SHIM, "--root", str(b.root), "checkpoint", "--image-path", str(images), cid], env=env)
        spec = b.config()
        spec["process"]["env"] = [e for e in spec["process"]["env"] if not e.startswith("NVIDIA_VISIBLE_DEVICES=")] + ["NVIDIA_VISIBLE_DEVICES=1"]
        (b.path / "config.json").write_text(json.dumps(spec))
        detached([SHIM, "--root", str(b.root), "restore", "-d", "--image-path", str(images), "--bundle", str(b.path), cid])
        after = parse_probe(run([RUNC, "--root", str(b.root), "exec", cid, "sh", "-c", PROBE]).stdout)
        assert after.nodes == expected_nodes(gpu_shim.tree, [1])
        assert "/dev/nvidia0" not in after.nodes and "/dev/nvidia1" in after.nodes
        assert b.config()["annotations"]["gpusnap.io/assigned-gpus"] == gpu_shim.tree.uuids[1]
        # The device cgroup (from the restored spec) lets the container open GPU 1's node — no
        # driver answers here, so the kernel says ENXIO rather than the cgroup's EPERM — and
        # refuses GPU 0's numbers.
        probe = "{ busybox cat /dev/nvidia1; busybox mknod /dev/gs-g0 c %d %d && busybox cat /dev/gs-g0; } 2>&1; true" % before.nodes["/dev/nvidia0"][:2]
        opened = run([RUNC, "--root", str(b.root), "exec", cid, "sh", "-c", probe])
        gpu1, _, gpu0 = opened.stdout.partition("\n")
        assert "No such device or address" in gpu1 and "not permitted" in gpu0, opened.stdout
    finally:
        run([RUNC, "--root", str(b.root), "delete", "-f", cid], check=False)
        for r, w in fds:
            for fd in (r, w):
                with contextlib.suppress(OSError):
                    os.close(fd)


# ---- podman --------------------------------------------------------------------------------


def podman(shim: GpuShim, *args: str, check: bool = True):
    return run(["podman", "--runtime", str(shim.wrapper), *args], check=check)


def test_podman_container_checkpoint_restore_keeps_devices(gpu_shim: GpuShim, podman_names: list[str]) -> None:
    name = unique("podman")
    podman_names.append(name)
    podman(gpu_shim, "run", "-d", "--name", name, "-e", "NVIDIA_VISIBLE_DEVICES=all", PODMAN_IMAGE, "sh", "-c", "while true; do sleep 0.2; done")
    cid = podman(gpu_shim, "inspect", "--format", "{{.Id}}", name).stdout.strip()
    before = parse_probe(podman(gpu_shim, "exec", name, "sh", "-c", PROBE).stdout)
    assert_sees_injection(before, gpu_shim, None)
    assert gpu_shim.records()[cid]["gpus"] == gpu_shim.tree.uuids
    podman(gpu_shim, "container", "checkpoint", name)
    podman(gpu_shim, "container", "restore", name)
    after = parse_probe(podman(gpu_shim, "exec", name, "sh", "-c", PROBE).stdout)
    assert after == before
    assert gpu_shim.records()[cid]["restores"] >= 1
    podman(gpu_shim, "rm", "-f", "-t", "0", name)
    assert cid not in gpu_shim.records()


def test_podman_bad_index_clear_error_and_no_container(gpu_shim: GpuShim, podman_names: list[str]) -> None:
    name = unique("podbad")
    podman_names.append(name)
    proc = podman(gpu_shim, "run", "--rm", "--name", name, "-e", "NVIDIA_VISIBLE_DEVICES=3", PODMAN_IMAGE, "true", check=False)
    assert proc.returncode != 0
    assert "no GPU '3' on this host" in proc.stderr, proc.stderr
    assert run(["podman", "ps", "-a", "-q", "--filter", f"name=^{name}$"]).stdout.strip() == ""


def test_podman_given_nodes_are_completed_not_doubled(gpu_shim: GpuShim, podman_names: list[str]) -> None:
    """Nodes handed over by --device (as a Kubernetes device plugin hands them) are not a whole
    injection: the container still gets the driver. With a request, the request's GPUs (the
    given control node not doubled); with a GPU node given, exactly that GPU, whatever the
    request says."""
    ctl = gpu_shim.tree.path("/dev/nvidiactl")
    name = unique("poddev")
    podman_names.append(name)
    out = podman(gpu_shim, "run", "--rm", "--name", name, "--device", f"{ctl}:/dev/nvidiactl", "-e", "NVIDIA_VISIBLE_DEVICES=all",
                 PODMAN_IMAGE, "sh", "-c", PROBE).stdout
    assert_sees_injection(parse_probe(out), gpu_shim, None)
    gpu1 = gpu_shim.tree.path("/dev/nvidia1")
    for env in ([], ["-e", "NVIDIA_VISIBLE_DEVICES=all"]):
        name = unique("podplugin")
        podman_names.append(name)
        out = podman(gpu_shim, "run", "--rm", "--name", name, "--device", f"{ctl}:/dev/nvidiactl", "--device", f"{gpu1}:/dev/nvidia1",
                     *env, PODMAN_IMAGE, "sh", "-c", PROBE).stdout
        assert_sees_injection(parse_probe(out), gpu_shim, [1])