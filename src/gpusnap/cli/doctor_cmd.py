"""`gpusnap doctor`: is this host ready to checkpoint and restore?"""

from __future__ import annotations

from typing import Annotated

import typer

from gpusnap.cli.context import get_ctx
from gpusnap.admin.doctor import FAIL, run_checks
from gpusnap.errors import ExitCode


def register(app: typer.Typer) -> None:
    @app.command()
    def doctor(
        ctx: typer.Context,
        as_json: Annotated[bool, typer.Option("--json", help="Print the checks as JSON.")] = False,
    ) -> None:
        """Check CRIU, the kernel, runc, the engines, the GPU driver and the store; say how to fix what fails."""
        c = get_ctx(ctx)
        checks = run_checks(c.settings)
        failed = [ch for ch in checks if ch.status == FAIL]
        if as_json:
            c.out.json({"ok": not failed, "checks": [ch.to_dict() for ch in checks]})
        else:
            marks = {"ok": "[green]ok[/green]  ", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]"}
            for ch in checks:
                line = f"{marks[ch.status]} {ch.name}: {ch.detail}"
                if ch.fix and ch.status != "ok":
                    line += f" -> fix: {ch.fix}"
                c.out.stdout.print(line, soft_wrap=True)
            warned = sum(ch.status == "warn" for ch in checks)
            if failed:
                c.out.info(f"{len(failed)} check(s) failed")
            else:
                c.out.info("all checks passed" + (f" ({warned} warning{'s' if warned > 1 else ''})" if warned else ""))
        if failed:
            raise typer.Exit(int(ExitCode.MISSING_DEPENDENCY))
