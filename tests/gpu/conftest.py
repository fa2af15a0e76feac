"""GPU-machine fixtures: the real CUDA driver behind gpusnap-runtime (tests/gpu/run_gpu_suite.sh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: gpu_harness, gpu_worker

from gpu_harness import MULTI_GPU_GB, Stack, host_gpus, reference  # noqa: E402
from stack.fixtures import containers  # noqa: E402,F401 (a fixture)


def gpu_present() -> bool:
    if not shutil.which("nvidia-smi") or os.geteuid() != 0:
        return False
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return proc.returncode == 0 and "GPU" in proc.stdout


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_present():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU, root, runc and CRIU (run tests/gpu/run_gpu_suite.sh on a GPU machine)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


IMAGES = Path(os.environ.get("GS_GPU_IMAGES", "/dev/shm/gs-gpu-images"))
REF_STOP = int(os.environ.get("GS_GPU_REF_STOP", "6000"))


class References:
    """Reference runs of the worker, started early in the background and shared by all tests;
    one per (GiB, number of GPUs, worker mode)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.threads: dict[tuple[float, int, str], threading.Thread] = {}
        self.results: dict[tuple[float, int, str], dict[int, int]] = {}
        self.errors: dict[tuple[float, int, str], BaseException] = {}

    def start(self, gb: float, gpus: int = 1, mode: str = "cuda") -> None:
        key = (gb, gpus, mode)
        if key in self.threads:
            return

        def work() -> None:
            try:
                self.results[key] = reference(mode, gb, REF_STOP, self.workdir, gpus=gpus)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test that needs it
                self.errors[key] = exc

        t = threading.Thread(target=work, daemon=True)
        t.start()
        self.threads[key] = t

    def get(self, gb: float, gpus: int = 1, mode: str = "cuda") -> dict[int, int]:
        key = (gb, gpus, mode)
        self.start(gb, gpus, mode)
        self.threads[key].join()
        if key in self.errors:
            raise self.errors[key]
        return self.results[key]


@pytest.fixture(scope="session")
def refs(tmp_path_factory: pytest.TempPathFactory) -> References:
    r = References(tmp_path_factory.mktemp("reference"))
    r.start(8)
    if len(host_gpus()) >= 2:
        r.start(MULTI_GPU_GB, 2)
    return r


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    criu = shutil.which("criu")
    runc = shutil.which("runc")
    shim = shutil.which("gpusnap-runtime") or str(Path(sys.executable).parent / "gpusnap-runtime")
    assert criu and runc, "criu and runc must be on PATH (run_gpu_suite.sh puts its tools folder there)"
    return Stack(
        base=tmp_path_factory.mktemp("stack"),
        mode="cuda",
        gpu_backend="nvidia",
        shim=shim,
        runc=runc,
        tools_bin=os.path.dirname(criu),
        pythonpath=os.environ.get("PYTHONPATH", ""),
    )


@pytest.fixture
def images(request: pytest.FixtureRequest):
    d = IMAGES / request.node.name.replace("[", "-").replace("]", "")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)  # GPU images are as big as the GPU state


@pytest.fixture(scope="session")
def report():
    """Figures of each test, for the table run_gpu_suite.sh prints (one JSON object a line)."""
    path = os.environ.get("GS_GPU_REPORT")

    def add(**row: object) -> None:
        if path:
            with open(path, "a") as fh:
                fh.write(json.dumps(row) + "\n")

    return add
