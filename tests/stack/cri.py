"""containerd 2.x (tests/host/provision.sh puts it in /opt/gpusnap-containerd2) as a test's own
daemon, talked to over CRI the way the kubelet does; and busybox images pushed to a test registry.

Each daemon gets its own socket, root, state, runc root and config under private paths
(``/run/gpusnap-cri/<id>``, ``/var/lib/gpusnap-cri/<id>``), NRI off and only host-network pods,
so it never meets the stack's containerd 1.6 (dockerd's) or another test's daemon. Its config is
the v3 file ``gpusnap install containerd`` writes, plus what a test node needs: the pause image
pinned to the test registry (no image can be pulled from the internet here) and that registry
reachable over plain HTTP.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import tarfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stack.proc import HOST_PATH

PREFIX = Path(os.environ.get("GPUSNAP_CONTAINERD2_PREFIX", "/opt/gpusnap-containerd2"))
PROTO = PREFIX / "cri-api" / "api.proto"
CRI_PORTS = range(5400, 5440)  # tests/integration/cri registries
K8S_NAMESPACE = "k8s.io"  # the containerd namespace the CRI plugin keeps its containers in
BUSYBOX = os.environ.get("GPUSNAP_BUSYBOX", "/bin/busybox")  # a static busybox (the GPU machine has none: staged)
BUSYBOX_APPLETS = ("sh", "sleep", "echo", "cat", "true", "false", "seq", "date", "ls", "mkdir", "env", "grep", "head")


def available() -> str:
    """Why containerd 2.x cannot run here ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root"
    if not (PREFIX / "bin" / "containerd").exists():
        return f"containerd 2.x is not installed in {PREFIX} (run tests/host/provision.sh)"
    if not PROTO.is_file():
        return f"no CRI api.proto at {PROTO} (run tests/host/provision.sh)"
    return ""


