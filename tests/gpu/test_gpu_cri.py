"""The Kubernetes path with the real CUDA driver: a pod with the ``gpusnap`` runtime handler on
containerd 2.1 (staged by tests/gpu/stage.sh into .gpu-tools/containerd2), running the
deterministic CUDA worker from the host's Python (its /usr and /opt as CRI mounts, the GPU device
nodes as CRI devices, as a device plugin hands them over). CheckpointContainer as the kubelet
calls it, the pod removed, the archive pushed as a checkpoint image to a local registry, a new pod
from that image: its GPU tensor's values equal a fresh reference run's at every step.

Mirrors tests/integration/cri/test_cri_worker.py, which runs the same pod with the driver stand-in
on CPU machines."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from gpu_harness import WORKER, assert_matches, reference
from stack.cri import CRI_PORTS, Containerd2, available, push_busybox_image
from stack.kubelet import Kubelet, Pod
from stack.registry import Registry
from stack.shim import Shim

from gpusnap.cri.image import archive_to_image, read_archive
from gpusnap.packaging.api import push

pytestmark = pytest.mark.gpu
GB = float(os.environ.get("GS_GPU_CRI_GB", "1"))
PAUSE = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 1000 & wait $!; done"]


def steps(data: Path) -> dict[int, int]:
    out = {}
    for line in (data / "out0").read_text().splitlines() if (data / "out0").exists() else []:
        parts = line.split()
        if len(parts) == 2:
            out[int(parts[0])] = int(parts[1])
    return out


def wait_step(data: Path, step: int, timeout: float = 300, pod: Pod | None = None, node: Kubelet | None = None) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(steps(data), default=0) >= step:
            return max(steps(data))
        if pod is not None and node is not None and node.state(pod) == "CONTAINER_EXITED":
            break
        time.sleep(0.05)
    why = f"step {step} not reached in {timeout}s; at {max(steps(data), default=0)}"
    if pod is not None and node is not None:
        log = pod.log.read_text(errors="replace")[-3000:] if pod.log.exists() else "(no log)"
        why += f"; container {node.state(pod)}; its log:\n{log}"
        bundle = node.ctrd.state / "st" / "io.containerd.runtime.v2.task" / "k8s.io" / pod.container / "config.json"
        if bundle.exists():
            import json

            spec = json.loads(bundle.read_text())
            why += f"\nits spec: env {spec['process'].get('env')}; mounts {[m['destination'] for m in spec.get('mounts', [])]}; " \
                   f"annotations {sorted(spec.get('annotations', {}))}"
    raise AssertionError(why)


@pytest.fixture
def node(tmp_path: Path):  # type: ignore[no-untyped-def]
    why = available()
    if why:
        pytest.skip(why + " (tests/gpu/stage.sh stages it as .gpu-tools/containerd2)")
    tools = os.environ.get("GPUSNAP_GPU_TOOLS", "")
    tools_bin = f"{tools}/bin" if tools else ""
    path = ":".join(p for p in (tools_bin, str(Path(sys.executable).parent), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin") if p)
    shim = Shim.at(tmp_path / "shim", "gpusnap-runtime", {"GPUSNAP_GPU_BACKEND": "nvidia", "PATH": path})
    with Registry(tmp_path / "registry", CRI_PORTS) as reg:
        push_busybox_image(tmp_path / "images", f"{reg.host}/k8s/pause:1", PAUSE)
        push_busybox_image(tmp_path / "images", f"{reg.host}/library/hostfs:1", ["/bin/sh"], hostfs=True)
        ctrd = Containerd2({"gpusnap": str(shim.wrapper)}, reg.host, f"{reg.host}/k8s/pause:1", tools_bin=tools_bin)
        try:
            ctrd.start()
            with ctrd.client() as cri:
                yield Kubelet(tmp_path, ctrd, reg, cri, tmp_path, f"{reg.host}/library/hostfs:1")
        finally:
            ctrd.stop()


def cuda_pod(node: Kubelet, name: str, image: str, data: Path):  # type: ignore[no-untyped-def]
    # The host's /usr folder by folder, not whole: a CRI mount is recursive, and a filesystem
    # mounted below /usr (the GPU machine's driver: squashfs on /usr/local/nvidia) is one CRIU
    # cannot dump. The driver comes as a device plugin gives it: NVIDIA_VISIBLE_DEVICES, which
    # gpusnap-runtime turns into device nodes and driver libraries.
    usr = sorted(p for p in Path("/usr").iterdir() if p.is_dir() and not p.is_symlink() and p.name != "local")
    mounts = [*((str(p), str(p), True) for p in usr), (str(data), "/data", False)]
    # The interpreter, its venv and its base installation, wherever they live (/opt/torch/.venv).
    tops = {"/" + Path(p).resolve().parts[1] for p in (sys.prefix, sys.base_prefix, sys.executable)}
    mounts += [(t, t, True) for t in sorted(tops - {"/usr"})]
    devices = [d for d in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools") if os.path.exists(d)]
    devices += sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))[:1]
    envs = {"WORKER_MODE": "cuda", "GB": str(GB), "SLEEP": "0.01", "PYTHONUNBUFFERED": "1", "HOME": "/tmp",
            "NVIDIA_VISIBLE_DEVICES": "all"}
    # What the pod was given, first in its log: the driver's folder, the linker path, the nodes.
    show = ("echo LD_LIBRARY_PATH=$LD_LIBRARY_PATH; ls -la /usr/local/gpusnap/driver/lib 2>&1 | head -8; "
            "ls -la /dev/nvidia* 2>&1; cat /proc/self/mountinfo | grep -i -e nvidia -e gpusnap; ")
    return node.run(name, "gpusnap", image, args=[f"{show}exec {sys.executable} /data/gpu_worker.py /data/out0"], envs=envs,
                    mounts=mounts, devices=devices)


def test_cuda_pod_checkpointed_by_cri_and_restored_from_image(node: Kubelet, tmp_path: Path, report) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(WORKER, data / "gpu_worker.py")
    pod = cuda_pod(node, "trainer", node.image, data)
    bundle = node.ctrd.state / "st" / "io.containerd.runtime.v2.task" / "k8s.io" / pod.container / "config.json"
    spec_at_start = bundle.read_text() if bundle.exists() else "(no bundle)"
    try:
        wait_step(data, 100, timeout=120, pod=pod, node=node)
    except AssertionError as exc:
        import json

        spec = json.loads(spec_at_start) if spec_at_start.startswith("{") else {}
        raise AssertionError(f"{exc}\nspec at start: env {spec.get('process', {}).get('env')}; "
                             f"mounts {[(m['destination'], m.get('source')) for m in spec.get('mounts', [])]}") from None
    t = time.perf_counter()
    archive = node.checkpoint(pod)
    checkpoint_s = time.perf_counter() - t
    wait_step(data, max(steps(data)) + 20)  # leave-running: it goes on after the checkpoint
    node.remove(pod)
    at_checkpoint = max(steps(data))
    meta = read_archive(archive).meta
    assert meta is not None and meta.gpus and meta.processes, "gpusnap-runtime recorded the GPU process"

    store = tmp_path / "store"
    image = archive_to_image(store, archive, "local/trainer:1")
    remote = f"{node.registry.host}/checkpoints/trainer:1"
    push(store, image.ref, remote, insecure=True)
    t = time.perf_counter()
    restored = cuda_pod(node, "trainer", remote, data)
    restore_s = time.perf_counter() - t
    stop = at_checkpoint + 300
    wait_step(data, stop, timeout=180, pod=restored, node=node)
    matched = assert_matches(steps(data), reference("cuda", GB, stop, tmp_path), after=at_checkpoint)
    print(f"cri gpu: {GB} GiB, archive {archive.stat().st_size >> 20} MiB, CheckpointContainer {checkpoint_s:.2f}s, "
          f"new pod from checkpoint image {restore_s:.2f}s, {matched} steps equal to the reference")
    # checkpoint = the kubelet's CheckpointContainer; restore = CreateContainer+Start of the new pod.
    report(test="CRI: CheckpointContainer, new pod from the checkpoint image", gib=GB, checkpoint_s=round(checkpoint_s, 2),
           restore_s=round(restore_s, 2), steps_compared=matched, archive_mib=archive.stat().st_size >> 20)
    node.remove(restored)
