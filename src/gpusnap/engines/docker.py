"""Docker through its Python SDK and the Engine API's experimental checkpoint endpoints.

The SDK has no checkpoint helper, so the two calls it lacks (``POST /containers/{id}/checkpoints``
and ``POST /containers/{id}/start?checkpoint=``) go through its low-level ``APIClient``.
dockerd refuses a custom checkpoint directory at start ("custom checkpointdir is not
supported"), so a restore copies the images into the new container's own checkpoint directory
under ``DockerRootDir`` — which also means gpusnap runs on the same host as dockerd, as CRIU must.

The docker-dir form is docker's checkpoint (one flat CRIU image directory) plus ``docker-container.json``:
the image and settings needed to create the container again under a new name.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusnap.engines.base import (
    FORM_DOCKER_DIR,
    CheckpointOptions,
    ContainerInfo,
    EngineBase,
    EngineCheckpoint,
    RestoreOptions,
    refusal_error,
    runtime_refusal,
)
from gpusnap.errors import CheckpointError, MissingDependencyError, NotFoundError, RestoreError, UsageError

NAME = "docker"
CONTAINER_RECORD = "docker-container.json"
CHECKPOINT_ID = "gpusnap"

# Settings copied from the checkpointed container to its restored twin. Anything touching the
# process tree CRIU restores (command, env, user, workdir, tty) must match or restore fails.
_CONFIG_KEYS = ("Image", "Cmd", "Entrypoint", "Env", "WorkingDir", "User", "Labels", "Tty", "OpenStdin", "StopSignal", "Hostname")
_HOST_KEYS = ("Runtime", "Binds", "NetworkMode", "Ulimits", "CapAdd", "CapDrop", "Privileged", "SecurityOpt", "IpcMode", "ShmSize", "Devices")


def _one_line(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    text = str(explanation or exc)
    return " ".join(text.split())


@dataclass
class DockerEngine(EngineBase):
    base_url: str | None = None  # None = DOCKER_HOST or the default socket
    name: str = NAME
    form: str = FORM_DOCKER_DIR

    def _client(self):  # -> docker.DockerClient
        import docker  # imported here: only the docker engine needs it

        try:
            if self.base_url:
                return docker.DockerClient(base_url=self.base_url, timeout=120)
            return docker.from_env(timeout=120)
        except docker.errors.DockerException as exc:
            raise MissingDependencyError(
                f"docker is not reachable ({_one_line(exc)}); start dockerd or fix DOCKER_HOST"
            ) from None

    def _where(self) -> str:
        return self.base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"

    def require(self) -> None:
        import docker

        try:
            self._client().ping()
        except docker.errors.DockerException as exc:
            raise MissingDependencyError(
                f"docker daemon at {self._where()} is not answering ({_one_line(exc)}); start dockerd or fix DOCKER_HOST"
            ) from None
        except Exception as exc:  # requests' connection errors come through here
            raise MissingDependencyError(
                f"docker daemon at {self._where()} is not answering ({type(exc).__name__}); start dockerd or fix DOCKER_HOST"
            ) from None

    def experimental(self) -> bool:
        return bool(self._client().version().get("Experimental") or self._client().info().get("ExperimentalBuild"))

    def version(self) -> str:
        return str(self._client().version().get("Version", ""))

    def _info(self, attrs: dict[str, Any]) -> ContainerInfo:
        state = attrs.get("State", {})
        cfg = attrs.get("Config", {}) or {}
        return ContainerInfo(
            id=attrs["Id"],
            name=attrs.get("Name", "").lstrip("/"),
            engine=self.name,
            image=cfg.get("Image", ""),
            status=str(state.get("Status", "")),
            pid=int(state.get("Pid") or 0),
            created=str(attrs.get("Created", "")),
            command=list(cfg.get("Entrypoint") or []) + list(cfg.get("Cmd") or []),
            labels=dict(cfg.get("Labels") or {}),
        )

    def get(self, ref: str) -> ContainerInfo | None:
        import docker

        self.require()
        try:
            return self._info(self._client().api.inspect_container(ref))
        except docker.errors.NotFound:
            return None

    def list(self) -> list[ContainerInfo]:
        client = self._client()
        return [self._info(client.api.inspect_container(c["Id"])) for c in client.api.containers(all=True)]

    def checkpoint(self, container: ContainerInfo, dest: Path, opts: CheckpointOptions) -> EngineCheckpoint:
        import docker

        if opts.tcp_established:
            # The Engine API's checkpoint call has no such option; failing beats silently
            # dropping the connections at restore.
            raise UsageError("docker's checkpoint API cannot keep established TCP connections; drop --tcp-established or use podman or runc-direct")
        client = self._client()
        api = client.api
        attrs = api.inspect_container(container.id)
        # dockerd writes <CheckpointDir>/<CheckpointID>/; the images are then moved up so the
        # form is one flat CRIU image directory (what packaging reads the process tree from).
        staging = dest.with_name(dest.name + ".docker")
        staging.mkdir(parents=True)
        body = {"CheckpointID": CHECKPOINT_ID, "CheckpointDir": str(staging), "Exit": not opts.leave_running}
        try:
            # The SDK has no wrapper for this endpoint; _post_json/_url are how its own
            # wrappers build calls, so the call keeps the SDK's auth, timeouts and API version.
            resp = api._post_json(api._url("/containers/{0}/checkpoints", container.id), data=body)
            api._raise_for_status(resp)
        except docker.errors.APIError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            refusal = runtime_refusal(str(exc))
            if refusal is not None:  # containerd's runc shim: "exit status N: <the runtime's output>"
                raise refusal_error(f"docker could not checkpoint {container.name}", refusal, "the container was left as it was") from None
            raise CheckpointError(
                f"docker could not checkpoint {container.name}: {_one_line(exc)}; the container was left as it was"
                " (docker needs \"experimental\": true in daemon.json and CRIU on dockerd's PATH)"
            ) from None
        record = {
            "name": container.name,
            "config": {k: attrs["Config"].get(k) for k in _CONFIG_KEYS if attrs["Config"].get(k) is not None},
            "host_config": {k: attrs["HostConfig"].get(k) for k in _HOST_KEYS if attrs["HostConfig"].get(k) is not None},
            "tcp_established": opts.tcp_established,
        }
        (staging / CHECKPOINT_ID).rename(dest)
        staging.rmdir()
        (dest / CONTAINER_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))
        return EngineCheckpoint(form=self.form, path=dest, image_dir=dest, container=container)

    def restore(self, source: Path, opts: RestoreOptions) -> ContainerInfo:
        import docker

        record_path = source / CONTAINER_RECORD
        if not record_path.is_file() or not (source / "inventory.img").is_file():
            raise RestoreError(f"{source} is not a docker checkpoint (no {CONTAINER_RECORD} or CRIU images); pick --engine to match it")
        record = json.loads(record_path.read_text())
        client = self._client()
        api = client.api
        cfg = record["config"]
        try:
            api.inspect_image(cfg["Image"])
        except docker.errors.ImageNotFound:
            raise RestoreError(f"docker image {cfg['Image']} is not on this host; `docker pull {cfg['Image']}` first") from None
        host = record.get("host_config", {})
        body = dict(cfg)
        body["HostConfig"] = host
        name = opts.name or record.get("name")
        try:
            created = api.create_container_from_config(body, name=name)
        except docker.errors.APIError as exc:
            raise RestoreError(f"docker could not create container {name}: {_one_line(exc)}") from None
        cid = created["Id"]
        try:
            root = Path(client.info()["DockerRootDir"])
            shutil.copytree(source, root / "containers" / cid / "checkpoints" / CHECKPOINT_ID, ignore=shutil.ignore_patterns(CONTAINER_RECORD))
            resp = api._post(api._url("/containers/{0}/start", cid), params={"checkpoint": CHECKPOINT_ID})
            api._raise_for_status(resp)
        except BaseException as exc:
            # Nothing half-restored: the created container goes again.
            try:
                api.remove_container(cid, force=True)
            except docker.errors.APIError:
                pass
            if isinstance(exc, docker.errors.APIError):
                refusal = runtime_refusal(str(exc))
                if refusal is not None:  # the runtime's host check (exit 4 or 5): said as it said it
                    raise refusal_error(f"docker could not restore {name}", refusal, "nothing was left behind") from None
                raise RestoreError(f"docker could not restore {name}: {_one_line(exc)}; nothing was left behind") from None
            raise
        info = self.get(cid)
        assert info is not None
        return info

    def remove(self, container: ContainerInfo) -> None:
        import docker

        try:
            self._client().api.remove_container(container.id, force=True)
        except docker.errors.NotFound:
            raise NotFoundError(f"docker has no container {container.name}") from None

    def is_running(self, container: ContainerInfo) -> bool:
        info = self.get(container.id)
        return bool(info and info.running)

    def logs(self, container: ContainerInfo) -> str:
        return self._client().api.logs(container.id).decode(errors="replace")
