"""The `gpusnap` command: thin typer commands over gpusnap's core.

Every expected failure is a GpusnapError; :func:`main` prints it as one line and exits with its
ExitCode (listed in `gpusnap --help`). Tracebacks only with -v.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from gpusnap import __version__
from gpusnap.cli.context import Ctx, get_ctx, require_root
from gpusnap.cli.output import Out
from gpusnap.config import load_settings
from gpusnap.errors import ExitCode, GpusnapError
from gpusnap.process_exit import leave

EPILOG = "Exit codes: " + ", ".join(f"{c.value} {c.name.lower().replace('_', ' ')}" for c in ExitCode) + "."


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"gpusnap {__version__}")
        raise typer.Exit(0)


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="gpusnap",
        help="Checkpoint GPU (and CPU) containers, move them through a registry, restore them anywhere.",
        epilog=EPILOG,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    @app.callback()
    def _global(
        ctx: typer.Context,
        verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Print details and, on failure, the traceback.")] = False,
        config: Annotated[Optional[Path], typer.Option("--config", envvar="GPUSNAP_CONFIG", help="Config file (default /etc/gpusnap/config.toml).")] = None,
        version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True, callback=_print_version)] = False,
    ) -> None:
        ctx.obj = Ctx(settings=load_settings(config_file=config), out=Out.make(verbose))

    from gpusnap.cli import containers, demo, doctor_cmd, snapshot

    for module in (snapshot, containers, doctor_cmd, demo):
        module.register(app)
    _register_optional(app)
    return app


def _register_optional(app: typer.Typer) -> None:
    """Command modules other parts of gpusnap add (install, suspend, artifacts) when present."""
    import importlib

    for name in ("gpusnap.cli.artifacts", "gpusnap.cli.install", "gpusnap.cli.suspend", "gpusnap.cli.cri"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(app)


def build_command() -> typer.core.TyperGroup:
    """The command behind `gpusnap`, with every help text taken literally.

    Typer renders help through rich markup, so a help text such as ``HOST:CONTAINER[/tcp|udp]``
    or ``POD[/CONTAINER]`` reads as a closing tag (a crash) and a word in brackets may vanish.
    Escaping each text once here covers every command, present and future.
    """
    from rich.markup import escape

    command = typer.main.get_command(build_app())

    def literal(cmd: object) -> None:
        for attr in ("help", "short_help", "epilog"):
            text = getattr(cmd, attr, None)
            if isinstance(text, str):
                setattr(cmd, attr, escape(text))
        for param in getattr(cmd, "params", []):
            if isinstance(getattr(param, "help", None), str):
                param.help = escape(param.help)
        for sub in getattr(cmd, "commands", {}).values():
            literal(sub)

    literal(command)
    return command  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    # -v is parsed by typer too; it is read here because the error handler runs after typer's
    # context is gone.
    verbose = any(a in ("-v", "--verbose") for a in args)
    try:
        # Standalone mode: typer/click print usage errors themselves (exit 2) and turn --help,
        # completion, typer.Exit and a command's normal end into SystemExit.
        build_command().main(args=args, prog_name="gpusnap")
    except GpusnapError as exc:
        if verbose:
            traceback.print_exc()
        print(f"gpusnap: error: {exc}", file=sys.stderr)
        sys.exit(int(exc.exit_code))
    except KeyboardInterrupt:
        print("gpusnap: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - unexpected: one line, details with -v
        if verbose:
            traceback.print_exc()
        msg = " ".join(str(exc).split()) or type(exc).__name__
        print(f"gpusnap: internal error: {type(exc).__name__}: {msg} (run again with -v for details and report it)", file=sys.stderr)
        sys.exit(int(ExitCode.FAILURE))


def run() -> None:
    """The `gpusnap` console script: :func:`main`, then :func:`leave` (tests call main, whose
    SystemExit they catch)."""
    try:
        main()
    except SystemExit as done:
        leave(done.code)
    leave(None)


__all__ = ["main", "run", "build_app", "build_command", "get_ctx", "require_root", "Ctx"]
