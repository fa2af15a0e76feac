"""JSON Schema validators compiled to Python once, then loaded as plain modules.

Every container start runs the shim's ``create``, which checks config.json against
``schema/config.schema.json`` twice. ``jsonschema`` needs about 50 ms of imports before it can
check anything, and fastjsonschema's own package about 25 ms, against a budget of a few
milliseconds. So fastjsonschema turns the schema into Python source *once*; the source is kept
as ``<cache_dir>/<gpusnap version>-<format>/_gpusnap_schema_<name>_<sha256>.py`` (its .pyc in
``__pycache__`` beside it), and a later call imports just that file. A changed schema has
another hash, hence another file; a missing or unusable file is generated again.

The generated source normally imports its exception classes from the fastjsonschema package,
which would bring the package's 25 ms back; that one import line is pointed at
:class:`SchemaViolation` below (hand-written: a ValueError taking the same keyword arguments).

Only the standard library is imported here.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (about 2.5 ms)
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from types import ModuleType

# Bump when the way source is generated changes, so older cached files are not reused.
_FORMAT = "2"
_FJS_IMPORT = "from fastjsonschema import JsonSchemaValueException, JsonSchemaValuesException"
_OWN_IMPORT = (
    "from gpusnap.ocispec.fastvalidate import SchemaViolation as JsonSchemaValueException, "
    "SchemaViolation as JsonSchemaValuesException"
)

# The generated code names Decimal only in isinstance checks; json.loads never makes one (it
# would take parse_float=Decimal), and importing decimal costs about 1 ms.
_DECIMAL_IMPORT = "from decimal import Decimal\n"
_NO_DECIMAL = "Decimal = float  # gpusnap: documents come from json.loads, which makes no Decimal\n"


class SchemaViolation(ValueError):
    """What a generated validator raises: ``name`` is the JSON path (``data.process.env[0]``),
    ``message`` the whole sentence (``data.process.env[0] must match pattern ^[^=]+=``)."""

    def __init__(self, message: str, value: object = None, name: str = "", definition: object = None, rule: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.value = value
        self.name = name
        self.definition = definition
        self.rule = rule


def _digest(data: bytes) -> str:
    # _sha256 is the builtin behind hashlib.sha256; hashlib itself loads OpenSSL (about 2 ms).
    try:
        from _sha256 import sha256
    except ImportError:  # a Python built without it
        from hashlib import sha256
    return sha256(data).hexdigest()


def generate_source(schema_text: bytes) -> tuple[str, str]:
    """Python source of a validator for the schema (JSON text), and its entry function's name."""
    import json

    import fastjsonschema

    code = fastjsonschema.compile_to_code(json.loads(schema_text))
    if _FJS_IMPORT in code:
        code = code.replace(_FJS_IMPORT, _OWN_IMPORT, 1)
    if _DECIMAL_IMPORT in code:
        code = code.replace(_DECIMAL_IMPORT, _NO_DECIMAL, 1)
    # The schema's own function is generated first; its $defs follow.
    start = code.index("\ndef validate_") + len("\ndef ")
    entry = code[start : code.index("(", start)]
    return code, entry


def _safe(path: str) -> bool:
    """Ours alone: a module run as root must not come from a file another user can change."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _load_file(path: str, module_name: str) -> ModuleType:
    # SourceFileLoader reads the .pyc beside the file when it matches the source; importlib.util
    # would add about 1.5 ms of imports for the same thing.
    from importlib.machinery import SourceFileLoader
    from types import ModuleType

    module = ModuleType(module_name)
    module.__file__ = path
    SourceFileLoader(module_name, path).exec_module(module)
    return module


def _load_source(code: str, module_name: str) -> ModuleType:
    from types import ModuleType

    module = ModuleType(module_name)
    exec(compile(code, f"<{module_name}>", "exec"), module.__dict__)  # noqa: S102 - our own generated code
    return module


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def compiled_validator(schema_file: Path | str, cache_dir: Path | str | None = None) -> Callable[[object], object]:
    """A function that raises an exception with ``.name`` and ``.message`` when its argument
    breaks the schema in ``schema_file``. With ``cache_dir`` the generated module is kept there
    and reused; without it, it is generated in memory each time."""
    from gpusnap import __version__

    with open(schema_file, "rb") as fh:
        text = fh.read()
    digest = _digest(text)[:32]
    stem = os.path.basename(str(schema_file)).split(".")[0].replace("-", "_")
    module_name = f"_gpusnap_schema_{stem}_{digest}"
    module = sys.modules.get(module_name)
    if module is None and cache_dir is not None:
        folder = os.path.join(str(cache_dir), f"{__version__}-{_FORMAT}")
        path = os.path.join(folder, f"{module_name}.py")
        module = _from_cache(folder, path, module_name, text)
    if module is None:
        code, entry = generate_source(text)
        module = _load_source(code + f"\nENTRY = {entry!r}\n", module_name)
    sys.modules[module_name] = module
    return _checker(module)


def _from_cache(folder: str, path: str, module_name: str, text: bytes) -> ModuleType | None:
    """The cached module, generated first if missing or broken; None when the folder cannot be
    trusted or written (the caller then generates in memory)."""
    for attempt in (1, 2):
        if _safe(path) and _safe(folder):
            try:
                module = _load_file(path, module_name)
                if callable(getattr(module, str(getattr(module, "ENTRY", "")), None)):
                    return module
            except (SyntaxError, ImportError, OSError, ValueError):
                pass  # a truncated or foreign file: generate it again
        if attempt == 2:
            return None
        import py_compile  # only when generating

        try:
            os.makedirs(folder, mode=0o755, exist_ok=True)
            code, entry = generate_source(text)
            _write_atomic(path, f"# generated by gpusnap from a JSON schema; do not edit\n{code}\nENTRY = {entry!r}\n")
            # Its .pyc now, even under PYTHONDONTWRITEBYTECODE: compiling 70 kB of source on
            # every create would cost more than the validation saves.
            py_compile.compile(path, doraise=True)
        except (OSError, py_compile.PyCompileError):
            return None
    return None


def _checker(module: ModuleType) -> Callable[[object], object]:
    return getattr(module, module.ENTRY)  # type: ignore[no-any-return]


def violation_types(validator: Callable[[object], object]) -> tuple[type[BaseException], ...]:
    """The exception classes ``validator`` raises for a document that breaks its schema."""
    globals_ = getattr(validator, "__globals__", {})
    return tuple({globals_.get("JsonSchemaValueException", SchemaViolation), SchemaViolation})
