import gzip
import io
import tarfile
from pathlib import Path

import pytest

from gpusnap.errors import RestoreError
from gpusnap.gpu.devnodes import retarget_dev_images, retarget_step
from gpusnap.steps import Step, run_steps


def dev_image(path: Path, nodes: dict[str, tuple[int, int]], extra_file: bytes = b"") -> None:
    """A /dev tmpfs image as CRIU's tar writes it: ./-relative names, gzip."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as t:
        root = tarfile.TarInfo("./")
        root.type = tarfile.DIRTYPE
        t.addfile(root)
        for name, (major, minor) in nodes.items():
            ti = tarfile.TarInfo(f"./{name}")
            ti.type, ti.devmajor, ti.devminor, ti.mode = tarfile.CHRTYPE, major, minor, 0o666
            t.addfile(ti)
        link = tarfile.TarInfo("./ptmx")
        link.type, link.linkname = tarfile.SYMTYPE, "pts/ptmx"
        t.addfile(link)
        if extra_file:
            f = tarfile.TarInfo("./note")
            f.size = len(extra_file)
            t.addfile(f, io.BytesIO(extra_file))
    path.write_bytes(buf.getvalue())


def read_nodes(path: Path) -> dict[str, tuple[int, int]]:
    with tarfile.open(path, "r:gz") as t:
        return {m.name: (m.devmajor, m.devminor) for m in t.getmembers() if m.ischr()}


SPEC_DEVICES = [
    {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
    {"path": "/dev/nvidia-uvm", "type": "c", "major": 240, "minor": 0},
    {"path": "/dev/nvidia-caps/nvidia-cap1", "type": "c", "major": 241, "minor": 1},
    {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229},
]


def test_nodes_rewritten_to_the_spec_numbers_others_kept(tmp_path: Path) -> None:
    img = tmp_path / "tmpfs-dev-46.tar.gz.img"
    dev_image(img, {"nvidiactl": (195, 255), "nvidia-uvm": (237, 0), "nvidia-caps/nvidia-cap1": (236, 1), "fuse": (10, 1), "null": (1, 3)},
              extra_file=b"kept as is")
    changes, originals = retarget_dev_images(tmp_path, SPEC_DEVICES)
    assert sorted((c.path, c.old, c.new) for c in changes) == [
        ("/dev/nvidia-caps/nvidia-cap1", (236, 1), (241, 1)),
        ("/dev/nvidia-uvm", (237, 0), (240, 0)),
    ]
    assert read_nodes(img) == {"./nvidiactl": (195, 255), "./nvidia-uvm": (240, 0), "./nvidia-caps/nvidia-cap1": (241, 1),
                               "./fuse": (10, 1), "./null": (1, 3)}  # non-GPU nodes are not ours to change
    with tarfile.open(img, "r:gz") as t:
        assert t.extractfile("./note").read() == b"kept as is"
        assert t.getmember("./ptmx").linkname == "pts/ptmx"
    assert list(originals) == [img]


def test_nothing_to_change_leaves_files_alone(tmp_path: Path) -> None:
    img = tmp_path / "tmpfs-dev-48.tar.gz.img"
    dev_image(img, {"nvidia-uvm": (240, 0)})
    before = img.read_bytes()
    assert retarget_dev_images(tmp_path, SPEC_DEVICES) == ([], {})
    assert img.read_bytes() == before


def test_step_undo_puts_the_original_back(tmp_path: Path) -> None:
    img = tmp_path / "tmpfs-dev-46.tar.gz.img"
    dev_image(img, {"nvidia-uvm": (237, 0)})
    before = img.read_bytes()

    def boom() -> None:
        raise RuntimeError("runc restore failed")

    with pytest.raises(Exception, match="runc restore failed"):
        run_steps([retarget_step(tmp_path, {"linux": {"devices": SPEC_DEVICES}}), Step("runc restore", boom)])
    assert img.read_bytes() == before


def test_damaged_image_is_a_restore_error(tmp_path: Path) -> None:
    (tmp_path / "tmpfs-dev-46.tar.gz.img").write_bytes(b"not gzip")
    with pytest.raises(RestoreError, match="damaged"):
        retarget_dev_images(tmp_path, SPEC_DEVICES)
