"""Setting a host up for gpusnap and checking it: `gpusnap install` (registering with podman, docker, containerd) and `gpusnap doctor`."""
