"""gpusnap on a Kubernetes node: the CRI (containerd 2.x, CRI-O) as the kubelet drives it.

- :mod:`gpusnap.cri.client`: the CRI services over the node's socket, compiled from its api.proto;
- :mod:`gpusnap.cri.image`: kubelet checkpoint archives checked, and turned into checkpoint
  images that containerd 2.x and CRI-O restore when a pod's container image is one;
- :mod:`gpusnap.cri.engine`: checkpoint and restore of a pod's container by name, as ``--engine cri``.
"""
