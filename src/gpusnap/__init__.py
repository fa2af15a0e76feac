"""gpusnap: checkpoint, move and restore GPU containers.

Kept import-free on purpose: the runtime shim imports this package on every container
operation, so nothing heavy may load here.
"""

__version__ = "0.1.0"
