"""Helpers that drive the real stack from tests, shared by every suite under tests/.

- :mod:`stack.proc`: running host commands, unique names, polling, the host-config lock;
- :mod:`stack.registry`: a real docker-registry per test;
- :mod:`stack.shim`: gpusnap-runtime behind a wrapper script, busybox bundles, stdio pipes;
- :mod:`stack.cri`: a private containerd 2.x daemon (CRI) per test, and busybox images pushed
  to a test registry;
- :mod:`stack.kubelet`: the CRI calls the kubelet makes, against that daemon;
- :mod:`stack.fixtures`: the pytest fixtures several suites share (the modules above do not
  import pytest: bench/ uses them too, through tests/gpu_harness.py).

Imported as ``stack.*`` with ``tests/`` on ``sys.path``: the conftest of each suite that uses it
puts it there (as they do for ``fake_gpu_tree`` and ``gpu_harness``). tests/gpu/stage.sh copies
the whole of ``tests/`` to the GPU machine, so this package goes with it.
"""
