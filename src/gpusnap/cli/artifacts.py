"""``gpusnap push|pull|import|ls|rm|gc|inspect|verify``: checkpoints as OCI artifacts, from the command line.

Thin: every command calls :mod:`gpusnap.packaging.api` and renders the result, as a rich table
(readable at 80 columns) or, with ``--json``, the same data as JSON on stdout.
Expected failures print one line on stderr and exit with the error's documented code.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from gpusnap.cli.output import print_error
from gpusnap.config import DEFAULT_CONFIG_FILE, Settings, load_settings
from gpusnap.errors import ExitCode, GpusnapError, UsageError

F = TypeVar("F", bound=Callable[..., Any])

StoreOpt = typer.Option(
    None, "--store", help=f"local OCI store directory (default: $GPUSNAP_STORE, else store_dir in {DEFAULT_CONFIG_FILE}, else {Settings.store_dir})"
)
JsonOpt = typer.Option(False, "--json", help="print JSON instead of a table")
InsecureOpt = typer.Option(False, "--insecure", help="plain HTTP to the registry (a local test registry)")


def _store(store: Path | None) -> Path:
    return store if store is not None else load_settings().store_dir


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def _fail_cleanly(fn: F) -> F:
    """One line on stderr and the documented exit code for every expected failure."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except GpusnapError as exc:
            print_error(exc)
            raise typer.Exit(int(exc.exit_code)) from None

    return wrapper  # type: ignore[return-value]


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def short(digest: str | None) -> str:
    return (digest or "").replace("sha256:", "")[:12]


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _push(
    ref: str = typer.Argument(..., help="local checkpoint reference (see `gpusnap ls`), or a checkpoint on disk (as `gpusnap import` takes), stored first under REMOTE"),
    remote: str = typer.Argument(..., help="HOST[:PORT]/REPOSITORY[:TAG]"),
    insecure: bool = InsecureOpt,
    subject: str | None = typer.Option(None, "--subject", help="image in the same repository to attach the checkpoint to (referrers)"),
    store: Path | None = StoreOpt,
    as_json: bool = JsonOpt,
    encrypt_key: Path | None = typer.Option(None, "--encrypt-key", metavar="KEYFILE", help="push an encrypted copy (256-bit key file, mode 0600)"),
    recipient: list[Path] | None = typer.Option(None, "--recipient", metavar="PUBKEY.pem", help="public key (X25519/RSA) that may decrypt it; repeatable"),
    encrypt_mode: str | None = typer.Option(None, "--encrypt-mode", metavar="keyed|random", help="blob keys from --encrypt-key (keyed: dedup within that key; the default with a key) or random (no dedup; the default for recipients only)"),
    podman_image: bool = typer.Option(False, "--podman-image", help="push podman's own checkpoint image, which `podman container restore REMOTE` restores without gpusnap (podman checkpoints only)"),
) -> None:
    """Upload a stored checkpoint to a registry (only blobs the registry lacks are sent)."""
    from gpusnap.packaging import api
    from gpusnap.packaging.crypto import encryption_from_options

    if Path(ref).exists():
        shown = ref
        ref = import_path(Path(ref), remote, _store(store)).ref
        if not as_json:
            _console().print(f"imported {shown} as {ref}", soft_wrap=True)
    if podman_image:
        from gpusnap.engines.orchestrate import PODMAN_IMAGE_ENCRYPTED, push_podman_image

        if encrypt_key is not None or recipient:
            raise UsageError(PODMAN_IMAGE_ENCRYPTED)
        r = push_podman_image(api, _store(store), ref, remote, insecure=insecure, subject=subject)
    else:
        sealed = encryption_from_options(encrypt_key, recipient or [], encrypt_mode)
        r = api.push(_store(store), ref, remote, insecure=insecure, subject=subject, processes=load_settings().push_processes,
                     **({"encryption": sealed} if sealed else {}))
    if as_json:
        _print_json(asdict(r))
        return
    _console().print(f"pushed {ref} → {r.remote}" + (" as a podman checkpoint image" if podman_image else "")
                     + f"\n  digest {r.digest}\n  uploaded {human_size(r.uploaded_bytes)}, "
                     f"already there {human_size(r.skipped_bytes)} ({r.mounted_blobs} mounted), {r.blobs} blobs, {r.seconds:.1f} s")


