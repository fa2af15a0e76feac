"""gpusnap.runtime_shim.lazy: a deferred module loads on first use and is then the real one
(test_shim_create_imports.py checks that create never uses it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_deferred_module_loads_on_first_use() -> None:
    out = _run(
        """
        import sys
        from gpusnap.runtime_shim.lazy import defer
        defer("inspect")
        import inspect
        stub = inspect
        assert "ast" not in sys.modules
        print(str(inspect.signature(divmod)), inspect.isfunction(defer), "ast" in sys.modules)
        import inspect as again
        print(again.ismodule(stub), stub.getdoc is again.getdoc)
        from dataclasses import dataclass
        @dataclass
        class NoDoc:
            x: int
        print(NoDoc.__doc__)
        """
    )
    assert out.splitlines() == ["(x, y, /) True True", "True True", "NoDoc(x: int)"]


def test_defer_leaves_an_imported_module_alone() -> None:
    out = _run(
        """
        import sys, json
        from gpusnap.runtime_shim.lazy import defer
        before = sys.modules["json"]
        defer("json")
        print(sys.modules["json"] is before)
        """
    )
    assert out == "True"


def test_forwarded_function_and_submodule() -> None:
    out = _run(
        """
        import sys
        from gpusnap.runtime_shim.lazy import defer
        defer("urllib.parse", forward=("quote_from_bytes",))
        from pathlib import Path
        print("ipaddress" in sys.modules)
        print(Path("/a b").as_uri(), "ipaddress" in sys.modules)
        import urllib.parse
        print(urllib.parse.urlsplit("http://h:5000/x").port)
        """
    )
    assert out.splitlines() == ["False", "file:///a%20b True", "5000"]


def test_missing_name_still_raises() -> None:
    out = _run(
        """
        from gpusnap.runtime_shim.lazy import defer
        defer("inspect")
        import inspect
        try:
            inspect.no_such_thing
        except AttributeError:
            print("AttributeError")
        """
    )
    assert out == "AttributeError"
