from __future__ import annotations

import pytest

from gpusnap.errors import IncompatibleHostError, MissingDependencyError
from gpusnap.hostcheck import HostFacts, problems, require_compatible, version_tuple
from gpusnap.metadata import CheckpointMetadata, GpuInfo


def facts(**kw: object) -> HostFacts:
    base = dict(arch="x86_64", kernel="6.18.4", hostname="h", criu_path="/usr/sbin/criu", criu_version="4.1.1", gpus=[], driver_version="")
    base.update(kw)
    return HostFacts(**base)  # type: ignore[arg-type]


def meta(**kw: object) -> CheckpointMetadata:
    m = CheckpointMetadata(container_id="c", created="2026-01-01T00:00:00Z", arch="x86_64", kernel="6.18.4")
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def h200(i: int = 0, driver: str = "580.159.04") -> GpuInfo:
    return GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA H200", memory_total_bytes=1, driver_version=driver)


def test_version_tuple() -> None:
    assert version_tuple("6.18.44-fc-v595") == (6, 18, 44)
    assert version_tuple("4.1.1") == (4, 1, 1)
    assert version_tuple("580.159.04") == (580, 159, 4)


def test_same_host_is_fine() -> None:
    assert problems(meta(), facts()) == []


def test_other_arch() -> None:
    assert problems(meta(arch="aarch64"), facts()) == ["it was taken on aarch64 and this host is x86_64"]


def test_older_kernel_refused_newer_fine() -> None:
    assert problems(meta(kernel="6.18.4"), facts(kernel="6.19.0")) == []
    assert "older 6.1.0" in problems(meta(kernel="6.18.4"), facts(kernel="6.1.0"))[0]


def test_gpu_count_model_and_driver() -> None:
    two = meta(gpus=[h200(0), h200(1)])
    assert problems(two, facts(gpus=[h200(0)], driver_version="580.159.04")) == ["it needs 2x NVIDIA H200 and this host has 1x NVIDIA H200"]
    assert problems(two, facts(gpus=[h200(0), h200(1), h200(2)], driver_version="580.159.04")) == []
    assert problems(two, facts()) == ["it needs 2x NVIDIA H200 and this host has no NVIDIA GPU"]
    other = [GpuInfo(index=i, uuid=f"G{i}", name="NVIDIA A100", memory_total_bytes=1) for i in range(2)]
    assert problems(two, facts(gpus=other, driver_version="580.1")) == ["it needs 2x NVIDIA H200 and this host has 2x NVIDIA A100"]
    msgs = problems(meta(gpus=[h200()]), facts(gpus=[h200(driver="570.1")], driver_version="570.1"))
    assert msgs == ["it was taken with driver 580.159.04 and this host has 570.1 (another branch)"]


def test_require_compatible_messages() -> None:
    with pytest.raises(IncompatibleHostError) as exc:
        require_compatible(meta(arch="aarch64"), facts(), what="ref")
    assert str(exc.value) == "this host cannot restore ref: it was taken on aarch64 and this host is x86_64; restore it on a matching host"
    with pytest.raises(MissingDependencyError, match="CRIU not found"):
        require_compatible(meta(), facts(criu_path=None, criu_version=""), what="ref")
    with pytest.raises(MissingDependencyError, match="needs CRIU >= 4.0"):
        require_compatible(meta(), facts(criu_version="3.17.1"), what="ref")
    require_compatible(None, facts(), what="ref")
