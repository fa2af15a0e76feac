"""Host checks behind `gpusnap doctor`: each says ok, or what is wrong and the fix.

Checks run the real tools (``criu check``, ``runc --version``, the docker and podman clients)
rather than guessing from files, so a line that says ok means the thing works here.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from gpusnap.config import Settings
from gpusnap.criu.config import takes_network_lock_option
from gpusnap.criu.locate import MIN_VERSION, probe_criu
from gpusnap.host.facts import host_gpus, version_tuple

OK, WARN, FAIL = "ok", "warn", "fail"
MIN_DRIVER_CHECKPOINT = (570,)  # the CUDA driver's checkpoint API arrived with the 570 branch


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def check_criu(settings: Settings) -> list[Check]:
    path, version = probe_criu(settings)
    fix_install = "install CRIU >= 4.0 (sudo bash tests/host/provision.sh does) or set GPUSNAP_CRIU to its path"
    if not path:
        return [Check("criu", FAIL, "CRIU not found on PATH", fix_install), Check("criu check", FAIL, "skipped: no CRIU", fix_install)]
    if not version:
        return [Check("criu", FAIL, f"{path} does not run", fix_install), Check("criu check", FAIL, "skipped: CRIU does not run", fix_install)]
    out = []
    if version_tuple(version)[:2] < MIN_VERSION:
        out.append(Check("criu", FAIL, f"CRIU {version} at {path} is too old (kernel 6.x needs >= 4.0)", fix_install))
    else:
        out.append(Check("criu", OK, f"CRIU {version} at {path}"))
    proc = _run([path, "check"], timeout=120)
    if proc is not None and proc.returncode == 0:
        out.append(Check("criu check", OK, "looks good"))
    else:
        text = (proc.stdout + proc.stderr) if proc else "did not run"
        lines = [ln for ln in text.splitlines() if "Error" in ln or "fail" in ln.lower()]
        out.append(Check("criu check", FAIL, (lines[-1] if lines else text.strip()[-120:]).strip(), "run `criu check` as root and fix what it reports (kernel config, permissions)"))
    return out


def check_network_lock(settings: Settings, which: Callable[[str], str | None] = shutil.which) -> list[Check]:
    """CRIU locks a container's own network namespace with iptables-restore at dump and restore;
    without it only runc-direct containers without network can be checkpointed, and only with
    CRIU >= 4.2 (gpusnap gives them "network-lock skip", which CRIU 4.1 crashes on)."""
    found = which("iptables-restore")
    if found:
        return [Check("network lock", OK, f"iptables-restore at {found} (CRIU locks container networks with it)")]
    _, version = probe_criu(settings)
    fix = "install iptables (apt-get install iptables)"
    if version and takes_network_lock_option(version_tuple(version)):
        return [Check("network lock", WARN, f"no iptables-restore: only runc-direct containers without network can be checkpointed (CRIU {version} skips their lock)", fix)]
    return [Check("network lock", FAIL, "no iptables-restore: no container with a network namespace of its own can be checkpointed", f"{fix}, or CRIU >= 4.2 for runc-direct containers without network")]


def check_kernel(settings: Settings) -> list[Check]:
    out = []
    release = os.uname().release
    proc_dir = settings.host.proc
    if (proc_dir / "sys/kernel/ns_last_pid").exists():
        out.append(Check("kernel", OK, f"{release}, checkpoint/restore support on"))
    else:
        out.append(Check("kernel", FAIL, f"{release} lacks CONFIG_CHECKPOINT_RESTORE (no /proc/sys/kernel/ns_last_pid)", "use a kernel built with CONFIG_CHECKPOINT_RESTORE=y"))
    cg2 = (settings.host.sys / "fs/cgroup/cgroup.controllers").exists()
    hybrid = (settings.host.sys / "fs/cgroup/unified").exists()
    mode = "cgroup v2" if cg2 else ("cgroup v1+v2 hybrid" if hybrid else "cgroup v1")
    out.append(Check("cgroups", OK, mode))
    out.append(check_lazy_pages(settings))
    return out


def check_lazy_pages(settings: Settings, support: Callable[[], tuple[bool, str]] | None = None) -> Check:
    """Whether runc-direct restores can be lazy (docs/runtime.md, "Lazy pages")."""
    if settings.lazy_pages is False:
        return Check("lazy pages", OK, "off (lazy_pages = false): CRIU copies every page before a restored process goes on")
    if support is None:
        from gpusnap.criu.lazy_pages import host_support as support
    ok, why = support()
    if ok:
        return Check("lazy pages", OK, "userfaultfd with the events CRIU needs: runc-direct restores fill memory while the process goes on")
    if settings.lazy_pages:
        return Check("lazy pages", FAIL, f"lazy_pages = true, but {why}", "set lazy_pages = auto (or false), or use a kernel with userfaultfd")
    return Check("lazy pages", WARN, f"restores are eager here: {why}", "a kernel with userfaultfd (CONFIG_USERFAULTFD) makes restores faster")


def check_runc(settings: Settings) -> list[Check]:
    path = settings.runc or shutil.which("runc")
    if not path:
        return [Check("runc", FAIL, "runc not found", "install runc (apt-get install runc) or set GPUSNAP_RUNC")]
    proc = _run([path, "--version"])
    if proc is None or proc.returncode != 0:
        return [Check("runc", FAIL, f"{path} does not run", "reinstall runc")]
    first = proc.stdout.splitlines()[0] if proc.stdout else "runc"
    out = [Check("runc", OK, f"{first.strip()} at {path}")]
    from gpusnap.engines.runc_direct import find_shim

    shim = find_shim()
    if shim:
        out.append(_front_check(Path(shim)))
    else:
        out.append(Check("gpusnap-runtime", WARN, "not installed: runc-direct uses plain runc (CPU state only)", "pip install gpusnap on this host"))
    return out


def _front_check(shim: Path) -> Check:
    """gpusnap-runtime is a sh front that execs gpusnap-runtime-py, which must sit beside it
    (or beside the file a link to it points at) for create, checkpoint and restore to work."""
    try:
        is_front = shim.read_bytes()[:9] == b"#!/bin/sh"
    except OSError:
        is_front = False
    if not is_front:
        return Check("gpusnap-runtime", OK, f"{shim}")
    for d in (shim.parent, shim.resolve().parent):
        py = d / "gpusnap-runtime-py"
        if py.is_file() and os.access(py, os.X_OK):
            return Check("gpusnap-runtime", OK, f"{shim} (passthrough in sh, the rest in {py})")
    return Check("gpusnap-runtime", FAIL, f"{shim} has no gpusnap-runtime-py beside it: create, checkpoint and restore would fail",
                 "reinstall gpusnap (pip install --force-reinstall gpusnap) so both scripts land in the same bin directory")


def check_engines(settings: Settings) -> list[Check]:
    from gpusnap.engines.docker import DockerEngine
    from gpusnap.engines.podman import PodmanEngine
    from gpusnap.engines.runc_direct import RuncDirectEngine, busybox_binary
    from gpusnap.errors import MissingDependencyError

    out = []
    rd = RuncDirectEngine(settings)
    try:
        rd.require()
        detail = f"state in {rd.home}, runtime {rd.runtime_name()}"
        try:
            busybox_binary()
            out.append(Check("engine runc-direct", OK, detail))
        except MissingDependencyError:
            # Only the default root filesystem needs busybox: the rest of the engine works.
            out.append(Check("engine runc-direct", WARN, f"{detail}; busybox not found on PATH, so `gpusnap run` needs a root "
                             "filesystem: `gpusnap run --rootfs-overlay / NAME -- CMD` (or --rootfs DIR) works; "
                             "checkpoint, restore and the other engines are unaffected",
                             "install busybox-static for the default busybox root filesystem"))
    except Exception as exc:  # noqa: BLE001 - each check reports, none stops the others
        out.append(Check("engine runc-direct", FAIL, str(exc), "install runc"))
    podman = PodmanEngine()
    if shutil.which("podman") is None:
        out.append(Check("engine podman", OK, "not installed (optional)"))
    else:
        try:
            podman.require()
            out.append(Check("engine podman", OK, f"podman {podman.version()}"))
        except Exception as exc:  # noqa: BLE001
            out.append(Check("engine podman", FAIL, str(exc), "run `podman info` and fix what it reports"))
    docker = DockerEngine()
    if shutil.which("dockerd") is None and not os.environ.get("DOCKER_HOST"):
        out.append(Check("engine docker", OK, "not installed (optional)"))
    else:
        try:
            docker.require()
            if docker.experimental():
                out.append(Check("engine docker", OK, f"docker {docker.version()}, experimental on (checkpoint API)"))
            else:
                out.append(Check("engine docker", FAIL, f"docker {docker.version()} without experimental features: no checkpoint API",
                                 'add "experimental": true to /etc/docker/daemon.json and restart dockerd'))
        except Exception as exc:  # noqa: BLE001
            out.append(Check("engine docker", FAIL, str(exc), "start dockerd (systemctl start docker) or unset DOCKER_HOST"))
    return out


def _driver_version(settings: Settings) -> str:
    path = settings.host.proc / "driver/nvidia/version"
    if path.is_file():
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", path.read_text())
        if m:
            return m.group(1)
    return ""


def check_gpu(settings: Settings) -> list[Check]:
    driver = _driver_version(settings)
    if not driver:
        return [Check("gpu driver", OK, "no NVIDIA driver: CPU containers only")]
    out = []
    gpus, _ = host_gpus()
    names = ", ".join(sorted({g.name for g in gpus})) or "no GPU visible to nvidia-smi"
    if version_tuple(driver)[:1] < MIN_DRIVER_CHECKPOINT:
        out.append(Check("gpu driver", FAIL, f"NVIDIA driver {driver} ({names}) has no checkpoint API", "install NVIDIA driver >= 570"))
        return out
    out.append(Check("gpu driver", OK, f"NVIDIA driver {driver}, {len(gpus)} GPU(s): {names}"))
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        has_api = all(hasattr(lib, fn) for fn in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore"))
    except OSError:
        has_api = False
    if has_api:
        out.append(Check("gpu checkpoint api", OK, "libcuda exports cuCheckpointProcess*"))
    else:
        out.append(Check("gpu checkpoint api", FAIL, "libcuda.so.1 not loadable or without cuCheckpointProcess*", "install the CUDA driver library of driver >= 570 (libcuda.so.1)"))
    return out


def check_store(settings: Settings) -> list[Check]:
    store = settings.store_dir
    if not store.exists():
        parent = next((p for p in store.parents if p.exists()), Path("/"))
        if os.access(parent, os.W_OK):
            return [Check("store", OK, f"{store} (created on first checkpoint)")]
        return [Check("store", FAIL, f"{store} does not exist and {parent} is not writable", "run as root or set GPUSNAP_STORE to a writable directory")]
    layout = store / "oci-layout"
    index = store / "index.json"
    if layout.exists() or index.exists():
        try:
            json.loads(layout.read_text())
            entries = json.loads(index.read_text()).get("manifests", [])
        except (OSError, ValueError) as exc:
            return [Check("store", FAIL, f"{store} is damaged: {exc}", f"move {store} aside; checkpoints in a registry can be pulled again")]
        missing = [m["digest"] for m in entries if not (store / "blobs" / Path(*m["digest"].split(":", 1))).is_file()]
        if missing:
            return [Check("store", FAIL, f"{store}: {len(missing)} manifest blob(s) missing", "run `gpusnap gc`, then pull the affected checkpoints again")]
        return [Check("store", OK, f"{store}, {len(entries)} checkpoint(s)")]
    if not os.access(store, os.W_OK):
        return [Check("store", FAIL, f"{store} is not writable", "run as root or set GPUSNAP_STORE to a writable directory")]
    return [Check("store", OK, f"{store} (empty)")]


def check_work_dirs(settings: Settings) -> list[Check]:
    """Checkpoints that killed runs left in work dirs: the next checkpoint or restore stores
    them (or removes what is stored elsewhere); where it cannot tell, the user must say."""
    from gpusnap.engines import workdirs

    base = settings.state_dir / "tmp"
    if not base.is_dir():
        return [Check("work dirs", OK, "none")]
    found = workdirs.survey(base, container_running=lambda _record: None)
    live = sum(1 for f in found if f.live)
    waiting = [f for f in found if f.verdict is not None and f.verdict.action != "remove" and f.record is not None]
    spare = sum(1 for f in found if f.verdict is not None and f.verdict.action == "remove")
    if not waiting:
        detail = f"{live} in use" + (f", {spare} left by killed runs holding nothing that is not stored (the next run removes them)" if spare else "")
        return [Check("work dirs", OK, detail if found else "none")]
    checks = []
    for f in waiting:
        assert f.record is not None and f.verdict is not None
        image = f.record.checkpoint or str(f.work)
        if f.verdict.action == "recover":
            fix = f"run any gpusnap checkpoint or restore: it stores it as {f.record.ref or 'a -recovered-<time> reference'}"
        else:
            fix = f"if it is wanted: gpusnap import {image} REF, then remove {f.work}; else remove {f.work}"
        checks.append(Check("work dirs", WARN, f"a killed gpusnap checkpoint of {f.record.container or '?'} left {image} ({f.verdict.reason})", fix))
    return checks


def run_checks(settings: Settings) -> list[Check]:
    checks: list[Check] = []
    for fn in (check_criu, check_network_lock, check_kernel, check_runc, check_engines, check_gpu, check_store, check_work_dirs):
        checks.extend(fn(settings))
    return checks
