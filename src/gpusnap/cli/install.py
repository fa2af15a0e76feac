"""``gpusnap install`` / ``gpusnap uninstall``: register the runtime and hooks with an engine."""

from __future__ import annotations

import os
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from gpusnap.cli.output import print_error
from gpusnap.admin import install as core
from gpusnap.errors import GpusnapError, UsageError


class Engine(str, Enum):
    podman = "podman"
    docker = "docker"
    containerd = "containerd"


EngineArg = Annotated[Engine, typer.Argument(help="Container engine to register with.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Only print what would change.")]
Name = Annotated[str, typer.Option("--name", help="Runtime name the engine will know gpusnap by.")]
RuntimePath = Annotated[Optional[Path], typer.Option("--runtime-path", help="gpusnap-runtime to register (default: beside gpusnap, or on PATH).")]
HookPath = Annotated[Optional[Path], typer.Option("--hook-path", help="gpusnap-hook for podman's hooks.d (default: beside gpusnap, or on PATH).")]
HooksDir = Annotated[Optional[Path], typer.Option("--hooks-dir", help="podman hooks.d directory (default: containers.conf's hooks_dir, else /usr/share/containers/oci/hooks.d).")]
ConfD = Annotated[Path, typer.Option("--containers-conf-d", help="containers.conf drop-in directory.")]
Conf = Annotated[Path, typer.Option("--containers-conf", help="containers.conf read for current runtime_supports_json.")]
DaemonJson = Annotated[Path, typer.Option("--daemon-json", help="dockerd's daemon.json.")]
ContainerdConfig = Annotated[Path, typer.Option("--containerd-config", help="containerd's config.toml.")]
Reload = Annotated[bool, typer.Option("--reload", help="docker: send SIGHUP to dockerd (pid from --docker-pidfile) so it loads the runtime.")]
PidFile = Annotated[Path, typer.Option("--docker-pidfile", help="dockerd's pid file, for --reload.")]
ConfigVersion = Annotated[int, typer.Option("--containerd-config-version", help="containerd: version of a new config.toml, 3 (containerd 2.x) or 2 (1.x); default: asked of `containerd --version`. An existing file keeps its own.")]

_DEF = core.InstallPaths()


def _options(name: str, runtime_path: Path | None, hook_path: Path | None, paths: core.InstallPaths) -> core.InstallOptions:
    if runtime_path is not None and hook_path is not None:
        return core.InstallOptions(str(runtime_path.absolute()), str(hook_path.absolute()), name, paths)
    found = core.default_options(name, paths)
    return core.InstallOptions(
        str(runtime_path.absolute()) if runtime_path else found.runtime_path,
        str(hook_path.absolute()) if hook_path else found.hook_path,
        name,
        paths,
    )


def _reload_dockerd(pidfile: Path) -> str:
    try:
        pid = int(pidfile.read_text().strip())
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot signal dockerd via {pidfile} ({exc}); reload it yourself: kill -HUP $(pidof dockerd)") from None
    return f"sent SIGHUP to dockerd (pid {pid})"


def _run(remove: bool, engine: Engine, dry_run: bool, name: str, runtime_path: Path | None, hook_path: Path | None,
         paths: core.InstallPaths, reload: bool, pidfile: Path, config_version: int = 0) -> None:
    try:
        opts = _options(name, runtime_path, hook_path, paths)
        opts.containerd_config_version = config_version
        if dry_run:
            edits = core.plan(engine.value, opts, remove=remove)
            for c in core.apply(edits, dry_run=True):
                typer.echo(c.describe(dry_run))
            for e in edits:
                if e.changes:
                    typer.echo(core.diff(e), nl=False)
            return
        changes = (core.uninstall if remove else core.install)(engine.value, opts, dry_run)
        for c in changes:
            typer.echo(c.describe(dry_run))
        if reload and engine is Engine.docker and not dry_run and any(c.action != "unchanged" for c in changes):
            typer.echo(_reload_dockerd(pidfile))
    except GpusnapError as exc:
        print_error(exc)
        raise typer.Exit(int(exc.exit_code)) from None


def register(app: typer.Typer) -> None:
    """Add ``install`` and ``uninstall`` to the gpusnap CLI."""

    @app.command("install")
    def install_cmd(
        engine: EngineArg,
        dry_run: DryRun = False,
        name: Name = core.DEFAULT_NAME,
        runtime_path: RuntimePath = None,
        hook_path: HookPath = None,
        hooks_dir: HooksDir = _DEF.hooks_dir,
        containers_conf: Conf = _DEF.containers_conf,
        containers_conf_d: ConfD = _DEF.containers_conf_d,
        daemon_json: DaemonJson = _DEF.daemon_json,
        containerd_config: ContainerdConfig = _DEF.containerd_config,
        reload: Reload = False,
        docker_pidfile: PidFile = Path("/var/run/docker.pid"),
        config_version: ConfigVersion = 0,
    ) -> None:
        """Register gpusnap-runtime (and, for podman, the gpusnap-hook hooks) with ENGINE.

        Running it again changes nothing; a changed file is backed up first; --dry-run prints
        the diff. containerd: a CRI runtime handler (RuntimeClass handler) named --name.
        """
        if config_version not in (0, 2, 3):
            raise typer.BadParameter("--containerd-config-version must be 2 or 3")
        paths = core.InstallPaths(hooks_dir, _DEF.system_containers_conf, containers_conf, containers_conf_d, daemon_json, containerd_config)
        _run(False, engine, dry_run, name, runtime_path, hook_path, paths, reload, docker_pidfile, config_version)

    @app.command("uninstall")
    def uninstall_cmd(
        engine: EngineArg,
        dry_run: DryRun = False,
        name: Name = core.DEFAULT_NAME,
        hooks_dir: HooksDir = _DEF.hooks_dir,
        containers_conf: Conf = _DEF.containers_conf,
        containers_conf_d: ConfD = _DEF.containers_conf_d,
        daemon_json: DaemonJson = _DEF.daemon_json,
        containerd_config: ContainerdConfig = _DEF.containerd_config,
        reload: Reload = False,
        docker_pidfile: PidFile = Path("/var/run/docker.pid"),
    ) -> None:
        """Remove what `gpusnap install ENGINE` added; everything else is kept."""
        paths = core.InstallPaths(hooks_dir, _DEF.system_containers_conf, containers_conf, containers_conf_d, daemon_json, containerd_config)
        # The paths only name what to remove; nothing is looked up.
        placeholder = Path(sys.argv[0]).absolute()
        _run(True, engine, dry_run, name, placeholder, placeholder, paths, reload, docker_pidfile)
