"""The `gpusnap` command: thin typer commands over gpusnap's core.

Every expected failure is a GpusnapError; :func:`main` prints it as one line and exits with its
ExitCode (listed in `gpusnap --help`). Tracebacks only with -v.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from gpusnap import __version__
from gpusnap.cli.context import Ctx, get_ctx, require_root
from gpusnap.cli.output import Out, print_error
from gpusnap.config import load_settings
from gpusnap.errors import ExitCode, GpusnapError
from gpusnap.process_exit import leave

EPILOG = "Exit codes: " + ", ".join(f"{c.value} {c.name.lower().replace('_', ' ')}" for c in ExitCode) + "."


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"gpusnap {__version__}")
        raise typer.Exit(0)


# Which module registers each command. A command line that names one loads that module alone:
# the others cost every call their imports and typer's building of every command (about 50 ms
# of a 0.2 s start-up on a 2-core host), and `checkpoint`/`restore` are on the path a user
# waits for. Help, completion and unknown words get every command. tests/unit/cli/test_main.py
# holds this table to what the modules register.
COMMAND_MODULES: dict[str, str] = {
    "checkpoint": "gpusnap.cli.snapshot", "restore": "gpusnap.cli.snapshot",
    "run": "gpusnap.cli.containers", "ps": "gpusnap.cli.containers", "logs": "gpusnap.cli.containers",
    "delete": "gpusnap.cli.containers",
    "doctor": "gpusnap.cli.doctor_cmd",
    "demo": "gpusnap.cli.demo",
    "push": "gpusnap.cli.artifacts", "pull": "gpusnap.cli.artifacts", "import": "gpusnap.cli.artifacts",
    "ls": "gpusnap.cli.artifacts", "rm": "gpusnap.cli.artifacts", "gc": "gpusnap.cli.artifacts",
    "inspect": "gpusnap.cli.artifacts", "verify": "gpusnap.cli.artifacts",
    "install": "gpusnap.cli.install", "uninstall": "gpusnap.cli.install",
    "suspend": "gpusnap.cli.suspend", "resume": "gpusnap.cli.suspend", "recover": "gpusnap.cli.suspend",
    "cri-image": "gpusnap.cli.cri",
}
CORE_MODULES = ("gpusnap.cli.snapshot", "gpusnap.cli.containers", "gpusnap.cli.doctor_cmd", "gpusnap.cli.demo")
# Command modules other parts of gpusnap add when present.
OPTIONAL_MODULES = ("gpusnap.cli.artifacts", "gpusnap.cli.install", "gpusnap.cli.suspend", "gpusnap.cli.cri")
GLOBAL_VALUE_OPTIONS = ("--config",)  # the global options that take a value (see _global)


def named_command(args: list[str]) -> str | None:
    """The command word of a command line (``gpusnap -v checkpoint x`` -> checkpoint); None
    when it asks for the whole app (no command, --help or --version before one)."""
    rest = iter(args)
    for arg in rest:
        if arg in ("-h", "--help", "--version"):
            return None
        if arg in GLOBAL_VALUE_OPTIONS:
            next(rest, None)
            continue
        if arg.startswith("-"):
            continue
        return arg
    return None


def command_modules(args: list[str] | None) -> tuple[str, ...]:
    """The modules to register for ``args``: the one that holds its command, else all."""
    if args is None or any(key.startswith("_GPUSNAP_COMPLETE") for key in os.environ):
        return (*CORE_MODULES, *OPTIONAL_MODULES)
    only = COMMAND_MODULES.get(named_command(args) or "")
    return (only,) if only is not None else (*CORE_MODULES, *OPTIONAL_MODULES)


def build_app(args: list[str] | None = None) -> typer.Typer:
    """The typer app; with ``args``, only the command module they need (see COMMAND_MODULES)."""
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

    import importlib

    for name in command_modules(args):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name or name not in OPTIONAL_MODULES:
                raise
            continue
        module.register(app)
    return app


def build_command(args: list[str] | None = None) -> typer.core.TyperGroup:
    """The command behind `gpusnap`, with every help text taken literally.

    Typer renders help through rich markup, so a help text such as ``HOST:CONTAINER[/tcp|udp]``
    or ``POD[/CONTAINER]`` reads as a closing tag (a crash) and a word in brackets may vanish.
    Escaping each text once here covers every command, present and future. Each paragraph is
    also joined into one line: rich keeps a docstring's own line breaks, which then end lines
    short of the terminal's width ("... each that does" / "not or" / "could not be deleted").
    """
    from rich.markup import escape

    command = typer.main.get_command(build_app(args))

    def flowed(text: str) -> str:
        return "\n\n".join(" ".join(paragraph.split()) for paragraph in text.split("\n\n"))

    def literal(cmd: object) -> None:
        for attr in ("help", "short_help", "epilog"):
            text = getattr(cmd, attr, None)
            if isinstance(text, str):
                setattr(cmd, attr, escape(flowed(text)))
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
        build_command(args).main(args=args, prog_name="gpusnap")
    except GpusnapError as exc:
        if verbose:
            traceback.print_exc()
        print_error(exc)
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