def fs_type(path: Path) -> str:
    """The type of the filesystem ``path`` lives on (the longest mount point above it)."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def default_root_base() -> Path:
    """Where daemons keep their roots: /var/lib, or a tmpfs where /var/lib is itself overlay
    (overlayfs snapshots cannot live there, and containerd 2.x's transfer service unpacks with
    no other snapshotter that needs no setup: "native" gives "no unpack platforms defined")."""
    return Path("/run/gpusnap-cri-root") if fs_type(Path("/var/lib")) == "overlay" else Path("/var/lib/gpusnap-cri")


@dataclass
class Containerd2:
    """One containerd 2.x daemon; ``runtimes`` maps a CRI runtime handler name to the runc-like
    binary (BinaryName) of its io.containerd.runc.v2 runtime."""

    runtimes: dict[str, str]
    registry: str  # host:port of the test registry (plain HTTP)
    pause_image: str
    tools_bin: str = ""  # put first on the daemon's PATH: containerd looks CRIU up there (GPU machine: .gpu-tools/bin)
    snapshotter: str = field(default_factory=lambda: os.environ.get("GPUSNAP_CRI_SNAPSHOTTER", "overlayfs"))
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    proc: subprocess.Popen | None = None  # type: ignore[type-arg]

    def __post_init__(self) -> None:
        self.state = Path("/run/gpusnap-cri") / self.id
        self.root = default_root_base() / self.id
        self.socket = self.state / "containerd.sock"
        self.config = self.root / "config.toml"
        self.log = self.root / "containerd.log"
        self.runc_root = self.state / "runc"

    def config_text(self) -> str:
        from gpusnap.admin.install import InstallOptions, InstallPaths, plan_containerd

        hosts = self.root / "certs.d"
        (hosts / self.registry).mkdir(parents=True, exist_ok=True)
        (hosts / self.registry / "hosts.toml").write_text(
            f'server = "http://{self.registry}"\n[host."http://{self.registry}"]\n  capabilities = ["pull", "resolve", "push"]\n'
        )
        base = "\n".join([
            "version = 3",
            f'root = "{self.root / "lib"}"',
            f'state = "{self.state / "st"}"',
            'disabled_plugins = ["io.containerd.nri.v1.nri"]',
            "[grpc]",
            f'  address = "{self.socket}"',
            "[ttrpc]",
            f'  address = "{self.socket}.ttrpc"',
            "[plugins.'io.containerd.internal.v1.opt']",
            f'  path = "{self.root / "opt"}"',
            "[plugins.'io.containerd.grpc.v1.cri']",
            "  disable_tcp_service = true",
            '  stream_server_address = "127.0.0.1"',
            '  stream_server_port = "0"',
            "[plugins.'io.containerd.cri.v1.images']",
            f'  snapshotter = "{self.snapshotter}"',
            "[plugins.'io.containerd.cri.v1.images'.pinned_images]",
            f'  sandbox = "{self.pause_image}"',
            "[plugins.'io.containerd.cri.v1.images'.registry]",
            f'  config_path = "{hosts}"',
            # The sandbox's oom_score_adj (-998) is below the daemon's, which these machines do
            # not let even root set: keep every container's at or above the daemon's.
            "[plugins.'io.containerd.cri.v1.runtime']",
            "  restrict_oom_score_adj = true",
            "[plugins.'io.containerd.cri.v1.runtime'.containerd]",
            f'  default_runtime_name = "{next(iter(self.runtimes))}"',
            "",
        ])
        self.config.write_text(base)
        # The runtime entries are what `gpusnap install containerd` writes into a node's config.
        for name, binary in self.runtimes.items():
            edit = plan_containerd(InstallOptions(runtime_path=binary, hook_path="", name=name, paths=InstallPaths(containerd_config=self.config)))[0]
            assert edit.new is not None
            self.config.write_text(edit.new)
        # Each runtime's runc root under this daemon's state: the shim's default
        # (/run/containerd/runc/k8s.io) is shared with any other containerd on the host.
        from gpusnap.admin.install import _containerd_table, _toml_key

        text = self.config.read_text()
        for name in self.runtimes:
            marker = f"[{_toml_key([*_containerd_table(3, name), 'options'])}]"
            assert marker in text, text
            text = text.replace(marker, f'{marker}\nRoot = "{self.runc_root}"\nSystemdCgroup = false', 1)
        self.config.write_text(text)
        return text

    def start(self, timeout: float = 60) -> Containerd2:
        for d in (self.state, self.root):
            d.mkdir(parents=True, exist_ok=True)
        self.config_text()
        # containerd 2.1 leaves a ctrd-checkpoint* folder (the CRIU images of each checkpoint) in
        # its TMPDIR: this daemon's go with its state instead of piling up in /tmp.
        tmp = self.state / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TMPDIR": str(tmp), "PATH": ":".join(p for p in (str(PREFIX / "bin"), self.tools_bin, HOST_PATH) if p)}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(PREFIX / "bin" / "containerd"), "--config", str(self.config), "--log-level", "debug"],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd 2.x exited {self.proc.returncode}: {self.log_tail()}")
            if self.socket.exists() and self._cri_ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"containerd 2.x did not answer on {self.socket} within {timeout}s: {self.log_tail()}")

    def _cri_ready(self) -> bool:
        from gpusnap.cri.client import CriClient, CriError

        try:
            with CriClient(str(self.socket), proto=PROTO, timeout=5) as c:
                c.version()
            return True
        except CriError:
            return False

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def client(self):  # type: ignore[no-untyped-def]
        from gpusnap.cri.client import CriClient

        return CriClient(str(self.socket), proto=PROTO)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(PREFIX / "bin" / "ctr"), "--address", str(self.socket), "--namespace", K8S_NAMESPACE, *args],
                              capture_output=True, text=True, timeout=120, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)}: {proc.stderr}")
        return proc

    def remove_everything(self) -> None:
        """Every pod (and so every container) this daemon runs, as the kubelet would at drain."""
        from gpusnap.cri.client import CriError

        with contextlib.suppress(Exception), self.client() as c:
            for pod in c.list_pods():
                with contextlib.suppress(CriError):
                    c.stop_pod(pod.id)
                with contextlib.suppress(CriError):
                    c.remove_pod(pod.id)

    def stop(self) -> None:
        """Stop the daemon, its shims and containers, and remove its root, state and mounts."""
        keep = os.environ.get("GPUSNAP_CRI_LOG_DIR")  # where runs on other machines keep the daemon's log
        if keep and self.log.exists():  # before the pods go: their CRIU logs go with them
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(self.log, Path(keep) / f"containerd-{self.id}.log")
            shutil.copy(self.config, Path(keep) / f"config-{self.id}.toml")
            for log in [*self.state.rglob("criu-*.log"), *self.root.rglob("criu-*.log"), *self.root.rglob("dump.log")]:
                shutil.copy(log, Path(keep) / f"{self.id}-{log.parent.name[:12]}-{log.name}")
        if self.proc is not None and self.proc.poll() is None:
            self.remove_everything()
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
        _kill_shims(self.socket)
        for base in (self.state, self.root):
            _umount_under(base)
        shutil.rmtree(self.state, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Containerd2:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_shims(socket: Path) -> None:
    """Shims outlive their daemon (they are meant to); those of this daemon are ended here."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"containerd-shim-runc-v2") and str(socket).encode() in cmd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p.name), signal.SIGKILL)


