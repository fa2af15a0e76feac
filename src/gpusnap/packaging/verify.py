"""Full consistency check of the local store (``gpusnap verify``; fsck for checkpoints).

Re-hashes every blob, walks every tag down to its layers and reports what is corrupt, what a tag
needs but is missing, and debris a crash left in ``ingest/``. It changes nothing: repair is
``gc`` (debris, unreferenced blobs) and pulling again (missing or corrupt blobs).
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.errors import IntegrityError
from gpusnap.packaging.store import (
    MEDIA_DOCKER_LIST,
    MEDIA_DOCKER_MANIFEST,
    MEDIA_OCI_INDEX,
    MEDIA_OCI_MANIFEST,
    Descriptor,
    OciStore,
)

_MANIFESTS = (MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST, MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST)


@dataclass
class VerifyReport:
    blobs_checked: int = 0
    bytes_checked: int = 0
    tags_checked: int = 0
    corrupt: list[str] = field(default_factory=list)  # blob files whose content is not their name
    missing: list[str] = field(default_factory=list)  # "ref: digest" a tag needs and the store lacks
    wrong_size: list[str] = field(default_factory=list)  # "ref: digest" whose descriptor size lies
    debris: list[str] = field(default_factory=list)  # leftovers of interrupted writes (harmless)
    readable_by_others: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.corrupt or self.missing or self.wrong_size)

    def summary(self) -> str:
        parts = [f"{self.blobs_checked} blobs ({self.bytes_checked} bytes), {self.tags_checked} tags checked"]
        for name in ("corrupt", "missing", "wrong_size", "debris", "readable_by_others"):
            items = getattr(self, name)
            if items:
                parts.append(f"{len(items)} {name.replace('_', ' ')}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}")
        return "; ".join(parts)


def _hash_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def verify_store(store: OciStore) -> VerifyReport:
    """Check every blob and every tag of ``store``; see :class:`VerifyReport`."""
    report = VerifyReport()
    sizes: dict[str, int] = {}
    for path in sorted(store.blobs_dir.iterdir()):
        hexd, size = _hash_file(path)
        report.blobs_checked += 1
        report.bytes_checked += size
        if hexd != path.name:
            report.corrupt.append(f"sha256:{path.name}")
        else:
            sizes[f"sha256:{hexd}"] = size
    for path in store.ingest_dir.iterdir():
        report.debris.append(str(path.relative_to(store.root)))
    for dirpath, dirnames, filenames in os.walk(store.root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if stat.S_IMODE(p.lstat().st_mode) & 0o077:
                report.readable_by_others.append(str(p.relative_to(store.root)))
    corrupt = set(report.corrupt)
    for tag in store.tags():
        report.tags_checked += 1
        seen: set[str] = set()
        todo = [tag.descriptor]
        while todo:
            d = todo.pop()
            if d.digest in seen:
                continue
            seen.add(d.digest)
            if d.digest not in sizes:
                if d.digest not in corrupt:
                    report.missing.append(f"{tag.ref}: {d.digest}")
                continue
            if sizes[d.digest] != d.size:
                report.wrong_size.append(f"{tag.ref}: {d.digest}")
            if d.media_type in _MANIFESTS:
                try:
                    m = store.manifest(d.digest)
                except IntegrityError:
                    report.corrupt.append(d.digest)
                    continue
                if "config" in m:
                    todo.append(Descriptor.from_dict(m["config"]))
                todo.extend(Descriptor.from_dict(x) for x in m.get("layers", []))
                todo.extend(Descriptor.from_dict(x) for x in m.get("manifests", []))
    return report


def require_ok(store: OciStore) -> VerifyReport:
    """:func:`verify_store`, raising :class:`IntegrityError` with the summary when it fails."""
    report = verify_store(store)
    if not report.ok:
        raise IntegrityError(f"store {store.root} failed verification: {report.summary()}; pull the damaged checkpoints again")
    return report
