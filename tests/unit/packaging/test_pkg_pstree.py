from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpusnap.criu.images import CORE_MAGIC, PSTREE_MAGIC, ImageFormatError, process_tree

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: criu_images
from criu_images import field_bytes as _field_bytes  # noqa: E402
from criu_images import field_varint as _field_varint  # noqa: E402
from criu_images import image as _image  # noqa: E402
from criu_images import varint as _varint  # noqa: E402










def test_process_tree_with_names() -> None:
    init = _field_varint(1, 1) + _field_varint(2, 0) + _field_varint(3, 1) + _field_varint(4, 1) + _field_varint(5, 1)
    child = _field_varint(1, 7) + _field_varint(2, 1) + _field_varint(3, 1) + _field_varint(4, 1) + _field_bytes(5, _varint(7) + _varint(8))
    core = _field_varint(1, 1) + _field_bytes(3, _field_varint(1, 1) + _field_bytes(6, b"python3"))
    procs = process_tree({"pstree.img": _image(PSTREE_MAGIC, [init, child]), "core-7.img": _image(CORE_MAGIC, [core])})
    assert [(p.pid, p.ppid, p.threads, p.comm) for p in procs] == [(1, 0, [1], ""), (7, 1, [7, 8], "python3")]


def test_wrong_magic_and_truncation() -> None:
    with pytest.raises(ImageFormatError):
        process_tree({"pstree.img": _image(CORE_MAGIC, [])})
    with pytest.raises(ImageFormatError):
        process_tree({"pstree.img": _image(PSTREE_MAGIC, [b"\x08"])[:-1] + b"\x08\x80"})
    assert process_tree({}) == []