def _umount_under(base: Path) -> None:
    mounts = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            target = line.split()[1].replace("\\040", " ")
            if target == str(base) or target.startswith(str(base) + "/"):
                mounts.append(target)
    for target in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


# ---- images --------------------------------------------------------------------------------


def _busybox_layer() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "tmp", "proc", "sys", "dev", "etc", "data"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755 if d != "tmp" else 0o1777
            tar.addfile(info)
        tar.add(BUSYBOX, "bin/busybox")
        for applet in BUSYBOX_APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    return buf.getvalue()


def _hostfs_layer() -> bytes:
    """busybox plus the mount points and merged-/usr links a pod that runs the host's own
    programs needs: the host's /usr (and /opt) are bind-mounted over them (as CRI mounts)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "tmp", "proc", "sys", "dev", "etc", "data", "usr", "opt", "root"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755 if d != "tmp" else 0o1777
            tar.addfile(info)
        tar.add(BUSYBOX, "bin/busybox")
        for applet in BUSYBOX_APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        for link in ("lib", "lib64", "sbin"):
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, f"usr/{link}"
            tar.addfile(info)
    return buf.getvalue()


def push_busybox_image(store_dir: Path, remote: str, entrypoint: list[str], *, arch: str | None = None, hostfs: bool = False) -> str:
    """A one-layer static-busybox OCI image with ``entrypoint``, stored in a gpusnap store at
    ``store_dir`` and pushed to ``remote`` (host:port/repo:tag) with gpusnap's registry client.
    Returns the manifest digest."""
    from gpusnap.packaging.registry import push_artifact
    from gpusnap.packaging.store import MEDIA_OCI_MANIFEST, Descriptor, OciStore

    store = OciStore(store_dir)
    layer = _hostfs_layer() if hostfs else _busybox_layer()
    with store.writing():
        layer_digest = store.put_bytes(layer)
        config = json.dumps({
            "architecture": arch or {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine()),
            "os": "linux",
            "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin"], "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }).encode()
        config_digest = store.put_bytes(config)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": MEDIA_OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": len(config)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": len(layer)}],
        }, separators=(",", ":")).encode()
        digest = store.put_bytes(manifest)
        local = f"local/{uuid.uuid4().hex[:8]}:1"
        store.tag(local, Descriptor(MEDIA_OCI_MANIFEST, digest, len(manifest)))
    push_artifact(store, local, remote, insecure=True)
    return digest


def sandbox_config(api: Any, name: str, namespace: str = "default", uid: str | None = None, log_dir: Path | None = None) -> Any:
    """A PodSandboxConfig as the kubelet sends it, for a host-network pod (no CNI here) whose
    containers each have their own PID namespace (the kubelet's default)."""
    pb = api.pb
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace=namespace, uid=uid or uuid.uuid4().hex, attempt=0),
        log_directory=str(log_dir) if log_dir else "",
        labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace},
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=f"/gpusnap-cri-{name}",
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER)),
        ),
    )


def container_config(api: Any, name: str, image: str, args: list[str], *, envs: dict[str, str] | None = None,
                     mounts: list[tuple[str, str, bool]] = (), log_path: str = "", devices: list[str] = ()) -> Any:  # type: ignore[assignment]
    """A ContainerConfig as the kubelet sends it; ``mounts``: (host path, container path, read-only);
    ``devices``: host device nodes given at the same path (what a device plugin hands the kubelet)."""
    pb = api.pb
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name, attempt=0),
        image=pb.ImageSpec(image=image, user_specified_image=image),  # the kubelet sends both
        args=args,
        envs=[pb.KeyValue(key=k, value=v.encode()) for k, v in (envs or {}).items()],  # bytes in the proto
        mounts=[pb.Mount(container_path=c, host_path=h, readonly=ro) for h, c, ro in mounts],
        log_path=log_path,
        devices=[pb.Device(container_path=d, host_path=d, permissions="rwm") for d in devices],
        labels={"io.kubernetes.container.name": name},
        linux=pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER))),
    )
