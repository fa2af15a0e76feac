"""`gpusnap checkpoint` and `gpusnap restore`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from gpusnap.cli.context import get_ctx, require_root
from gpusnap.cli.output import human_size
from gpusnap.engines import orchestrate
from gpusnap.engines.base import CheckpointOptions
from gpusnap.steps import STARTUP, process_age_s


def _with_startup(timings: dict[str, float], age: float | None) -> dict[str, float]:
    """The command's report with its own start-up first (named as the runtime names its own)."""
    return timings if age is None else {STARTUP: round(age, 3), **timings}


ENGINE_OPT = typer.Option("--engine", "-e", help="auto (the engine that owns it), runc-direct, podman, docker, or cri (a pod's container over the node's CRI socket).")
NAMESPACE_OPT = typer.Option("--namespace", help="--engine cri: the pod's Kubernetes namespace.")
SOCKET_OPT = typer.Option("--cri-socket", help="--engine cri: the node's CRI socket (CRI-O: /var/run/crio/crio.sock).")


def register(app: typer.Typer) -> None:
    @app.command()
    def checkpoint(
        ctx: typer.Context,
        container: Annotated[str, typer.Argument(help="Container name or ID.")],
        push: Annotated[Optional[str], typer.Option("--push", help="Also push to this reference, e.g. registry.example.com/snaps/app:step-1200.")] = None,
        output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the checkpoint to this path instead of the local store.")] = None,
        leave_running: Annotated[bool, typer.Option("--leave-running", help="Keep the container running after the checkpoint.")] = False,
        compress: Annotated[bool, typer.Option("--compress", help="Compress the stored layers (zstd).")] = False,
        tcp_established: Annotated[bool, typer.Option("--tcp-established", help="Checkpoint open TCP connections.")] = False,
        engine: Annotated[str, ENGINE_OPT] = "auto",
        insecure: Annotated[bool, typer.Option("--insecure", help="Allow a plain-HTTP registry.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
        encrypt_key: Annotated[Optional[Path], typer.Option("--encrypt-key", metavar="KEYFILE", help="Encrypt every layer with this 256-bit key file (mode 0600).")] = None,
        recipient: Annotated[Optional[list[Path]], typer.Option("--recipient", metavar="PUBKEY.pem", help="Also let this public key (PEM, X25519 or RSA) decrypt it; repeatable.")] = None,
        encrypt_mode: Annotated[Optional[str], typer.Option("--encrypt-mode", metavar="keyed|random", help="Blob keys from --encrypt-key (keyed: dedup within that key; the default with a key) or random (no dedup; the default for recipients only).")] = None,
        podman_image: Annotated[bool, typer.Option("--podman-image", help="With --push: push podman's own checkpoint image, which `podman container restore REF` restores without gpusnap (podman containers only).")] = False,
        namespace: Annotated[str, NAMESPACE_OPT] = "default",
        cri_socket: Annotated[str, SOCKET_OPT] = "/run/containerd/containerd.sock",
    ) -> None:
        """Checkpoint a container through its engine, store it locally, push it if asked.

        With --engine cri, CONTAINER is POD[/CONTAINER] and the checkpoint is the kubelet's:
        a checkpoint archive (the container keeps running), pushed as a checkpoint image with --push."""
        started = process_age_s()
        require_root("gpusnap checkpoint")
        c = get_ctx(ctx)
        if engine == "cri":
            from gpusnap.cli.cri import run_checkpoint

            run_checkpoint(c, container, namespace=namespace, socket=cri_socket, output=output, push=push, insecure=insecure, as_json=as_json)
            return
        opts = CheckpointOptions(leave_running=leave_running, tcp_established=tcp_established, compress=compress)
        # Keys are read before anything is dumped: a bad key file must not cost a checkpoint.
        encryption = None
        if encrypt_key is not None or recipient or encrypt_mode is not None:
            # Only then: the crypto module takes ~10 ms to import (its dataclasses), before the dump.
            from gpusnap.packaging.crypto import encryption_from_options

            encryption = encryption_from_options(encrypt_key, recipient or [], encrypt_mode)
        sealed = {"encryption": encryption} if encryption is not None else {}
        with c.out.progress(f"checkpointing {container}") as progress:
            outcome = orchestrate.checkpoint(c.settings, container, engine=engine, opts=opts, push=push, output=output, insecure=insecure, progress=progress,
                                       podman_image=podman_image, notice=c.out.notice, **sealed)
        outcome.timings_s = _with_startup(outcome.timings_s, started)
        if as_json:
            c.out.json(outcome.to_dict())
            return
        where = outcome.output or outcome.ref
        c.out.info(f"checkpointed {outcome.container.name} ({outcome.engine}) -> {where}, {human_size(outcome.size)}")
        if outcome.pushed:
            c.out.info(f"pushed {outcome.pushed}" + (" as a podman checkpoint image (podman pull, then podman container restore)" if outcome.podman_image else ""))
        c.out.detail(f"steps: {outcome.timings_s}")

    @app.command()
    def restore(
        ctx: typer.Context,
        source: Annotated[str, typer.Argument(help="A reference (host/repo:tag, @sha256:...) or a checkpoint path.")],
        name: Annotated[Optional[str], typer.Option("--name", "-n", help="Name of the restored container.")] = None,
        engine: Annotated[str, ENGINE_OPT] = "auto",
        tcp_established: Annotated[bool, typer.Option("--tcp-established", help="Restore open TCP connections.")] = False,
        ip: Annotated[Optional[str], typer.Option("--ip", help="runc-direct bridge network: restore at this address (default: the recorded one).")] = None,
        insecure: Annotated[bool, typer.Option("--insecure", help="Allow a plain-HTTP registry.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
        decrypt_key: Annotated[Optional[list[Path]], typer.Option("--decrypt-key", metavar="KEYFILE", help="Key file or PEM private key that opens an encrypted checkpoint; repeatable.")] = None,
        namespace: Annotated[str, NAMESPACE_OPT] = "default",
        cri_socket: Annotated[str, SOCKET_OPT] = "/run/containerd/containerd.sock",
        runtime_handler: Annotated[str, typer.Option("--runtime-handler", help="--engine cri: the new pod's runtime handler (the RuntimeClass's).")] = "gpusnap",
        host_network: Annotated[bool, typer.Option("--host-network", help="--engine cri: the new pod uses the node's network (no CNI).")] = False,
        lazy_pages: Annotated[Optional[bool], typer.Option("--lazy-pages/--eager-pages", help="runc-direct: let the process go before its memory is in, gpusnap's page server filling it (userfaultfd) while the GPU state is copied back; --eager-pages: CRIU copies it all first. Default: the lazy_pages setting (auto: lazy where the kernel can).")] = None,
    ) -> None:
        """Pull if needed, check this host can take it, and restore through the engine.

        With --engine cri, SOURCE is a checkpoint image or a kubelet checkpoint archive, and --name
        names the new pod: checked against this node first, then restored as a new pod."""
        started = process_age_s()
        require_root("gpusnap restore")
        c = get_ctx(ctx)
        if engine == "cri":
            from gpusnap.cli.cri import run_restore

            run_restore(c, source, pod=name, namespace=namespace, socket=cri_socket, handler=runtime_handler, host_network=host_network,
                        insecure=insecure, as_json=as_json)
            return
        keys: dict[str, object] = {}
        if decrypt_key:
            from gpusnap.packaging.crypto import load_decryption_keys

            keys["decryption"] = load_decryption_keys(decrypt_key)
        with c.out.progress(f"restoring {source}") as progress:
            outcome = orchestrate.restore(c.settings, source, name=name, engine=engine, tcp_established=tcp_established, insecure=insecure, progress=progress, ip=ip,
                                          notice=c.out.notice, lazy_pages=lazy_pages, **keys)
        outcome.timings_s = _with_startup(outcome.timings_s, started)
        if as_json:
            c.out.json(outcome.to_dict())
            return
        c.out.info(f"restored {outcome.container.name} ({outcome.engine}, {outcome.container.status}) from {source}")
