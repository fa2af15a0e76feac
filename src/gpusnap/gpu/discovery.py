"""What GPU hardware and driver files this host has: device nodes, GPU identities, libraries.

Everything is read below an injectable :class:`~gpusnap.config.HostPaths` root, so tests point it
at a fake tree (real character nodes made with ``mknod``, a fake ``/proc/devices``, a fake
driver-library directory). Device numbers and modes come from the nodes themselves
(``os.stat``), never from a table: the UVM major is dynamic, and a node a container gets must be
the node the host has.

NVML (``pynvml`` from nvidia-ml-py) describes the real host only, so it is used only when the
root is ``/``; otherwise, and whenever NVML is missing or fails, GPU identities come from
``/proc/driver/nvidia/gpus/*/information`` under the root.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.config import HostPaths

NVIDIA_MAJOR = 195  # fixed by the driver for /dev/nvidiactl, /dev/nvidiaN, /dev/nvidia-modeset
NVIDIACTL_MINOR = 255

# Default places a driver installs its files, relative to the host root. The first is what the
# NVIDIA GPU Operator / cloud images use (a read-only mount on the lent GPU machine).
DEFAULT_NVIDIA_LIB_DIRS = ("usr/local/nvidia/lib64", "usr/local/nvidia/lib")
DEFAULT_NVIDIA_BIN_DIRS = ("usr/local/nvidia/bin", "usr/bin")

# Library name prefixes that belong to the NVIDIA user-space driver (not to CUDA toolkits, which
# images carry themselves).
_NVIDIA_LIB_PREFIXES = ("libcuda.", "libcudadebugger.", "libnvidia-", "libnvcuvid.", "libnvoptix.")
_NVIDIA_BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
_SONAME_RE = re.compile(r"^(lib[^/]+\.so)\.(\d+)$")  # e.g. libcuda.so.1: the name programs load


@dataclass(frozen=True)
class DeviceNode:
    """A character device as the host has it; ``path`` is also its path inside the container."""

    path: str  # absolute, as seen from the host root ("/dev/nvidia0")
    host_path: Path  # where it is on this machine (below HostPaths.root)
    major: int
    minor: int
    file_mode: int  # permission bits only
    uid: int
    gid: int
    type: str = "c"


@dataclass(frozen=True)
class GpuIdentity:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    vendor: str  # "nvidia" | "amd"
    pci_bus_id: str = ""
    minor: int = -1  # NVIDIA: N of /dev/nvidiaN; AMD: N of /dev/dri/renderN
    driver_version: str = ""


@dataclass(frozen=True)
class DriverFile:
    """A driver file to expose in containers under a stable name (``name``)."""

    name: str  # soname for libraries ("libcuda.so.1"), file name for binaries
    host_path: Path  # the real file it resolves to on this machine
    kind: str  # "lib" | "bin"


@dataclass
class NvidiaInventory:
    control_nodes: list[DeviceNode] = field(default_factory=list)  # ctl, uvm, uvm-tools, modeset, caps
    gpu_nodes: dict[int, DeviceNode] = field(default_factory=dict)  # minor -> /dev/nvidiaN
    gpus: list[GpuIdentity] = field(default_factory=list)
    libraries: list[DriverFile] = field(default_factory=list)
    binaries: list[DriverFile] = field(default_factory=list)
    driver_version: str = ""
    # A folder holding the driver's libraries and nothing else (e.g. /usr/local/nvidia/lib64):
    # containers get it whole, as one mount, instead of one mount per library.
    lib_dir: Path | None = None

    @property
    def present(self) -> bool:
        return any(n.path == "/dev/nvidiactl" for n in self.control_nodes)


@dataclass
class AmdGpuNodes:
    gpu: GpuIdentity
    nodes: list[DeviceNode]  # renderD* and card* of this GPU


@dataclass
class AmdInventory:
    kfd: DeviceNode | None = None
    gpus: list[AmdGpuNodes] = field(default_factory=list)

    @property
    def present(self) -> bool:
        return self.kfd is not None


@dataclass
class Inventory:
    nvidia: NvidiaInventory
    amd: AmdInventory


def read_device_node(host: HostPaths, path: str) -> DeviceNode | None:
    """The character device at ``path`` (absolute, host view) under the root, or None."""
    host_path = host.root / path.lstrip("/")
    try:
        st = os.stat(host_path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISCHR(st.st_mode):
        return None
    return DeviceNode(
        path=path,
        host_path=host_path,
        major=os.major(st.st_rdev),
        minor=os.minor(st.st_rdev),
        file_mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
    )


def read_proc_devices(host: HostPaths) -> dict[str, int]:
    """Character-device driver name -> major number, from ``/proc/devices``."""
    majors: dict[str, int] = {}
    try:
        text = (host.proc / "devices").read_text()
    except OSError:
        return majors
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            break
        parts = line.split()
        if in_char and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def nvidia_control_nodes(host: HostPaths) -> list[DeviceNode]:
    """/dev/nvidiactl, -uvm, -uvm-tools, -modeset and /dev/nvidia-caps/* that exist and check out.

    The UVM nodes' major is assigned at module load; a node whose major disagrees with
    /proc/devices is stale (left from an earlier load) and is not handed to containers.
    """
    majors = read_proc_devices(host)
    wanted: list[tuple[str, int | None]] = [
        ("/dev/nvidiactl", NVIDIA_MAJOR),
        ("/dev/nvidia-uvm", majors.get("nvidia-uvm")),
        ("/dev/nvidia-uvm-tools", majors.get("nvidia-uvm")),
        ("/dev/nvidia-modeset", NVIDIA_MAJOR),
    ]
    nodes: list[DeviceNode] = []
    for path, major in wanted:
        node = read_device_node(host, path)
        if node is not None and major is not None and node.major == major:
            nodes.append(node)
    caps_dir = host.dev / "nvidia-caps"
    caps_major = majors.get("nvidia-caps")
    if caps_dir.is_dir():
        for entry in sorted(caps_dir.iterdir()):
            node = read_device_node(host, f"/dev/nvidia-caps/{entry.name}")
            if node is not None and (caps_major is None or node.major == caps_major):
                nodes.append(node)
    return nodes


def nvidia_gpu_nodes(host: HostPaths) -> dict[int, DeviceNode]:
    """minor -> /dev/nvidiaN for every per-GPU node present."""
    nodes: dict[int, DeviceNode] = {}
    if not host.dev.is_dir():
        return nodes
    for entry in host.dev.iterdir():
        m = re.fullmatch(r"nvidia(\d+)", entry.name)
        if not m:
            continue
        node = read_device_node(host, f"/dev/{entry.name}")
        if node is not None and node.major == NVIDIA_MAJOR and node.minor == int(m.group(1)):
            nodes[node.minor] = node
    return dict(sorted(nodes.items()))


def nvidia_driver_version(host: HostPaths) -> str:
    try:
        text = (host.proc / "driver/nvidia/version").read_text()
    except OSError:
        return ""
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else ""


def _parse_information(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def nvidia_gpus_from_proc(host: HostPaths) -> list[GpuIdentity]:
    """GPU identities from /proc/driver/nvidia/gpus/<pci>/information, indexed in PCI order.

    PCI bus order is the order NVML and CUDA (with CUDA_DEVICE_ORDER=PCI_BUS_ID) number GPUs.
    The file has no memory size; it is reported as 0.
    """
    base = host.proc / "driver/nvidia/gpus"
    if not base.is_dir():
        return []
    version = nvidia_driver_version(host)
    gpus: list[GpuIdentity] = []
    for index, pci_dir in enumerate(sorted(p for p in base.iterdir() if p.is_dir())):
        try:
            info = _parse_information((pci_dir / "information").read_text())
        except OSError:
            continue
        minor_text = info.get("Device Minor", "")
        gpus.append(
            GpuIdentity(
                index=index,
                uuid=info.get("GPU UUID", ""),
                name=info.get("Model", ""),
                memory_total_bytes=0,
                vendor="nvidia",
                pci_bus_id=info.get("Bus Location", pci_dir.name),
                minor=int(minor_text) if minor_text.isdigit() else -1,
                driver_version=version,
            )
        )
    return gpus


NvmlProbe = Callable[[], list[GpuIdentity] | None]


def nvidia_gpus_from_nvml() -> list[GpuIdentity] | None:
    """GPU identities from NVML, or None when pynvml or the driver's NVML library is missing."""
    try:
        import pynvml  # optional: nvidia-ml-py, the "nvidia" extra
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                GpuIdentity(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    memory_total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                    vendor="nvidia",
                    pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                    minor=int(pynvml.nvmlDeviceGetMinorNumber(h)),
                    driver_version=_text(version),
                )
            )
        return gpus
    except pynvml.NVMLError:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def ld_cache_entries(host: HostPaths, ldconfig: str = "ldconfig") -> dict[str, Path]:
    """soname -> library path (host-root relative paths made absolute under the root).

    Read with ``ldconfig -p -C <root>/etc/ld.so.cache`` so the cache format stays glibc's
    business. Only x86-64/native entries are kept (the first listed per name wins, as in the
    loader).
    """
    cache = host.etc / "ld.so.cache"
    if not cache.is_file():
        return {}
    try:
        out = subprocess.run(
            [ldconfig, "-p", "-C", str(cache)], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    entries: dict[str, Path] = {}
    for line in out.splitlines():
        m = re.match(r"^\s+(\S+) \(([^)]*)\) => (\S+)$", line)
        if not m:
            continue
        name, flags, target = m.groups()
        if "x86-64" not in flags and "64bit" not in flags and os.uname().machine == "x86_64":
            continue  # 32-bit compat copies: a 64-bit container never loads them
        entries.setdefault(name, host.root / target.lstrip("/"))
    return entries


def _is_nvidia_lib(name: str) -> bool:
    return name.startswith(_NVIDIA_LIB_PREFIXES)


def libraries_in_dir(directory: Path) -> list[DriverFile]:
    """Driver libraries of one directory, named by soname where a soname link exists.

    ``libcuda.so.1 -> libcuda.so.580.159.04`` gives ``DriverFile("libcuda.so.1", <real file>)``:
    containers see the unversioned soname, so a restore on another driver version resolves it
    anew. Versioned files without such a link keep their own name (they are loaded by it).
    """
    if not directory.is_dir():
        return []
    by_target: dict[Path, str] = {}
    for entry in sorted(directory.iterdir()):
        if not _is_nvidia_lib(entry.name) or not _SONAME_RE.match(entry.name):
            continue
        real = entry.resolve()
        if real.is_file():
            by_target.setdefault(real, entry.name)
    files: dict[str, DriverFile] = {}
    for entry in sorted(directory.iterdir()):
        if not _is_nvidia_lib(entry.name) or ".so." not in entry.name or entry.is_symlink():
            continue
        real = entry.resolve()
        if not real.is_file():
            continue
        name = by_target.get(real, entry.name)
        files.setdefault(name, DriverFile(name=name, host_path=real, kind="lib"))
    # Soname links whose targets live elsewhere (or are links to links) still count.
    for real, name in by_target.items():
        files.setdefault(name, DriverFile(name=name, host_path=real, kind="lib"))
    return sorted(files.values(), key=lambda f: f.name)


def nvidia_libraries(
    host: HostPaths,
    lib_dirs: Iterable[str] = DEFAULT_NVIDIA_LIB_DIRS,
    ld_cache: dict[str, Path] | None = None,
    driver_version: str = "",
) -> list[DriverFile]:
    """Driver libraries from the driver directories first, then from the ld cache.

    With ``driver_version`` known, ld-cache entries must resolve to files of that version
    (``libnvidia-ml.so.580.159.04``): leftovers of an older driver package in /usr/lib would
    otherwise be handed to containers beside the running driver's libcuda.
    """
    found: dict[str, DriverFile] = {}
    for rel in lib_dirs:
        for f in libraries_in_dir(host.root / rel.lstrip("/")):
            found.setdefault(f.name, f)
    cache = ld_cache_entries(host) if ld_cache is None else ld_cache
    for name, path in cache.items():
        if _is_nvidia_lib(name) and _SONAME_RE.match(name) and name not in found:
            real = path.resolve()
            if real.is_file() and (not driver_version or real.name.endswith("." + driver_version)):
                found[name] = DriverFile(name=name, host_path=real, kind="lib")
    return sorted(found.values(), key=lambda f: f.name)


def nvidia_binaries(host: HostPaths, bin_dirs: Iterable[str] = DEFAULT_NVIDIA_BIN_DIRS) -> list[DriverFile]:
    found: dict[str, DriverFile] = {}
    for rel in bin_dirs:
        d = host.root / rel.lstrip("/")
        for name in _NVIDIA_BINARIES:
            p = d / name
            if name not in found and p.is_file() and os.access(p, os.X_OK):
                found[name] = DriverFile(name=name, host_path=p.resolve(), kind="bin")
    return sorted(found.values(), key=lambda f: f.name)


def dedicated_lib_dir(host: HostPaths, lib_dirs: Iterable[str] = DEFAULT_NVIDIA_LIB_DIRS) -> Path | None:
    """The first driver folder that holds libcuda.so.1: one mount of it gives containers every
    driver library, versioned-only ones included, under one path that no driver version names."""
    for rel in lib_dirs:
        d = host.root / rel.lstrip("/")
        if (d / "libcuda.so.1").exists():
            return d.resolve()
    return None


def discover_nvidia(
    host: HostPaths,
    *,
    nvml: NvmlProbe | None = None,
    lib_dirs: Iterable[str] = DEFAULT_NVIDIA_LIB_DIRS,
    bin_dirs: Iterable[str] = DEFAULT_NVIDIA_BIN_DIRS,
    ld_cache: dict[str, Path] | None = None,
) -> NvidiaInventory:
    """Everything NVIDIA under ``host``; empty (``present`` False) on a host without the driver."""
    control = nvidia_control_nodes(host)
    if not any(n.path == "/dev/nvidiactl" for n in control):
        return NvidiaInventory()
    if nvml is None:
        nvml = nvidia_gpus_from_nvml if host.root == Path("/") else (lambda: None)
    gpus = nvml() or nvidia_gpus_from_proc(host)
    version = gpus[0].driver_version if gpus and gpus[0].driver_version else nvidia_driver_version(host)
    return NvidiaInventory(
        control_nodes=control,
        gpu_nodes=nvidia_gpu_nodes(host),
        gpus=gpus,
        libraries=nvidia_libraries(host, lib_dirs, ld_cache, version),
        binaries=nvidia_binaries(host, bin_dirs),
        driver_version=version,
        lib_dir=dedicated_lib_dir(host, lib_dirs),
    )


def discover_amd(host: HostPaths) -> AmdInventory:
    """/dev/kfd and, per GPU, its /dev/dri/renderD* and card* nodes (grouped by PCI device).

    GPUs are indexed in PCI order of their render nodes, the order ROCm enumerates them.
    """
    kfd = read_device_node(host, "/dev/kfd")
    if kfd is None:
        return AmdInventory()
    by_pci: dict[str, list[DeviceNode]] = {}
    dri = host.dev / "dri"
    if dri.is_dir():
        for entry in sorted(dri.iterdir()):
            if not re.fullmatch(r"(renderD|card)\d+", entry.name):
                continue
            node = read_device_node(host, f"/dev/dri/{entry.name}")
            if node is None:
                continue
            pci = _drm_pci_address(host, entry.name) or entry.name
            if _drm_driver(host, entry.name) not in ("amdgpu", ""):
                continue  # another vendor's DRM node on a mixed host
            by_pci.setdefault(pci, []).append(node)
    gpus: list[AmdGpuNodes] = []
    index = 0
    for pci, nodes in sorted(by_pci.items()):
        render = [n for n in nodes if n.path.startswith("/dev/dri/renderD")]
        if not render:
            continue
        gpus.append(
            AmdGpuNodes(
                gpu=GpuIdentity(
                    index=index,
                    uuid=_amd_unique_id(host, render[0].path.rsplit("/", 1)[1]) or pci,
                    name=_read(host.sys / "class/drm" / render[0].path.rsplit("/", 1)[1] / "device/product_name"),
                    memory_total_bytes=_read_int(host.sys / "class/drm" / render[0].path.rsplit("/", 1)[1] / "device/mem_info_vram_total"),
                    vendor="amd",
                    pci_bus_id=pci,
                    minor=render[0].minor,
                ),
                nodes=sorted(nodes, key=lambda n: n.path),
            )
        )
        index += 1
    return AmdInventory(kfd=kfd, gpus=gpus)


def _drm_pci_address(host: HostPaths, name: str) -> str:
    dev = host.sys / "class/drm" / name / "device"
    try:
        return os.path.basename(os.path.realpath(dev)) if dev.exists() else ""
    except OSError:
        return ""


def _drm_driver(host: HostPaths, name: str) -> str:
    drv = host.sys / "class/drm" / name / "device/driver"
    return os.path.basename(os.path.realpath(drv)) if drv.exists() else ""


def _amd_unique_id(host: HostPaths, name: str) -> str:
    return _read(host.sys / "class/drm" / name / "device/unique_id")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _read_int(path: Path) -> int:
    text = _read(path)
    return int(text) if text.isdigit() else 0


def discover(host: HostPaths, *, nvml: NvmlProbe | None = None) -> Inventory:
    return Inventory(nvidia=discover_nvidia(host, nvml=nvml), amd=discover_amd(host))
