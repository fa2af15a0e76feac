"""`docker start --checkpoint` for tests, working around moby/moby#42900."""

from __future__ import annotations

import re
import subprocess

DOCKER = "/usr/bin/docker"
_STALE = re.compile(r"failed to upload checkpoint to containerd: commit failed: content (sha256:[0-9a-f]{64}): already exists")


def start_from_checkpoint(name: str, checkpoint: str) -> None:
    """`docker start --checkpoint`, working around moby/moby#42900.

    dockerd 20.10 uploads the checkpoint into containerd's content store on every start and
    fails when a blob of the same content is still there from an earlier start (seen with plain
    runc too, so it says nothing about gpusnap). The stale blob is removed from dockerd's own
    containerd and the start tried once more; any other failure is reported as it is.
    """
    proc = subprocess.run([DOCKER, "start", "--checkpoint", checkpoint, name], capture_output=True, text=True, check=False)
    stale = _STALE.search(proc.stderr)
    if proc.returncode != 0 and stale:
        subprocess.run(["ctr", "--address", "/var/run/docker/containerd/containerd.sock", "-n", "moby", "content", "rm", stale.group(1)],
                       capture_output=True, text=True, check=False)
        proc = subprocess.run([DOCKER, "start", "--checkpoint", checkpoint, name], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"docker start --checkpoint {checkpoint} {name} exited {proc.returncode}\nstderr: {proc.stderr}"
