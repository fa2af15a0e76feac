"""Loading, validating and atomically saving a bundle's config.json."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from gpusnap.errors import NotFoundError, UsageError

SCHEMA_FILE = Path(__file__).with_name("schema") / "config.schema.json"
FIX_HINT = "fix the bundle's config.json (see the OCI runtime spec)"


@lru_cache(maxsize=1)
def _validator() -> Any:
    import jsonschema

    schema = json.loads(SCHEMA_FILE.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


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


def _where(error: Any) -> str:
    parts = []
    for part in error.absolute_path:
        parts.append(f"[{part}]" if isinstance(part, int) else (f".{part}" if parts else str(part)))
    return "".join(parts) or "(top level)"


def validate_spec(spec: dict[str, Any], path: Path, *, stage: str = "") -> None:
    """Raise UsageError naming the file, the JSON path and the problem, if ``spec`` breaks the schema."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator().iter_errors(spec))
    if error is None:
        return
    after = f" after {stage}" if stage else ""
    raise UsageError(f"{path}{after}: {_where(error)}: {error.message}; {FIX_HINT}")


def save_spec(path: Path, spec: dict[str, Any]) -> None:
    """Replace config.json atomically (write a sibling, fsync, rename), keeping its mode."""
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o644
    tmp = path.with_name(f".{path.name}.gpusnap-{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as fh:
            json.dump(spec, fh, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
