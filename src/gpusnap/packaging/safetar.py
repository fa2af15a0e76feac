"""Checks every tar entry gpusnap reads (podman exports, layers pulled from a registry).

Python's ``filter="data"`` silently rewrites absolute names into relative ones; a checkpoint
archive carrying such names is not one gpusnap made or podman exported, so it is refused
outright instead, with one line naming the entry. ``filter="data"`` is still applied when a tar
is extracted, as a second line of defence (modes, owners, device files).
"""

from __future__ import annotations

import posixpath
import tarfile
from pathlib import Path

from gpusnap.errors import IntegrityError

_ALLOWED_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE)


def safe_name(name: str, *, what: str = "archive") -> str:
    """Return the entry's normalized relative path, or raise if it could land outside."""
    if not name or "\x00" in name:
        raise IntegrityError(f"{what}: empty or NUL-containing entry name; refusing the archive")
    if len(name.encode(errors="surrogateescape")) > 4096:  # PATH_MAX: no such file can exist
        raise IntegrityError(f"{what}: entry name of {len(name)} characters is longer than any path; refusing the archive")
    if name.startswith("/"):
        raise IntegrityError(f"{what}: entry {name!r} has an absolute path; refusing the archive")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise IntegrityError(f"{what}: entry {name!r} contains '..'; refusing the archive")
    return "/".join(parts) or "."


def check_member(member: tarfile.TarInfo, *, what: str = "archive") -> str:
    """Validate name, type and link target of one entry; returns the normalized name."""
    name = safe_name(member.name, what=what)
    if member.type not in _ALLOWED_TYPES:
        raise IntegrityError(f"{what}: entry {member.name!r} is a device, fifo or unknown type; refusing the archive")
    if member.issym():
        target = member.linkname
        if target.startswith("/"):
            raise IntegrityError(f"{what}: symlink {member.name!r} points to absolute {target!r}; refusing the archive")
        joined = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
        if joined == ".." or joined.startswith("../"):
            raise IntegrityError(f"{what}: symlink {member.name!r} points outside the archive ({target!r}); refusing it")
    elif member.islnk():
        safe_name(member.linkname, what=f"{what}: hard link {member.name!r}")
    return name


class LinkTracker:
    """The symlinks one archive has made so far: no later entry, link target or hard link may
    pass through one of them.

    Each entry of a symlink chain looks harmless on its own (``c -> .``, then ``b -> c/../x``,
    which reads as ``x``), and only escapes once the earlier link exists on disk. A checkpoint
    archive never needs a path through its own symlinks, so the whole archive is refused.
    """

    def __init__(self) -> None:
        self.links: set[str] = set()

    def check(self, member: tarfile.TarInfo, name: str, *, what: str = "archive") -> None:
        paths = [name]
        if member.issym():
            paths.append(posixpath.join(posixpath.dirname(name), member.linkname))
        elif member.islnk():
            paths.append(member.linkname)
        for path in paths:
            parts = path.split("/")
            for i in range(1, len(parts)):
                prefix = posixpath.normpath("/".join(parts[:i]))
                if prefix in self.links:
                    raise IntegrityError(f"{what}: entry {member.name!r} goes through the archive's own symlink {prefix!r}; refusing the archive")
        if member.issym():
            self.links.add(name)


def extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, *, what: str = "archive") -> None:
    check_member(member, what=what)
    tar.extract(member, dest, filter="data")


def extract_all(fileobj: object, dest: Path, *, what: str = "archive") -> None:
    """Stream-extract a tar (read once, no seeking) into ``dest`` with every entry checked."""
    try:
        links = LinkTracker()
        with tarfile.open(fileobj=fileobj, mode="r|") as tar:  # type: ignore[call-overload]
            for member in tar:
                links.check(member, check_member(member, what=what), what=what)
                extract_member(tar, member, dest, what=what)
    except tarfile.TarError as exc:  # malformed headers, truncation, and the data filter's refusals
        raise IntegrityError(f"{what}: not a valid or safe tar archive ({exc}); refusing it") from None
