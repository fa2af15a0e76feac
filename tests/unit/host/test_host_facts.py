from __future__ import annotations

import pytest

from gpusnap.errors import IncompatibleHostError, MissingDependencyError
from gpusnap.host.facts import HostFacts, problems, require_compatible, version_tuple
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
    assert problems(two, facts(gpus=other, driver_version="580.159.04")) == ["it needs 2x NVIDIA H200 and this host has 2x NVIDIA A100"]
    msgs = problems(meta(gpus=[h200()]), facts(gpus=[h200(driver="570.1")], driver_version="570.1"))
    assert msgs == ["it was taken with NVIDIA driver 580.159.04 and this host has the older 570.1"]
    assert problems(meta(gpus=[h200()]), facts(gpus=[h200(driver="590.1")], driver_version="590.1")) == []


def test_require_compatible_messages() -> None:
    with pytest.raises(IncompatibleHostError) as exc:
        require_compatible(meta(arch="aarch64"), facts(), what="ref")
    assert str(exc.value) == "this host cannot restore ref: it was taken on aarch64 and this host is x86_64; restore it on a matching host"
    with pytest.raises(MissingDependencyError, match="CRIU not found"):
        require_compatible(meta(), facts(criu_path=None, criu_version=""), what="ref")
    with pytest.raises(MissingDependencyError, match="needs CRIU >= 4.0"):
        require_compatible(meta(), facts(criu_version="3.17.1"), what="ref")
    require_compatible(None, facts(), what="ref")


def test_gpu_state_needs_a_usable_driver() -> None:
    from gpusnap.metadata import GpuProcess

    m = meta(gpus=[h200()], processes=[GpuProcess(host_pid=10, ns_pid=1, gpu_memory_bytes=1 << 30, gpu_uuids=["GPU-0"])])
    f = facts(gpus=[h200()], driver_version="580.159.04", gpu_status=None, gpu_reason="cuda-bindings is not installed")
    assert problems(m, f) == ["it holds GPU state and this host's GPU driver cannot restore it (cuda-bindings is not installed)"]


def test_gpu_side_check_runs_with_the_standin(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With the driver stand-in as backend, the GPU side's check (free memory) refuses too."""
    import json as _json

    from gpusnap.config import load_settings
    from gpusnap.host.facts import gather
    from gpusnap.metadata import GpuProcess

    (tmp_path / "gpus.json").write_text(_json.dumps([{"uuid": "GPU-0", "name": "NVIDIA H200", "memory_total_bytes": 1 << 34,
                                                     "memory_free_bytes": 1 << 30, "mig_enabled": False,
                                                     "driver_version": "580.159.04", "cuda_version": "13.0"}]))
    settings = load_settings(env={}, gpu_backend=f"standin:{tmp_path}")
    f = gather(settings)
    assert [g.name for g in f.gpus] == ["NVIDIA H200"] and f.gpu_status is not None
    small = meta(gpus=[h200()], processes=[GpuProcess(host_pid=10, ns_pid=1, gpu_memory_bytes=1 << 20, gpu_uuids=["GPU-0"])])
    require_compatible(small, f, what="ref")
    big = meta(gpus=[h200()], processes=[GpuProcess(host_pid=10, ns_pid=1, gpu_memory_bytes=8 << 30, gpu_uuids=["GPU-0"])])
    with pytest.raises(IncompatibleHostError, match="free but the checkpoint needs"):
        require_compatible(big, f, what="ref")
