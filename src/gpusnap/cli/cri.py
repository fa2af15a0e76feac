"""Kubernetes nodes: ``checkpoint/restore --engine cri`` (called from cli/snapshot.py) and
``gpusnap cri-image`` (a kubelet checkpoint archive -> a checkpoint image, pushed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gpusnap.cli.output import human_size

SOCKET_HELP = "The node's CRI socket (containerd: /run/containerd/containerd.sock; CRI-O: /var/run/crio/crio.sock)."
DEFAULT_SOCKET = "/run/containerd/containerd.sock"


def run_checkpoint(c: Any, container: str, *, namespace: str, socket: str, output: Path | None, push: str | None, insecure: bool,
                   as_json: bool) -> None:
    from gpusnap.cri import engine

    result = engine.checkpoint(c.settings, engine.parse_target(container, namespace), socket=socket, output=output, push=push, insecure=insecure)
    if as_json:
        c.out.json(result.to_dict())
        return
    c.out.info(f"checkpointed {result.namespace}/{result.pod}/{result.container} (cri, still running) -> {result.archive} in {result.seconds}s")
    if result.pushed:
        c.out.info(f"pushed checkpoint image {result.pushed}: a pod whose image is this restores it (containerd >= 2.1, CRI-O)")
    for note in result.notes:
        c.out.info(f"note: {note}")


def run_restore(c: Any, source: str, *, pod: str | None, namespace: str, socket: str, handler: str, host_network: bool, insecure: bool,
                as_json: bool) -> None:
    from gpusnap.cri import engine
    from gpusnap.errors import UsageError

    if not pod:
        raise UsageError("restore --engine cri needs --name POD (the new pod's name)")
    result = engine.restore(c.settings, source, pod=pod, namespace=namespace, handler=handler, socket=socket, host_network=host_network,
                            insecure=insecure)
    if as_json:
        c.out.json(result.to_dict())
        return
    c.out.info(f"restored {result.namespace}/{result.pod}/{result.container} (cri, handler {handler}) from {source} in {result.seconds}s")


def register(app: typer.Typer) -> None:
    @app.command("cri-image")
    def cri_image(
        ctx: typer.Context,
        archive: Annotated[Path | None, typer.Argument(help="A kubelet checkpoint archive (/var/lib/kubelet/checkpoints/checkpoint-*.tar).")] = None,
        from_artifact: Annotated[str | None, typer.Option("--from-artifact", metavar="REF",
                                                          help="Instead of an archive: a gpusnap checkpoint (a local tag or HOST[:PORT]/REPO:TAG) taken with podman, docker or runc-direct.")] = None,
        base_image: Annotated[str | None, typer.Option("--base-image", metavar="IMAGE",
                                                       help="With --from-artifact: the image the node pulls as the container's root filesystem (default: the checkpoint's own image; required for runc-direct).")] = None,
        cri_runtime: Annotated[str, typer.Option("--cri-runtime", metavar="containerd|cri-o",
                                                 help="With --from-artifact: the nodes' runtime (containerd pulls the base image by digest; CRI-O needs it on the node).")] = "containerd",
        push: Annotated[str | None, typer.Option("--push", help="Push the checkpoint image to this reference, e.g. registry.example.com/ckpt/app:1.")] = None,
        tag: Annotated[str | None, typer.Option("--tag", help="Its tag in the local store (default: from the archive's or artifact's name).")] = None,
        arch: Annotated[str | None, typer.Option("--arch", help="GOARCH of the image (default: the checkpoint's, else this host's; with --from-artifact: this host's, and it must be the checkpoint's).")] = None,
        insecure: Annotated[bool, typer.Option("--insecure", help="Allow a plain-HTTP registry.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    ) -> None:
        """Turn a kubelet checkpoint archive, or a gpusnap checkpoint (--from-artifact), into a checkpoint image that containerd 2.x and CRI-O restore."""
        from gpusnap.cli.context import get_ctx
        from gpusnap.errors import UsageError

        c = get_ctx(ctx)
        if (archive is None) == (from_artifact is None):
            raise UsageError("cri-image takes exactly one of ARCHIVE (a kubelet checkpoint archive) and --from-artifact REF (a gpusnap checkpoint)")
        if base_image and from_artifact is None:
            raise UsageError("--base-image goes with --from-artifact (a kubelet archive names its base image itself)")
        if cri_runtime != "containerd" and from_artifact is None:
            raise UsageError("--cri-runtime goes with --from-artifact (a kubelet archive is already in its runtime's form)")
        if from_artifact is not None:
            from gpusnap.cri.from_artifact import artifact_to_image

            base = from_artifact.rsplit("/", 1)[-1].split("@")[0].replace(":", "-").lower()
            image = artifact_to_image(c.settings.store_dir, from_artifact, tag or f"cri/{base}:latest", base_image=base_image, arch=arch,
                                      insecure=insecure, runtime=cri_runtime)
        else:
            from gpusnap.cri.image import archive_to_image

            assert archive is not None
            local = tag or f"cri/{archive.name.removesuffix('.tar').removesuffix('.gz').lower()}:latest"
            image = archive_to_image(c.settings.store_dir, archive, local, arch=arch)
        pushed = ""
        if push:
            from gpusnap.packaging.api import push as push_image

            push_image(c.settings.store_dir, image.ref, push, insecure=insecure)
            pushed = push
        if as_json:
            c.out.json({"ref": image.ref, "digest": image.digest, "layer_size": image.layer_size, "annotations": image.annotations, "pushed": pushed})
            return
        c.out.info(f"stored checkpoint image {image.ref} ({human_size(image.layer_size)}, {image.digest})")
        if pushed:
            c.out.info(f"pushed {pushed}: use it as a pod's container image to restore")
