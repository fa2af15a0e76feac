"""What every `gpusnap` command shares: the per-run context and the root check.

Kept apart from :mod:`gpusnap.cli.main` so command modules never import the module that
registers them (main imports each command module; they import only this).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import typer

from gpusnap.cli.output import Out
from gpusnap.config import Settings, load_settings
from gpusnap.errors import UsageError


@dataclass(frozen=True)
class Ctx:
    """What every command gets from the global options (kept in click's context object)."""

    settings: Settings
    out: Out


def require_root(what: str) -> None:
    """CRIU and runc need root; say so up front instead of failing halfway through."""
    if os.geteuid() != 0:
        raise UsageError(f"{what} needs root (CRIU and runc do); run it as root (with sudo if you are not)")


def get_ctx(ctx: typer.Context) -> Ctx:
    obj = ctx.find_root().obj
    if not isinstance(obj, Ctx):  # called without the callback (tests calling commands directly)
        obj = Ctx(settings=load_settings(), out=Out.make())
    return obj


__all__ = ["Ctx", "get_ctx", "require_root"]
