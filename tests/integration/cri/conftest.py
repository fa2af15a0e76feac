"""A Kubernetes node without the kubelet: a private containerd 2.1 (tests/stack/cri.py) with a
``gpusnap`` runtime handler (gpusnap-runtime, the GPU driver stand-in as its GPU backend) and a
plain ``runc`` one, a real registry, and :class:`Kubelet` making the CRI calls the kubelet makes."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the stack package
from stack.cri import CRI_PORTS, Containerd2, available, push_busybox_image  # noqa: E402
from stack.kubelet import Kubelet, Pod, numbers, processes_with, wait_numbers  # noqa: E402,F401 (tests import them from here)
from stack.registry import Registry  # noqa: E402
from stack.shim import RUNC, Shim  # noqa: E402

PAUSE = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 1000 & wait $!; done"]
COUNTER = "i=0; while :; do echo $i; i=$((i+1)); sleep 0.1; done"
# Only the shell holds "GPU state": its sleep children drop the stand-in's marker.
GPU_COUNTER = "i=0; while :; do echo $i; i=$((i+1)); env -u GPUSNAP_STANDIN_CUDA sleep 0.1; done"
H200 = "NVIDIA H200"


def standin_gpus(model: str) -> str:
    return json.dumps([{"uuid": "GPU-5e1f0000-0000-0000-0000-000000000001", "name": model, "memory_total_bytes": 150 << 30,
                        "memory_free_bytes": 150 << 30, "mig_enabled": False, "driver_version": "580.159.04", "cuda_version": "13.0"}])


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Kubelet]:
    why = available()
    if why:
        pytest.skip(why)
    standin = tmp_path / "standin"
    standin.mkdir()
    (standin / "gpus.json").write_text(standin_gpus(H200))
    shim = Shim.at(tmp_path / "shim", "gpusnap-runtime", {"GPUSNAP_GPU_BACKEND": f"standin:{standin}"})
    with Registry(tmp_path / "registry", CRI_PORTS) as reg:
        push_busybox_image(tmp_path / "images", f"{reg.host}/k8s/pause:1", PAUSE)
        push_busybox_image(tmp_path / "images", f"{reg.host}/library/busybox:1", ["/bin/sh"])
        ctrd = Containerd2({"gpusnap": str(shim.wrapper), "runc": RUNC}, reg.host, f"{reg.host}/k8s/pause:1")
        try:
            ctrd.start()
            with ctrd.client() as cri:
                yield Kubelet(tmp_path, ctrd, reg, cri, standin, f"{reg.host}/library/busybox:1")
        finally:
            ctrd.stop()
