"""``gpusnap suspend`` / ``gpusnap resume``: free a running container's GPU memory and take it back."""

from __future__ import annotations

from typing import Optional

import typer

from gpusnap.cli.output import print_error
from gpusnap.config import load_settings
from gpusnap.errors import GpusnapError


def _fail(exc: GpusnapError) -> None:
    print_error(exc)
    raise typer.Exit(int(exc.exit_code))


def register(app: typer.Typer) -> None:
    """Add ``suspend`` and ``resume`` to the ``gpusnap`` app."""

    @app.command()
    def suspend(
        container: str = typer.Argument(..., help="runc container ID"),
        root: Optional[str] = typer.Option(None, "--root", help="runc state root of the engine (podman: /run/runc, docker: /run/docker/runtime-runc/moby)"),
    ) -> None:
        """Move CONTAINER's GPU state into host memory; it keeps running, its CUDA calls wait."""
        from gpusnap.gpu.suspend import suspend as do_suspend

        try:
            rec = do_suspend(container, load_settings(), root=root)
        except GpusnapError as exc:
            _fail(exc)
            return
        gib = rec.gpu_memory_bytes / (1 << 30)
        typer.echo(f"suspended {container}: {len(rec.processes)} GPU process(es), {gib:.2f} GiB moved to host memory in {rec.timings_s.get('total', 0):.2f} s")

    @app.command()
    def resume(
        container: str = typer.Argument(..., help="runc container ID"),
        root: Optional[str] = typer.Option(None, "--root", help="runc state root of the engine"),
    ) -> None:
        """Move a suspended CONTAINER's GPU state back onto the GPU and let it run."""
        from gpusnap.gpu.suspend import resume as do_resume

        try:
            timings = do_resume(container, load_settings(), root=root)
        except GpusnapError as exc:
            _fail(exc)
            return
        typer.echo(f"resumed {container} in {timings.get('total', 0):.2f} s")

    @app.command()
    def recover(
        container: str = typer.Argument(..., help="runc container ID"),
        root: Optional[str] = typer.Option(None, "--root", help="runc state root of the engine"),
    ) -> None:
        """After gpusnap-runtime was killed mid-checkpoint/restore: bring CONTAINER's GPU processes
        back to running and drop a dead restore's marker (idempotent)."""
        from gpusnap.checkpoint.recovery import recover as do_recover

        try:
            rec = do_recover(container, load_settings(), root=root)
        except GpusnapError as exc:
            _fail(exc)
            return
        moved = ", ".join(f"{n} {s}" for s, n in rec.moved.items()) or "none"
        typer.echo(f"{container} ({rec.status}): {rec.gpu_processes} GPU process(es), brought back to running: {moved}"
                   + ("; removed a stale restore marker" if rec.stale_marker_removed else ""))
