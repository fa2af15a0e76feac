"""Fuzzed hostile archives against packaging's extraction: refused, nothing written outside.

Each generated archive mixes harmless entries with at least one hostile one (path traversal,
absolute path, symlink or hard link out of the tree, a symlink gadget that only escapes once an
earlier link is on disk, device nodes and fifos, huge or lying headers). Extraction must raise
an IntegrityError (one line), and the directory around the target must be exactly as before.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusnap.errors import GpusnapError, IntegrityError

safetar = pytest.importorskip("gpusnap.packaging.safetar", reason="packaging's safe extraction has not landed")

_name = st.text(alphabet="abcdefgh", min_size=1, max_size=6)


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes | None]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mode = 0o644
    return ti, data


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = target
    return ti, None


def _special(name: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.devmajor, ti.devminor = (1, 3)  # /dev/null's numbers: harmless even if it were created
    return ti, None


@st.composite
def benign(draw: st.DrawFn) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    out = []
    for _ in range(draw(st.integers(0, 3))):
        n = draw(_name)
        d = tarfile.TarInfo(f"d{n}")
        d.type = tarfile.DIRTYPE
        d.mode = 0o755
        out += [(d, None), _file(f"d{n}/f{draw(_name)}", draw(st.binary(max_size=64)))]
    return out


def hostile(outside: Path) -> st.SearchStrategy[tuple[str, list[tuple[tarfile.TarInfo, bytes | None]]]]:
    """(kind, entries): every entry list here must make extraction fail."""
    o = str(outside)
    dots = st.sampled_from(["..", "../..", "a/../..", "./..", "a/b/../../..", "a/./../.."])
    return st.one_of(
        st.tuples(st.just("traversal"), st.builds(lambda d, n: [_file(f"{d}/{n}")], dots, _name)),
        st.tuples(st.just("absolute"), st.builds(lambda n: [_file(f"{o}/{n}")], _name)),
        st.tuples(st.just("symlink-out"), st.builds(
            lambda n, t: [_link(n, t, tarfile.SYMTYPE), _file(f"{n}/pwned")],
            _name, st.one_of(dots, st.just(o), st.just("/")))),
        st.tuples(st.just("hardlink-out"), st.builds(
            lambda n, t: [_link(n, t, tarfile.LNKTYPE)],
            _name, st.one_of(st.just(f"{o}/victim"), st.builds(lambda d: f"{d}/victim", dots)))),
        # c -> "." passes a purely textual check; then b -> "c/../x" resolves through c to outside.
        st.tuples(st.just("symlink-gadget"), st.builds(
            lambda x: [_link("c", ".", tarfile.SYMTYPE), _link("b", f"c/../{outside.name}", tarfile.SYMTYPE), _file("b/pwned")],
            _name)),
        st.tuples(st.just("device-node"), st.builds(
            lambda n, k: [_special(n, k)], _name, st.sampled_from([tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE]))),
        st.tuples(st.just("unknown-type"), st.builds(lambda n: [_special(n, b"Z")], _name)),
    )


def _build(entries: list[tuple[tarfile.TarInfo, bytes | None]], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for ti, data in entries:
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int, str]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == skip or skip in Path(dirpath).parents:
            continue
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p == skip:
                continue
            st_ = p.lstat()
            out[str(p)] = (st_.st_mode, st_.st_size, os.readlink(p) if p.is_symlink() else "")
    return out


def _extract(data: bytes, dest: Path) -> BaseException | None:
    try:
        safetar.extract_all(io.BytesIO(data), dest, what="fuzz")
    except BaseException as exc:  # noqa: BLE001 - we classify what came out
        return exc
    return None


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gs-rel-archive")
    (root / "outside").mkdir()
    (root / "outside" / "victim").write_text("must not change")
    return root


class Tally:
    def __init__(self) -> None:
        self.by_kind: dict[str, list[int]] = {}

    def add(self, kind: str, refused: bool) -> None:
        t = self.by_kind.setdefault(kind, [0, 0])
        t[0] += 1
        t[1] += int(refused)


@pytest.fixture(scope="module")
def tally(module_ledger) -> Tally:  # type: ignore[no-untyped-def]
    t = Tally()
    yield t
    ledger = module_ledger
    for kind, (tried, refused) in t.by_kind.items():
        ledger.record("bad-input", f"archive:{kind}", tried=tried, refused=refused)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_archive_refused_and_nothing_written_outside(box: Path, tally: Tally, data: st.DataObject) -> None:
    outside = box / "outside"
    kind, bad = data.draw(hostile(outside))
    entries = data.draw(benign()) + bad + data.draw(benign())
    fmt = data.draw(st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]))
    dest = box / "dest"
    dest.mkdir()
    before = _snapshot(box, skip=dest)
    try:
        err = _extract(_build(entries, fmt), dest)
        refused = isinstance(err, IntegrityError) and "\n" not in str(err)
        tally.add(kind, refused)
        assert refused, f"{kind}: {[e[0].name[:80] for e in entries]} -> {type(err).__name__}: {str(err)[:200]}"
        assert _snapshot(box, skip=dest) == before, f"{kind} wrote outside the target"
    finally:
        import shutil

        shutil.rmtree(dest)


def _huge_pax(size: int) -> bytes:
    ti = tarfile.TarInfo("f")
    ti.pax_headers = {"path": "a" * size, "comment": "b" * size}
    return _build([(ti, b"")], tarfile.PAX_FORMAT)


@pytest.mark.parametrize(
    "case",
    ["pax-1MiB-path", "size-lies-longer", "truncated-member", "garbage-header", "negative-size", "gnu-longname-16MiB"],
)
def test_malformed_and_huge_headers(box: Path, tally: Tally, case: str) -> None:
    good = _build([_file("f", b"hello" * 100)], tarfile.PAX_FORMAT)
    if case == "pax-1MiB-path":
        data = _huge_pax(1 << 20)
    elif case == "size-lies-longer":
        ti = tarfile.TarInfo("f")
        ti.size = 10_000
        hdr = ti.tobuf(tarfile.USTAR_FORMAT)
        data = hdr + b"x" * 100
    elif case == "truncated-member":
        data = good[: 512 + 100]
    elif case == "garbage-header":
        data = b"\xff" * 1024 + good
    elif case == "negative-size":
        hdr = bytearray(tarfile.TarInfo("f").tobuf(tarfile.USTAR_FORMAT))
        hdr[124:136] = b"\xff" * 12  # base-256 encoding of a negative number
        hdr[148:156] = b"        "
        hdr[148:156] = (b"%06o\x00 " % sum(hdr))
        data = bytes(hdr)
    else:
        ti = tarfile.TarInfo("././@LongLink")
        ti.type = tarfile.GNUTYPE_LONGNAME
        ti.size = 16 << 20
        data = ti.tobuf(tarfile.USTAR_FORMAT) + b"a" * (1 << 20)
    dest = box / "dest"
    dest.mkdir()
    before = _snapshot(box, skip=dest)
    try:
        err = _extract(data, dest)
        # A header that declares a 1 MiB path is legal tar, but an entry name that long cannot
        # exist on Linux (PATH_MAX 4096): it must be refused as a bad archive, not crash.
        refused = isinstance(err, GpusnapError) and "\n" not in str(err)
        tally.add(f"header:{case}", refused)
        assert refused, f"{case} -> {type(err).__name__}: {str(err)[:200]}"
        assert _snapshot(box, skip=dest) == before
    finally:
        import shutil

        shutil.rmtree(dest)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_hostile_podman_archive_through_store_and_materialize(box: Path, tally: Tally, data: st.DataObject) -> None:
    """The whole packaging path: a hostile `podman checkpoint --export` file is stored, then
    materialized; one of the two must refuse it, with nothing outside the destination touched."""
    import shutil

    from gpusnap.packaging import api
    from gpusnap.packaging.store import OciStore

    outside = box / "outside"
    kind, bad = data.draw(hostile(outside))
    if kind == "symlink-gadget":
        # Inside the CRIU dir, so materialize extracts it (entries outside it are not restored).
        bad = [_link("checkpoint/c", ".", tarfile.SYMTYPE), _link("checkpoint/b", "c/../pwned-dir", tarfile.SYMTYPE), _file("checkpoint/b/pwned")]
    else:
        for ti, _ in bad:
            if not ti.name.startswith("/") and ".." not in ti.name:
                ti.name = "checkpoint/" + ti.name
    entries = [_file("checkpoint/inventory.img", b"inv"), *data.draw(benign()), *bad]
    work = box / "dest"
    work.mkdir()
    try:
        archive = work / "export.tar"
        archive.write_bytes(_build(entries, tarfile.PAX_FORMAT))
        store_dir = work / "store"
        before = _snapshot(box, skip=store_dir)
        refused_at = None
        try:
            api.store_checkpoint(store_dir, archive, form="podman-archive", ref="gs-rel-hostile:1")
        except GpusnapError as exc:
            refused_at = "store"
            assert "\n" not in str(exc)
        if refused_at is None:
            try:
                api.materialize_checkpoint(store_dir, "gs-rel-hostile:1", work / "out", form="criu-dir")
            except GpusnapError as exc:
                refused_at = "materialize"
                assert "\n" not in str(exc)
        tally.add(f"podman-export:{kind}", refused_at is not None)
        assert refused_at is not None, f"{kind}: {[e[0].name[:60] for e in entries]} accepted end to end"
        assert _snapshot(box, skip=store_dir) == before, f"{kind} wrote outside the target"
        if kind == "symlink-gadget":
            assert refused_at == "store", "a symlink chain is refused when stored, not only when extracted"
        if refused_at == "store":
            assert OciStore(store_dir).tags() == [], "a refused checkpoint must not be tagged"
    finally:
        shutil.rmtree(work)


def test_harmless_symlinks_still_stored(tmp_path: Path) -> None:
    """The chain rule refuses paths through the archive's own links, not links as such."""
    from gpusnap.packaging import api

    entries = [_file("checkpoint/inventory.img", b"inv"), _file("checkpoint/a.img", b"a"),
               _link("checkpoint/alias.img", "a.img", tarfile.SYMTYPE), _link("checkpoint/again.img", "alias.img", tarfile.SYMTYPE)]
    archive = tmp_path / "export.tar"
    archive.write_bytes(_build(entries, tarfile.PAX_FORMAT))
    api.store_checkpoint(tmp_path / "store", archive, form="podman-archive", ref="gs-rel-ok:1")
    out = api.materialize_checkpoint(tmp_path / "store", "gs-rel-ok:1", tmp_path / "out", form="criu-dir")
    assert (out / "again.img").read_bytes() == b"a"
