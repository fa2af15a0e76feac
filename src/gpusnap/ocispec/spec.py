"""Loading, validating and atomically saving a bundle's config.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpusnap.errors import NotFoundError, UsageError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: create pays for every import
if TYPE_CHECKING:
    from typing import Any

SCHEMA_FILE = Path(__file__).with_name("schema") / "config.schema.json"
FIX_HINT = "fix the bundle's config.json (see the OCI runtime spec)"


def config_path(bundle: Path) -> Path:
    return bundle / "config.json"


def load_spec(path: Path) -> dict[str, Any]:
    """Parse config.json; a missing or unreadable file or bad JSON is one UsageError line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise NotFoundError(f"{path}: no such file; give the bundle directory that holds config.json (-b/--bundle)") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror}); check the bundle's permissions") from None
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); {FIX_HINT}") from None
    except RecursionError:
        raise UsageError(f"{path}: JSON nested too deeply; {FIX_HINT}") from None
    if not isinstance(spec, dict):
        raise UsageError(f"{path}: the top level must be a JSON object; {FIX_HINT}")
    return spec


def _problem(name: str, message: str, value: object, rule: object = None, definition: object = None) -> tuple[str, str]:
    """("process.env[0]", "must match pattern ^[^=]+= (got 'X')") from a validator's error,
    whose name is the JSON path under "data" and whose message repeats that name."""
    where = name[len("data"):].lstrip(".") if name.startswith("data") else name
    problem = message[len(name):].strip() if message.startswith(name) else message
    if rule == "required" and isinstance(value, dict) and isinstance(definition, dict):
        # The validator lists every required name; say which ones are missing.
        missing = [k for k in definition.get("required") or [] if k not in value]
        if missing:
            problem = f"missing required propert{'y' if len(missing) == 1 else 'ies'} {', '.join(repr(k) for k in missing)}"
    elif not isinstance(value, (dict, list)):
        shown = repr(value)
        problem += f" (got {shown[:60] + '...' if len(shown) > 60 else shown})"
    return where or "(top level)", problem


def validate_spec(spec: dict[str, Any], path: Path, *, stage: str = "", cache_dir: Path | None = None) -> None:
    """Raise UsageError naming the file, the JSON path and the problem, if ``spec`` breaks the schema.

    The schema is compiled to a Python module (gpusnap.ocispec.fastvalidate), kept under
    ``cache_dir`` when given (the shim uses ``<run_dir>/schema``) so a create imports only that.
    """
    from gpusnap.ocispec.fastvalidate import compiled_validator, violation_types

    validate = compiled_validator(SCHEMA_FILE, cache_dir)
    try:
        validate(spec)
    except violation_types(validate) as error:
        where, problem = _problem(
            str(getattr(error, "name", "")), str(getattr(error, "message", error)), getattr(error, "value", None),
            getattr(error, "rule", None), getattr(error, "definition", None),
        )
        after = f" after {stage}" if stage else ""
        raise UsageError(f"{path}{after}: {where}: {problem}; {FIX_HINT}") from None


def save_spec(path: Path, spec: dict[str, Any]) -> None:
    """Replace config.json atomically (write a sibling, rename), keeping its mode.

    The rename keeps readers and an interrupted shim from ever seeing half a file. There is no
    fsync: it cost 2-14 ms of every container create on the test VM (hundreds of ms under I/O
    load), and the file does not outlive a crash in any use: runc reads it once, right after
    this, and the engine that owns the bundle writes it without an fsync itself and again
    before the container next starts (containerd, hence docker, keeps bundles on tmpfs under
    /run; podman's saveSpec rewrites config.json whenever it initialises the container). On
    ext4, renaming over the old file also writes the new data out first (auto_da_alloc).
    """
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o644
    text = json.dumps(spec, separators=(",", ":"))  # one write, not json.dump's many small ones
    tmp = path.with_name(f".{path.name}.gpusnap-{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
