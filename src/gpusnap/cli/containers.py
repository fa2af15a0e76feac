"""runc-direct containers: `gpusnap run`, `ps`, `logs`, `delete`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Column

from gpusnap.cli.context import get_ctx, require_root
from gpusnap.cli.output import age, print_error
from gpusnap.engines.runc_direct import BUSYBOX_ROOTFS, RuncDirectEngine
from gpusnap.errors import GpusnapError, NotFoundError


def register(app: typer.Typer) -> None:
    @app.command()
    def run(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(help="Name of the new container.")],
        command: Annotated[list[str], typer.Argument(help="Program and arguments (put `--` before them).")],
        rootfs: Annotated[str, typer.Option("--rootfs", help="Root filesystem directory; default: a static busybox tree.")] = BUSYBOX_ROOTFS,
        rootfs_overlay: Annotated[Optional[str], typer.Option("--rootfs-overlay", help="Run on an overlay of this directory (read-only lower, e.g. /) with a private writable layer, instead of --rootfs.")] = None,
        network: Annotated[str, typer.Option("--network", help="none (loopback only) or bridge.")] = "none",
        env: Annotated[Optional[list[str]], typer.Option("--env", "-E", help="KEY=VALUE, repeatable.")] = None,
        publish: Annotated[Optional[list[str]], typer.Option("--publish", "-p", help="HOST:CONTAINER[/tcp|udp] with --network bridge, repeatable.")] = None,
        ip: Annotated[Optional[str], typer.Option("--ip", help="Address on the bridge, with --network bridge; default: the next free one.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the container as JSON.")] = False,
    ) -> None:
        """Run a container on gpusnap's embedded engine (runc-direct), detached."""
        require_root("gpusnap run")
        c = get_ctx(ctx)
        argv = list(command)[1:] if command and command[0] == "--" else list(command)
        info = RuncDirectEngine(c.settings).run(name, argv, rootfs=rootfs, network=network, env=env or [], publish=publish or [], ip=ip, rootfs_overlay=rootfs_overlay)
        if as_json:
            c.out.json(info.to_dict())
        else:
            c.out.info(f"started {info.name} (pid {info.pid}); `gpusnap logs {info.name}` shows its output")

    @app.command()
    def ps(
        ctx: typer.Context,
        as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
    ) -> None:
        """List runc-direct containers."""
        c = get_ctx(ctx)
        items = RuncDirectEngine(c.settings).list()
        if as_json:
            c.out.json([i.to_dict() for i in items])
            return
        if not items:
            print("no runc-direct containers; `gpusnap run NAME -- COMMAND` starts one")
            return
        rows = [(i.name, i.status, i.pid or "", i.labels.get("network", ""), age(i.created), " ".join(i.command)) for i in items]
        columns = [
            Column("NAME", overflow="fold", min_width=min(40, max((len(i.name) for i in items), default=4))),
            Column("STATUS", no_wrap=True),
            Column("PID", no_wrap=True, justify="right"),
            Column("NET", no_wrap=True),
            Column("CREATED", no_wrap=True),
            Column("COMMAND", overflow="fold"),
        ]
        c.out.table(columns, rows)

    @app.command()
    def logs(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(help="runc-direct container name.")],
        tail: Annotated[int, typer.Option("--tail", help="Only the last N lines (0: all).")] = 0,
    ) -> None:
        """Print a runc-direct container's output."""
        c = get_ctx(ctx)
        eng = RuncDirectEngine(c.settings)
        info = eng.get(name)
        if info is None:
            raise NotFoundError(f"no runc-direct container {name}; `gpusnap ps` lists them")
        text = eng.logs(info)
        lines = text.splitlines()[-tail:] if tail > 0 else text.splitlines()
        for line in lines:
            typer.echo(line)

    @app.command()
    def delete(
        ctx: typer.Context,
        names: Annotated[list[str], typer.Argument(help="runc-direct container name(s).")],
    ) -> None:
        """Stop and delete runc-direct containers (their checkpoints stay in the store).

        Like docker and podman: deletes every NAME that exists, reports each that does not or
        could not be deleted, and then exits with the first failure's code (3 for a missing name).
        """
        c = get_ctx(ctx)
        eng = RuncDirectEngine(c.settings)
        failures: list[GpusnapError] = []
        for n in dict.fromkeys(names):  # a name given twice is deleted once
            try:
                info = eng.get(n)
                if info is None:
                    raise NotFoundError(f"no runc-direct container {n}; `gpusnap ps` lists them")
                eng.remove(info)
            except GpusnapError as exc:
                print_error(exc)
                failures.append(exc)
                continue
            c.out.info(f"deleted {info.name}")
        if failures:
            raise typer.Exit(int(failures[0].exit_code))
