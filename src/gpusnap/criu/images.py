"""Reads the process tree and command names out of CRIU image files (pstree.img, core-N.img).

Why hand-written: CRIU's own reader (``crit`` / pycriu) is not installed here (Debian's criu
package ships neither, and the CRIU we run is a private prefix), and the protobuf runtime alone
needs CRIU's .proto files compiled. What we need is four integers and one string, so a ~60 line
reader of the protobuf wire format is smaller than any of that.

CRIU image files: a 4-byte "images v1.1" magic (0x54564319), a 4-byte image-type magic, then
entries, each a little-endian u32 length followed by one protobuf message.
Field numbers (criu/images/pstree.proto, core.proto):
  pstree_entry: pid=1 ppid=2 pgid=3 sid=4 threads=5 (repeated)
  core_entry: tc=3 (task_core_entry); task_core_entry: comm=6
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field
from typing import Any

IMG_COMMON_MAGIC = 0x54564319
# CRIU writes it into the images' work directory as the dump's last act, after every image is
# closed, and only when the dump succeeded.
DUMP_STATS = "stats-dump"
PSTREE_MAGIC = 0x50273030
CORE_MAGIC = 0x55053847


@dataclass
class ProcessEntry:
    pid: int
    ppid: int
    pgid: int
    sid: int
    threads: list[int] = field(default_factory=list)
    comm: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ImageFormatError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ImageFormatError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise ImageFormatError("varint too long")


def decode_message(buf: bytes) -> dict[int, list[Any]]:
    """Field number → list of raw values (ints for varints, bytes for length-delimited)."""
    out: dict[int, list[Any]] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, pos = _varint(buf, pos)
        elif wire in (1, 5) and pos + (8 if wire == 1 else 4) > len(buf):
            raise ImageFormatError("truncated fixed-size field")
        elif wire == 1:
            val = struct.unpack_from("<Q", buf, pos)[0]
            pos += 8
        elif wire == 2:
            ln, pos = _varint(buf, pos)
            if pos + ln > len(buf):
                raise ImageFormatError("truncated field")
            val = buf[pos:pos + ln]
            pos += ln
        elif wire == 5:
            val = struct.unpack_from("<I", buf, pos)[0]
            pos += 4
        else:
            raise ImageFormatError(f"unsupported wire type {wire}")
        out.setdefault(num, []).append(val)
    return out


def _packed_or_plain(values: list[Any]) -> list[int]:
    ints: list[int] = []
    for v in values:
        if isinstance(v, bytes):  # packed repeated varints
            pos = 0
            while pos < len(v):
                x, pos = _varint(v, pos)
                ints.append(x)
        else:
            ints.append(v)
    return ints


def read_entries(data: bytes, magic: int) -> list[bytes]:
    if len(data) < 8:
        raise ImageFormatError("image too short")
    m0, m1 = struct.unpack_from("<II", data, 0)
    if m0 != IMG_COMMON_MAGIC or m1 != magic:
        raise ImageFormatError(f"unexpected image magic {m0:#x}/{m1:#x}")
    pos, out = 8, []
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageFormatError("truncated entry header")
        (ln,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + ln > len(data):
            raise ImageFormatError("truncated entry")
        out.append(data[pos:pos + ln])
        pos += ln
    return out


def parse_pstree(data: bytes) -> list[ProcessEntry]:
    procs = []
    for raw in read_entries(data, PSTREE_MAGIC):
        f = decode_message(raw)
        pid, ppid, pgid, sid = (int(f.get(n, [0])[0]) for n in (1, 2, 3, 4))
        procs.append(ProcessEntry(pid, ppid, pgid, sid, _packed_or_plain(f.get(5, []))))
    return procs


def parse_core_comm(data: bytes) -> str:
    entries = read_entries(data, CORE_MAGIC)
    if not entries:
        return ""
    tc = decode_message(entries[0]).get(3)
    if not tc:
        return ""
    comm = decode_message(tc[0]).get(6)
    return comm[0].decode("utf-8", "replace") if comm else ""


def process_tree(files: dict[str, bytes]) -> list[ProcessEntry]:
    """``files``: basename → content for pstree.img and core-<pid>.img (missing cores tolerated)."""
    if "pstree.img" not in files:
        return []
    procs = parse_pstree(files["pstree.img"])
    for p in procs:
        core = files.get(f"core-{p.pid}.img")
        if core:
            try:
                p.comm = parse_core_comm(core)
            except ImageFormatError:
                p.comm = ""
    return procs