def _guess_form(path: Path) -> str:
    """The form of a checkpoint on disk: a docker checkpoint directory (gpusnap's record in it),
    any other directory as CRIU images, a file as a podman export archive (its reader checks)."""
    from gpusnap.engines.docker import CONTAINER_RECORD

    if path.is_dir():
        return "docker-dir" if (path / CONTAINER_RECORD).is_file() else "criu-dir"
    if path.is_file():
        return "podman-archive"
    raise UsageError(f"{path} does not exist; give a podman export archive or a checkpoint directory")


def import_path(path: Path, ref: str, store: Path, *, form: str | None = None, compress: bool = False) -> Any:
    """Store the checkpoint at ``path`` under ``ref`` (what `import` and `push PATH` share)."""
    from gpusnap.packaging import api

    return api.store_checkpoint(store, path, form=form or _guess_form(path), ref=ref, compress=compress)


def _import(
    path: Path = typer.Argument(..., help="podman export archive (.tar, .tar.gz, .tar.zst), CRIU image directory, or docker checkpoint directory"),
    ref: str = typer.Argument(..., help="reference to store it under, e.g. HOST[:PORT]/REPOSITORY:TAG to push it there later"),
    form: str | None = typer.Option(None, "--form", help="criu-dir, podman-archive or docker-dir (default: guessed from PATH)"),
    compress: bool = typer.Option(False, "--compress", help="compress the stored layers (zstd)"),
    store: Path | None = StoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Put a checkpoint made outside gpusnap (`podman container checkpoint --export`, `runc
    checkpoint`) into the local store, ready for `gpusnap push`, `inspect` and `restore`."""
    r = import_path(path, ref, _store(store), form=form, compress=compress)
    if as_json:
        _print_json(asdict(r))
        return
    _console().print(f"imported {path} as {r.ref}\n  digest {r.digest}\n  {human_size(r.size)}, {r.layers} layers", soft_wrap=True)


def _pull(
    remote: str = typer.Argument(..., help="HOST[:PORT]/REPOSITORY[:TAG|@DIGEST]"),
    insecure: bool = InsecureOpt,
    store: Path | None = StoreOpt,
    as_json: bool = JsonOpt,
    decrypt_key: list[Path] | None = typer.Option(None, "--decrypt-key", metavar="KEYFILE", help="check before downloading that this key opens an encrypted checkpoint; repeatable"),
) -> None:
    """Download a checkpoint into the local store, verifying every byte."""
    from gpusnap.packaging import api
    from gpusnap.packaging.crypto import load_decryption_keys

    keys = {"decryption": load_decryption_keys(decrypt_key)} if decrypt_key else {}
    ref = api.pull(_store(store), remote, insecure=insecure, **keys)
    if as_json:
        desc = api.list_checkpoints(_store(store))
        _print_json(next((d for d in desc if d["ref"] == ref), {"ref": ref}))
        return
    _console().print(f"pulled {remote} as {ref}")


def ls_table(rows: list[dict[str, Any]], width: int = 80, now: float | None = None) -> Any:
    """The ``gpusnap ls`` listing laid out to ``width`` columns.

    References stay whole (never wrapped or cut: they are copied from here), and so do the age
    ("3h ago") and the size; the digest shrinks (12 hex digits down to 7) and the container name
    folds to make room. When even that leaves no room beside the longest reference, each
    reference gets a line of its own with its details indented under it. Widths are set here
    because rich, given a no-wrap column that needs most of the line, squeezes the other no-wrap
    columns to an ellipsis instead.
    """
    from rich.console import Group
    from rich.text import Text

    from gpusnap.cli.output import age

    cells = [(r["ref"], short(r["digest"]), r.get("container", ""), age(r.get("created", ""), now), human_size(r.get("size", 0))) for r in rows]
    heads = ("REFERENCE", "DIGEST", "CONTAINER", "CREATED", "SIZE")
    longest = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(heads)]
    gaps = 3 * (len(heads) - 1)  # padding each side and the box's divider between columns, none at the edges
    room = width - gaps - longest[0] - longest[3] - longest[4]
    if room >= 7 + len(heads[2]):  # everything on one line per checkpoint
        digest_w = max(7, min(longest[1], room - min(longest[2], 12)))
        container_w = min(longest[2], max(len(heads[2]), room - digest_w))
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        t.add_column(heads[0], no_wrap=True, width=longest[0])
        t.add_column(heads[1], no_wrap=True, overflow="crop", width=digest_w)
        t.add_column(heads[2], overflow="fold", width=container_w)
        t.add_column(heads[3], no_wrap=True, width=longest[3])
        t.add_column(heads[4], justify="right", no_wrap=True, width=longest[4])
        for c in cells:
            t.add_row(*c)
        return t
    # Stacked: the reference alone on its line, the rest indented below it.
    indent = 2
    room = width - indent - 2 * 3 - longest[3] - longest[4]
    digest_w = max(7, min(longest[1], room - min(longest[2], 12)))
    container_w = min(longest[2], max(len(heads[2]), room - digest_w))

    def details(row: tuple[str, ...] | None) -> Table:
        t = Table(box=None, pad_edge=False, show_header=row is None, padding=(0, 1), header_style="bold")
        t.add_column(heads[1], no_wrap=True, overflow="crop", width=digest_w)
        t.add_column(heads[2], overflow="fold", width=container_w)
        t.add_column(heads[3], no_wrap=True, width=longest[3])
        t.add_column(heads[4], justify="right", no_wrap=True, width=longest[4])
        if row is not None:
            t.add_row(*row)
        return t

    from rich.padding import Padding

    parts: list[Any] = [Text(heads[0], style="bold"), Padding(details(None), (0, 0, 0, indent))]
    for c in cells:
        parts += [Text(c[0], no_wrap=True, overflow="ignore"), Padding(details(c[1:]), (0, 0, 0, indent))]
    return Group(*parts)


def _ls(store: Path | None = StoreOpt, as_json: bool = JsonOpt) -> None:
    """List the checkpoints in the local store."""
    from gpusnap.packaging import api

    if store is None:
        _recover_interrupted()
    rows = api.list_checkpoints(_store(store))
    if as_json:
        _print_json(rows)
        return
    if not rows:  # a header over nothing reads as a broken listing to a newcomer
        print(f"no checkpoints in {_store(store)}; `gpusnap checkpoint CONTAINER` stores one, `gpusnap pull REF` fetches one")
        return
    console = _console()
    console.print(ls_table(rows, console.width))


def _recover_interrupted() -> None:
    """Store what a killed `gpusnap checkpoint` left in its work dir (the only copy of a
    container it stopped), so that it shows in the listing; only root can write there."""
    from gpusnap.engines.orchestrate import recover_interrupted

    settings = load_settings()
    if os.access(settings.state_dir / "tmp", os.W_OK):
        recover_interrupted(settings, lambda line: print(line, file=sys.stderr))


def _rm(
    refs: list[str] = typer.Argument(..., help="references to remove (blobs are freed by `gpusnap gc`)"),
    store: Path | None = StoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Remove checkpoint references from the local store.

    Removes every REF that exists and reports each that does not, then exits with the first
    failure's code (3 for a missing reference), as `gpusnap delete` does for containers.
    """
    from gpusnap.packaging import api

    removed: list[dict[str, str]] = []
    failures: list[GpusnapError] = []
    for ref in dict.fromkeys(refs):
        try:
            removed.append({"ref": ref, "digest": api.remove(_store(store), ref)})
        except GpusnapError as exc:
            print_error(exc)
            failures.append(exc)
            continue
        if not as_json:
            _console().print(f"removed {ref} ({short(removed[-1]['digest'])})")
    if as_json:
        _print_json(removed)
    if failures:
        raise typer.Exit(int(failures[0].exit_code))


def _gc(store: Path | None = StoreOpt, as_json: bool = JsonOpt) -> None:
    """Delete blobs no checkpoint in the local store uses any more."""
    from gpusnap.packaging import api

    blobs, freed = api.gc(_store(store))
    if as_json:
        _print_json({"blobs_removed": blobs, "bytes_freed": freed})
        return
    _console().print(f"removed {blobs} blobs, freed {human_size(freed)}")


def inspect_renderables(info: Any) -> list[Any]:
    """Tables and a tree for ``gpusnap inspect``; each fits 80 columns."""
    out: list[Any] = []
    s = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    s.add_column(style="bold", no_wrap=True)
    s.add_column(overflow="fold")
    engine = f"{info.engine.get('name', '')} {info.engine.get('version', '')}".strip()
    runtime = f"{info.runtime.get('name', '')} {info.runtime.get('version', '')}".strip()
    for k, v in [
        ("Checkpoint", info.ref), ("Digest", info.digest), ("Form", info.form),
        ("Container", " ".join(x for x in (info.container.get("name", ""), f"({short(info.container.get('id'))})"
                                         if info.container.get("id") and info.container.get("id") != info.container.get("name") else "") if x)),
        ("Image", info.image.get("name", "")), ("Engine", engine), ("Runtime", runtime), ("Created", info.created),
        ("CRIU", info.criu_version), ("Host", f"{info.kernel} {info.arch}".strip()),
        ("Size", f"{human_size(info.sizes.get('total', 0))} ({human_size(info.stored_size)} stored)"),
        ("Parent", info.parent or ""),
    ]:
        if v:
            s.add_row(k, str(v))
    out.append(s)

    layers = Table(title="Layers", box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    layers.add_column("ROLE", no_wrap=True)
    layers.add_column("FILE", overflow="fold")
    layers.add_column("BLOBS", justify="right")
    layers.add_column("SIZE", justify="right", no_wrap=True)
    layers.add_column("DIGEST", no_wrap=True)
    for la in info.layers:
        layers.add_row(la.role, la.file, str(la.count), human_size(la.size), short(la.digest) + ("…" if la.count > 1 else ""))
    out.append(layers)

    if info.process_tree:
        gpu_by_pid = {p.get("ns_pid"): p for p in info.gpu_processes}
        tree = Tree("[bold]Processes[/bold]")
        nodes: dict[int, Tree] = {}
        for p in info.process_tree:
            g = gpu_by_pid.get(p["pid"])
            label = f"{p['pid']} {p.get('comm', '')}"
            if len(p.get("threads", [])) > 1:
                label += f" ({len(p['threads'])} threads)"
            if g:
                label += f"  GPU {human_size(g.get('gpu_memory_bytes', 0))}"
            parent = nodes.get(p.get("ppid", 0), tree)
            nodes[p["pid"]] = parent.add(label)
        out.append(tree)

    if info.gpus:
        g = Table(title="GPUs", box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
        for col in ("#", "NAME", "UUID", "MEMORY"):
            g.add_column(col, overflow="fold")
        for gpu in info.gpus:
            g.add_row(str(gpu.get("index", "")), gpu.get("name", ""), gpu.get("uuid", ""), human_size(gpu.get("memory_total_bytes", 0)))
        out.append(g)
    if info.gpu_processes:
        gp = Table(title="GPU memory per process", box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
        for col in ("PID", "HOST PID", "COMMAND", "GPU MEMORY", "GPUS"):
            gp.add_column(col, overflow="fold")
        for p in info.gpu_processes:
            gp.add_row(str(p.get("ns_pid", "")), str(p.get("host_pid", "")), p.get("comm", ""),
                       human_size(p.get("gpu_memory_bytes", 0)), ", ".join(p.get("gpu_uuids", [])))
        out.append(gp)
    if info.timings:
        tt = Table(title="Timing", box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
        tt.add_column("STEP", overflow="fold")
        tt.add_column("SECONDS", justify="right")
        for step, secs in info.timings.items():
            tt.add_row(step, f"{secs:.3f}")
        if "total" not in info.timings:  # the runtime's own total; its parts overlap (a step and its GPU breakdown)
            tt.add_row("[bold]total[/bold]", f"[bold]{sum(info.timings.values()):.3f}[/bold]")
        out.append(tt)
    return out


def _looks_remote(target: str) -> bool:
    """HOST[:PORT]/REPOSITORY...: the first component names a registry host."""
    first, _, rest = target.partition("/")
    return bool(rest) and ("." in first or ":" in first or first == "localhost")


def _inspect(
    target: str = typer.Argument(..., help="a stored reference, a reference in a registry (HOST[:PORT]/REPOSITORY:TAG), or a checkpoint directory / podman archive on disk"),
    form: str | None = typer.Option(None, "--form", help="form of a PATH: criu-dir, podman-archive, docker-dir (guessed)"),
    remote: bool = typer.Option(False, "--remote", help="read the registry even when the local store has this reference (implied by --insecure)"),
    insecure: bool = InsecureOpt,
    store: Path | None = StoreOpt,
    as_json: bool = JsonOpt,
    decrypt_key: list[Path] | None = typer.Option(None, "--decrypt-key", metavar="KEYFILE", help="show the full config of an encrypted checkpoint"),
) -> None:
    """Show a checkpoint: container, image, sizes per layer, process tree, GPUs, timings.

    A registry reference that is not in the local store is read from the registry: its manifest
    and config only, no layer is downloaded and nothing is stored.
    """
    from gpusnap.packaging import api
    from gpusnap.packaging.crypto import load_decryption_keys

    path = Path(target)
    keys = {"decryption": load_decryption_keys(decrypt_key)} if decrypt_key else {}
    if (remote or insecure) and not _looks_remote(target):
        raise UsageError(f"{target} is not a registry reference; use HOST[:PORT]/REPOSITORY[:TAG|@DIGEST] with --remote/--insecure")
    if remote or insecure:
        info = api.inspect_remote(target, insecure=insecure, **keys)
    elif path.exists():
        info = api.inspect_path(path, form=form)
    else:
        try:
            info = api.inspect(_store(store), target, **keys)
        except GpusnapError as exc:
            if exc.exit_code != ExitCode.NOT_FOUND or not _looks_remote(target):
                raise
            try:
                info = api.inspect_remote(target, **keys)
            except GpusnapError as remote_exc:
                raise GpusnapError(f"{target} is not in the local store ({_store(store)}), and the registry: {remote_exc}",
                                   exit_code=remote_exc.exit_code) from None
    if as_json:
        _print_json(info.to_dict())
        return
    console = _console()
    for r in inspect_renderables(info):
        console.print(r)


def _verify(store: Path | None = StoreOpt, as_json: bool = JsonOpt) -> None:
    """Re-hash every blob and walk every tag: corrupt, missing, wrongly sized, readable by others."""
    from gpusnap.errors import IntegrityError
    from gpusnap.packaging.store import OciStore
    from gpusnap.packaging.verify import verify_store

    report = verify_store(OciStore(_store(store)))
    if as_json:
        _print_json(asdict(report) | {"ok": report.ok})
    elif report.ok:
        _console().print(f"ok: {report.summary()}")
    if not report.ok:
        raise IntegrityError(f"store {_store(store)} failed verification: {report.summary()}; pull the damaged checkpoints again")


def register(app: typer.Typer) -> None:
    """Add push, pull, ls, rm, gc and inspect to the ``gpusnap`` app."""
    app.command("push")(_fail_cleanly(_push))
    app.command("pull")(_fail_cleanly(_pull))
    app.command("import")(_fail_cleanly(_import))
    app.command("ls")(_fail_cleanly(_ls))
    app.command("rm")(_fail_cleanly(_rm))
    app.command("gc")(_fail_cleanly(_gc))
    app.command("inspect")(_fail_cleanly(_inspect))
    app.command("verify")(_fail_cleanly(_verify))
