"""Defer standard-library modules until first use, for the create path's start-up time.

Every container start runs ``create`` through Python, and two imports there serve nothing
``create`` does:

- ``dataclasses`` imports ``inspect`` (with ``ast``, ``dis``, ``tokenize``: 5-8 ms on a small host)
  only to write a docstring for records that lack one; gpusnap's records all have one.
- ``pathlib`` imports ``urllib.parse`` (with ``ipaddress``: about 5 ms) only for
  ``Path.as_uri``, which gpusnap never calls on that path.

Why not ``importlib.util.LazyLoader``: its module loads on *any* attribute access, and the import
statement itself reads ``__spec__`` of a module found in ``sys.modules``, so the ``import inspect``
in ``dataclasses`` would load it at once. A plain module with a PEP 562 ``__getattr__`` has a real
``__spec__`` (None) and loads the real module only when a name it lacks is asked for.
"""

from __future__ import annotations

import sys
from types import ModuleType

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable


def defer(name: str, forward: tuple[str, ...] = ()) -> None:
    """Put a stand-in for module ``name`` in ``sys.modules`` that imports the real one on first use.

    Whoever imported the stand-in keeps it: the first name it lacks that is asked of it imports
    the real module, copies its namespace into the stand-in and answers from it, so later reads
    are plain attribute reads. ``forward`` names functions that ``from name import f`` must find
    at import time: each is a small function that loads the real module when called. A module
    already imported is left as it is.
    """
    if name in sys.modules:
        return
    stub = ModuleType(name, f"{name}, imported on first use (gpusnap.runtime_shim.lazy)")

    def real() -> ModuleType:
        if sys.modules.get(name) is stub:
            del sys.modules[name]
        import importlib

        module = importlib.import_module(name)
        stub.__dict__.update(module.__dict__)
        return module

    def getattr_(attr: str) -> object:
        if attr.startswith("__") and attr.endswith("__"):
            # The import system probes modules for __path__ & co. (is it a package?): that is
            # not a use of the module, and the answer a plain module gives is the right one.
            raise AttributeError(attr)
        return getattr(real(), attr)

    def forwarder(fn: str) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            return getattr(real(), fn)(*args, **kwargs)

        return call

    stub.__getattr__ = getattr_  # type: ignore[attr-defined]  # PEP 562: called for missing names only
    for fn in forward:
        setattr(stub, fn, forwarder(fn))
    sys.modules[name] = stub
    parent, _, child = name.rpartition(".")
    if parent:
        # `import a.b` then `a.b.x` reads the attribute of the package, which the import system
        # sets only when it loads the child itself.
        import importlib

        setattr(importlib.import_module(parent), child, stub)


def defer_unused_on_create() -> None:
    """Defer what the create path imports but never uses (see the module's docstring)."""
    defer("inspect")
    defer("urllib.parse", forward=("quote_from_bytes",))
