from gpusnap.errors import EXIT_CODE_HELP, ExitCode, GpusnapError, RegistryError
from gpusnap.metadata import METADATA_FILE, CheckpointMetadata, GpuInfo, GpuProcess


def test_metadata_round_trips_through_the_image_dir(tmp_path):
    meta = CheckpointMetadata(
        container_id="c1",
        created="2026-11-22T02:00:00Z",
        gpus=[GpuInfo(0, "GPU-1", "NVIDIA H200", 143 << 30, "580.159.04", "13.0")],
        processes=[GpuProcess(host_pid=4242, ns_pid=1, gpu_memory_bytes=1 << 30, gpu_uuids=["GPU-1"], comm="python3")],
        timings_s={"lock": 0.01, "criu dump": 1.2},
        extra={"network": {"ip": "10.233.0.2"}},
    )
    path = meta.write(tmp_path)
    assert path.name == METADATA_FILE
    assert CheckpointMetadata.read(tmp_path) == meta
    assert not list(tmp_path.glob("*.tmp"))


def test_missing_metadata_reads_as_none_and_unknown_keys_are_ignored(tmp_path):
    assert CheckpointMetadata.read(tmp_path) is None
    data = CheckpointMetadata("c", "t").to_dict() | {"from_the_future": 1}
    assert CheckpointMetadata.from_dict(data).container_id == "c"


def test_errors_are_one_line_with_their_exit_code():
    err = RegistryError("push to r/x failed:\n  401 unauthorized;   run docker login")
    assert str(err) == "push to r/x failed: 401 unauthorized; run docker login"
    assert err.exit_code == ExitCode.REGISTRY
    assert GpusnapError("x", exit_code=ExitCode.INTEGRITY).exit_code == 9
    assert "checkpoint failed" in EXIT_CODE_HELP and len(EXIT_CODE_HELP.splitlines()) == len(ExitCode)
