"""A fake GPU host tree for tests: real character nodes (mknod), /proc and /sys files, a driver
library directory. Needs root (mknod). Used by unit, integration and the GPU test's CPU part."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

UVM_MAJOR = 237  # dynamic on real hosts; deliberately not the GPU machine's 238
CAPS_MAJOR = 236


@dataclass
class FakeGpuTree:
    root: Path
    driver_version: str = "580.00.01"
    uuids: list[str] = field(default_factory=list)
    lib_dir: Path | None = None

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")


def _mknod(path: Path, major: int, minor: int, mode: int = 0o666) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
    os.chmod(path, mode)  # mknod applies the umask


def make_nvidia_tree(root: Path, gpus: int = 2, driver_version: str = "580.00.01", *, uvm_node_major: int | None = None,
                     lib_dir: str = "usr/local/nvidia/lib64", uvm_major: int = UVM_MAJOR) -> FakeGpuTree:
    """An NVIDIA host: nodes, /proc/devices, /proc/driver/nvidia, driver libraries and nvidia-smi.

    ``uvm_major`` is what /proc/devices says (dynamic on real hosts); ``uvm_node_major`` makes
    the UVM nodes disagree with it (a stale node)."""
    UVM_MAJOR = uvm_major  # noqa: N806 - the module default, overridden for this tree
    tree = FakeGpuTree(root, driver_version)
    _mknod(root / "dev/nvidiactl", 195, 255)
    _mknod(root / "dev/nvidia-modeset", 195, 254)
    _mknod(root / "dev/nvidia-uvm", uvm_node_major or UVM_MAJOR, 0)
    _mknod(root / "dev/nvidia-uvm-tools", uvm_node_major or UVM_MAJOR, 1)
    _mknod(root / "dev/nvidia-caps/nvidia-cap1", CAPS_MAJOR, 1, 0o400)
    _mknod(root / "dev/nvidia-caps/nvidia-cap2", CAPS_MAJOR, 2, 0o444)
    (root / "proc/driver/nvidia/gpus").mkdir(parents=True)
    (root / "proc/devices").write_text(
        "Character devices:\n  1 mem\n  5 /dev/tty\n"
        f"195 nvidia-frontend\n195 nvidia\n{CAPS_MAJOR} nvidia-caps\n{UVM_MAJOR} nvidia-uvm\n"
        "\nBlock devices:\n  8 sd\n"
    )
    (root / "proc/driver/nvidia/version").write_text(
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver_version}  Release Build  (dvs-builder@U22)  Tue Jan 1 00:00:00 UTC 2026\n"
        "GCC version:  gcc version 12.3.0\n"
    )
    for i in range(gpus):
        uuid = f"GPU-{i:08x}-1111-2222-3333-{i:012x}"
        tree.uuids.append(uuid)
        _mknod(root / f"dev/nvidia{i}", 195, i)
        d = root / f"proc/driver/nvidia/gpus/0000:{i + 1:02x}:00.0"
        d.mkdir()
        (d / "information").write_text(
            f"Model: \t\t NVIDIA Fake H{i}00\nIRQ:   \t\t 0\nGPU UUID: \t {uuid}\nVideo BIOS: \t ??.??.??.??.??\n"
            f"Bus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t 0000:{i + 1:02x}:00.0\n"
            f"Device Minor: \t {i}\nGPU Excluded:\t No\n"
        )
    libs = root / lib_dir
    libs.mkdir(parents=True)
    tree.lib_dir = libs
    for base in ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so"):
        real = libs / f"{base}.{driver_version}"
        real.write_text(f"fake {base} {driver_version}\n")
        (libs / f"{base}.1").symlink_to(real.name)
        if base == "libcuda.so":
            (libs / base).symlink_to(f"{base}.1")  # the dev link: not what programs load
    (libs / f"libnvidia-glcore.so.{driver_version}").write_text("fake glcore\n")  # no soname link
    (libs / "libunrelated.so.1").write_text("not a driver library\n")
    bins = root / "usr/local/nvidia/bin"
    bins.mkdir(parents=True)
    smi = bins / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho 'fake nvidia-smi {driver_version}'\n")
    smi.chmod(0o755)
    return tree


def make_amd_tree(root: Path, gpus: int = 2) -> FakeGpuTree:
    """An AMD host: /dev/kfd, /dev/dri/renderD*/card* and the /sys/class/drm links grouping them."""
    tree = FakeGpuTree(root, "")
    _mknod(root / "dev/kfd", 511, 0)
    for i in range(gpus):
        pci = f"0000:{i + 3:02x}:00.0"
        dev = root / f"sys/devices/pci0000:00/{pci}"
        dev.mkdir(parents=True)
        (dev / "unique_id").write_text(f"{i + 1:016x}\n")
        (dev / "product_name").write_text(f"AMD Fake MI{i}00\n")
        (dev / "mem_info_vram_total").write_text(str((i + 1) * 2**30) + "\n")
        drv = root / "sys/bus/pci/drivers/amdgpu"
        drv.mkdir(parents=True, exist_ok=True)
        (dev / "driver").symlink_to(drv)
        for name, major, minor in ((f"renderD{128 + i}", 226, 128 + i), (f"card{i}", 226, i)):
            _mknod(root / f"dev/dri/{name}", major, minor)
            cls = root / "sys/class/drm" / name
            cls.mkdir(parents=True)
            (cls / "device").symlink_to(dev)
        tree.uuids.append(f"{i + 1:016x}")
    return tree
