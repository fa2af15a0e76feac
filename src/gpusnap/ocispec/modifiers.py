"""Spec modifiers: small units that each change config.json for one concern.

The shim runs the chain at ``create``, ``run`` and ``restore`` (a restore from docker/containerd
never passes through ``create``), so every modifier must be idempotent: applied to its own
output it changes nothing. A modifier edits the spec it is given and returns the host-side
steps its edit relies on (files to write, each with its undo); the shim runs those steps only
once the modified spec has passed validation, and undoes them if anything later fails.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpusnap.config import Settings
from gpusnap.criu.config import (
    CRIU_CONFIG_ANNOTATION,
    MANAGED_ANNOTATION,
    criu_config_path,
    options_from_annotations,
    write_config,
)
from gpusnap.steps import Step


@dataclass(frozen=True)
class ModifyContext:
    container_id: str
    bundle: Path
    command: str  # create | run | restore
    settings: Settings


class SpecModifier(Protocol):
    name: str

    def apply(self, spec: dict[str, Any], ctx: ModifyContext) -> list[Step]:
        """Edit ``spec`` in place; return the host-side steps the edit needs."""


@dataclass
class ChainResult:
    spec: dict[str, Any]
    steps: list[Step]


def apply_chain(spec: dict[str, Any], chain: Sequence[SpecModifier], ctx: ModifyContext) -> ChainResult:
    """Apply ``chain`` in order to a copy of ``spec``; ``spec`` itself is left untouched."""
    out = copy.deepcopy(spec)
    steps: list[Step] = []
    for modifier in chain:
        steps.extend(modifier.apply(out, ctx))
    return ChainResult(out, steps)


class CriuConfigModifier:
    """Points ``org.criu.config`` at a per-container file holding link-remap (+ tcp-established)."""

    name = "criu-config"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def apply(self, spec: dict[str, Any], ctx: ModifyContext) -> list[Step]:
        annotations = spec.setdefault("annotations", {})
        current = annotations.get(CRIU_CONFIG_ANNOTATION)
        if current is not None and annotations.get(MANAGED_ANNOTATION) != "true":
            return []  # the user named their own CRIU config: theirs wins
        path = criu_config_path(self.settings.run_dir, ctx.container_id)
        annotations[CRIU_CONFIG_ANNOTATION] = str(path)
        annotations[MANAGED_ANNOTATION] = "true"
        options = options_from_annotations(annotations)
        previous = path.read_bytes() if path.is_file() else None

        def undo() -> None:
            if previous is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(previous)

        return [Step(f"write CRIU config {path}", lambda: write_config(path, options), undo)]


def default_chain(settings: Settings) -> list[SpecModifier]:
    """The modifiers every container gets, in order (device modifiers join this list)."""
    from gpusnap.ocispec.gpu_modifiers import GpuInjection

    return [
        GpuInjection(settings),  # before criu-config: it adds CRIU options (AMD plugin libdir)
        CriuConfigModifier(settings),
    ]
