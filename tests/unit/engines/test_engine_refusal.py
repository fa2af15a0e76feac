"""gpusnap-runtime's refusals read back out of what each engine printed about the failed call."""

from __future__ import annotations

from gpusnap.engines.base import refusal_error, runtime_refusal
from gpusnap.errors import ExitCode

REASON = ("gpu: find GPU processes failed: host PID 22601 (sh) and 1 other process of the container hold NVIDIA device files "
          "(/dev/nvidia-standin0) but no CUDA context the driver can checkpoint; nothing was changed")
# What podman 4.3 printed here for `podman container checkpoint` when the runtime exited 10.
PODMAN = (f"gpusnap-runtime: {REASON}\n"
          "Error: `/tmp/gsw/rt checkpoint --image-path /var/lib/containers/storage/overlay-containers/438e/userdata/checkpoint "
          "--work-path /var/lib/containers/storage/overlay-containers/438e/userdata --leave-running 438e` failed: exit status 10\n")


def test_podman_output_gives_the_runtimes_code_and_reason() -> None:
    assert runtime_refusal(PODMAN) == (ExitCode.UNSUPPORTED, REASON)


def test_docker_output_gives_the_runtimes_code_and_reason() -> None:
    # What dockerd 28 answered here for `docker checkpoint create` when the runtime exited 10.
    msg = ("500 Server Error: Internal Server Error (\"Cannot checkpoint container byd: /tmp/gsw/rt did not terminate successfully: "
           f"exit status 10: gpusnap-runtime: {REASON} (rolled back: thaw the paused container for the GPU) path= "
           "/var/run/docker/containerd/daemon/io.containerd.runtime.v2.task/moby/edd0/criu-dump.log: unknown\")")
    assert runtime_refusal(msg) == (ExitCode.UNSUPPORTED, f"{REASON} (rolled back: thaw the paused container for the GPU)")


def test_runc_direct_status_given() -> None:
    assert runtime_refusal(f"gpusnap-runtime: {REASON}\n", 4) == (ExitCode.INCOMPATIBLE, REASON)


def test_other_failures_are_not_refusals() -> None:
    assert runtime_refusal(PODMAN.replace("exit status 10", "exit status 1")) is None  # a failed dump
    assert runtime_refusal(f"gpusnap-runtime: {REASON}\n", 6) is None
    assert runtime_refusal("Error: criu failed: type NOTIFY errno 0\nexit status 10") is None  # not the runtime's line
    assert runtime_refusal("") is None


def test_refusal_error_keeps_the_code_on_one_line() -> None:
    err = refusal_error("podman could not checkpoint web", (ExitCode.UNSUPPORTED, REASON), "the container was left as it was")
    assert err.exit_code == ExitCode.UNSUPPORTED and "\n" not in str(err)
    assert str(err) == f"podman could not checkpoint web: {REASON}; the container was left as it was"
