"""A hostile registry: bad challenges, cross-host redirects, truncated and lying bodies.

Each pull must end in one GpusnapError line (or succeed where the input is legal, like a
redirect), leave no tag and no partial blob in the store, and never send the user's credentials
anywhere but the registry itself (Basic) or the token realm its challenge names (Bearer).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusnap.errors import GpusnapError, IntegrityError, UsageError
from gpusnap.packaging import api
from gpusnap.packaging.auth import Credentials
from gpusnap.packaging.registry import RegistryClient, pull_artifact
from gpusnap.packaging.store import OciStore
from gpusnap.packaging.verify import verify_store

from hostile_http import HostileServer, Reply, Seen

PORT_REG, PORT_OTHER, PORT_REALM = 5350, 5351, 5352
REG = f"127.0.0.1:{PORT_REG}"
OTHER = f"localhost:{PORT_OTHER}"  # another host name: requests must not carry auth there
REALM = f"http://127.0.0.1:{PORT_REALM}/token"
USER, PASSWORD = "gs-rel-user", "gs-rel-SECRET-pw"
BASIC = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
TOKEN = "gs-rel-bearer-token"
REPO = "gs-rel/ck"


class Registry:
    """Three servers and the artifact they serve; tests replace ``manifest``/``blobs``/scripts."""

    def __init__(self, tmp: Path) -> None:
        self.log: list[Seen] = []
        self.reg = HostileServer("registry", "127.0.0.1", PORT_REG, self.log)
        self.other = HostileServer("other", "127.0.0.1", PORT_OTHER, self.log)
        self.realm = HostileServer("realm", "127.0.0.1", PORT_REALM, self.log)
        src = tmp / "ck"
        src.mkdir()
        (src / "inventory.img").write_bytes(b"inventory")
        (src / "pages-1.img").write_bytes(os.urandom(300_000))
        origin = OciStore(tmp / "origin")
        api.store_checkpoint(origin.root, src, form="criu-dir", ref="o:1")
        desc = origin.resolve("o:1")
        self.manifest: bytes = origin.read_bytes(desc.digest)
        m = json.loads(self.manifest)
        self.blobs = {d["digest"]: origin.blob_path(d["digest"]).read_bytes() for d in [m["config"], *m["layers"]]}
        self.auth = "none"  # none | basic | bearer
        self.reg.script = self.serve

    def authorized(self, h: dict[str, str]) -> bool:
        if self.auth == "none":
            return True
        if self.auth == "basic":
            return h.get("authorization") == f"Basic {BASIC}"
        return h.get("authorization") == f"Bearer {TOKEN}"

    def challenge(self) -> Reply:
        value = 'Basic realm="gs-rel"' if self.auth == "basic" else f'Bearer realm="{REALM}",service="gs-rel"'
        return Reply(401, {"WWW-Authenticate": value})

    def serve(self, method: str, path: str, h: dict[str, str]) -> Reply:
        if not self.authorized(h):
            return self.challenge()
        if path.startswith(f"/v2/{REPO}/manifests/"):
            return Reply(200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, self.manifest)
        if path.startswith(f"/v2/{REPO}/blobs/"):
            digest = path.rsplit("/", 1)[1]
            if digest in self.blobs:
                return Reply(200, {"Content-Type": "application/octet-stream"}, self.blobs[digest])
        return Reply(404, {}, b'{"errors":[{"code":"NOT_FOUND"}]}')

    def leaks(self) -> list[str]:
        """Requests that carried the user's secret where it must not go."""
        bad = []
        for s in self.log:
            blob = json.dumps(s.headers) + s.path
            has_basic = BASIC in blob or PASSWORD in blob
            has_bearer = TOKEN in blob
            if s.server == "other" and (has_basic or has_bearer or "authorization" in s.headers):
                bad.append(f"{s.method} other{s.path}: {s.headers.get('authorization', '')[:20]}")
            if s.server == "registry" and has_basic and self.auth == "bearer":
                bad.append(f"{s.method} registry{s.path}: basic credentials sent to a bearer registry")
        return bad

    def __enter__(self) -> "Registry":
        self.reg.__enter__()
        self.other.__enter__()
        self.realm.__enter__()
        return self

    def __exit__(self, *a: object) -> None:
        for s in (self.reg, self.other, self.realm):
            s.__exit__(*a)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with Registry(tmp_path) as r:
        yield r


@pytest.fixture(scope="module")
def counter(module_ledger) -> dict:  # type: ignore[no-untyped-def,type-arg]
    c: dict[str, list[int]] = {}
    yield c
    for name, (tried, refused) in c.items():
        module_ledger.record("bad-input", f"registry:{name}", tried=tried, refused=refused)


def _pull(tmp: Path, ref: str = f"{REG}/{REPO}:1") -> tuple[OciStore, BaseException | None]:
    store = OciStore(tmp / f"store-{os.urandom(4).hex()}")
    client = RegistryClient(REG, insecure=True, credentials=Credentials(USER, PASSWORD, source="test"), retries=2, backoff_s=0.01, timeout_s=5)
    try:
        pull_artifact(store, ref, client=client)
    except BaseException as exc:  # noqa: BLE001 - classified by the caller
        return store, exc
    return store, None


def _clean(store: OciStore) -> None:
    assert store.tags() == [], "a refused pull must not leave a tag"
    assert list(store.ingest_dir.iterdir()) == [], "a refused pull must not leave partial downloads"
    assert verify_store(store).ok


def _refused(counter: dict, name: str, exc: BaseException | None, *types: type) -> None:  # type: ignore[type-arg]
    counter.setdefault(name, [0, 0])[0] += 1
    assert isinstance(exc, types or (GpusnapError,)), f"{name}: {type(exc).__name__}: {str(exc)[:200]}"
    assert "\n" not in str(exc)
    counter[name][1] += 1


# ---- authentication -----------------------------------------------------------------------------
_CHALLENGES = [
    "", "Bearer", 'Bearer realm=""', "Negotiate abc", 'Bearer realm="ftp://127.0.0.1:5352/t"', "\x7f\x01", "Basic",
    'Bearer realm="file:///etc/passwd"', 'Bearer realm="http://127.0.0.1:1/unreachable"', "Bearer realm=" + "x" * 6000,
]


@pytest.mark.parametrize("challenge", _CHALLENGES)
def test_bad_www_authenticate(registry: Registry, tmp_path: Path, counter: dict, challenge: str) -> None:  # type: ignore[type-arg]
    registry.reg.script = lambda m, p, h: Reply(401, {"WWW-Authenticate": challenge} if challenge else {})
    store, exc = _pull(tmp_path)
    _refused(counter, "bad-www-authenticate", exc)
    _clean(store)
    assert registry.leaks() == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(challenge=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80).map(lambda s: "Bearer " + s))
def test_fuzzed_bearer_challenges(registry: Registry, tmp_path: Path, counter: dict, challenge: str) -> None:  # type: ignore[type-arg]
    registry.reg.script = lambda m, p, h: Reply(401, {"WWW-Authenticate": challenge})
    registry.realm.script = lambda m, p, h: Reply(200, {}, json.dumps({"token": TOKEN}).encode())
    registry.log.clear()
    store, exc = _pull(tmp_path)
    _refused(counter, "fuzzed-challenge", exc)
    _clean(store)
    # Whatever realm the header named, the credentials went nowhere but a realm it named.
    for s in registry.log:
        if s.server != "realm":
            assert PASSWORD not in json.dumps(s.headers) and BASIC not in json.dumps(s.headers)


@pytest.mark.parametrize("answer", [
    Reply(200, {}, b"not json"), Reply(200, {}, b"[1,2]"), Reply(200, {}, b"{}"), Reply(200, {}, b'{"token": ""}'),
    Reply(500, {}, b""), Reply(401, {}, b""), Reply(200, {}, b'{"token": 5}'), Reply(200, {}, b'{"token": "x"}', cut_after=3),
])
def test_bad_token_service(registry: Registry, tmp_path: Path, counter: dict, answer: Reply) -> None:  # type: ignore[type-arg]
    registry.auth = "bearer"
    registry.realm.script = lambda m, p, h: answer
    store, exc = _pull(tmp_path)
    _refused(counter, "bad-token-service", exc)
    _clean(store)
    assert registry.leaks() == []


def test_token_realm_redirecting_elsewhere_gets_no_credentials(registry: Registry, tmp_path: Path, counter: dict) -> None:  # type: ignore[type-arg]
    registry.auth = "bearer"
    registry.realm.script = lambda m, p, h: Reply(302, {"Location": f"http://{OTHER}/token"})
    registry.other.script = lambda m, p, h: Reply(200, {}, json.dumps({"token": TOKEN}).encode())
    store, exc = _pull(tmp_path)
    counter.setdefault("realm-redirect-elsewhere", [0, 0])[0] += 1
    assert registry.leaks() == [], registry.leaks()
    assert any(s.server == "other" for s in registry.log), "the redirect was not followed: the test proves nothing"
    counter["realm-redirect-elsewhere"][1] += 1


@pytest.mark.parametrize("auth", ["basic", "bearer"])
@pytest.mark.parametrize("what", ["manifests", "blobs"])
def test_redirect_to_other_host_carries_no_credentials(registry: Registry, tmp_path: Path, counter: dict, auth: str, what: str) -> None:  # type: ignore[type-arg]
    """Registries legitimately redirect blob downloads to storage hosts: follow, but without auth."""
    registry.auth = auth
    registry.realm.script = lambda m, p, h: Reply(200, {}, json.dumps({"token": TOKEN}).encode()) if h.get("authorization") == f"Basic {BASIC}" else Reply(401)
    inner = registry.serve

    def script(m: str, p: str, h: dict[str, str]) -> Reply:
        if registry.authorized(h) and f"/{what}/" in p:
            return Reply(307, {"Location": f"http://{OTHER}{p}"})
        return inner(m, p, h)

    registry.reg.script = script
    registry.other.script = inner if auth == "none" else (lambda m, p, h: registry.serve(m, p, {**h, "authorization": f"Bearer {TOKEN}" if auth == "bearer" else f"Basic {BASIC}"}))
    store, exc = _pull(tmp_path)
    counter.setdefault(f"redirect-{what}-other-host", [0, 0])[0] += 1
    assert registry.leaks() == [], registry.leaks()
    assert any(s.server == "other" for s in registry.log)
    assert exc is None, f"a cross-host redirect without credentials must still work: {exc}"
    assert verify_store(store).ok
    counter[f"redirect-{what}-other-host"][1] += 1


# ---- bodies -------------------------------------------------------------------------------------
def _big_blob(registry: Registry) -> str:
    return max(registry.blobs, key=lambda d: len(registry.blobs[d]))


@pytest.mark.parametrize("mode", ["truncated-blob", "wrong-content", "longer-than-descriptor", "truncated-manifest", "empty-blob"])
def test_bad_bodies(registry: Registry, tmp_path: Path, counter: dict, mode: str) -> None:  # type: ignore[type-arg]
    big = _big_blob(registry)
    inner = registry.serve

    def script(m: str, p: str, h: dict[str, str]) -> Reply:
        r = inner(m, p, h)
        if p.endswith(big) and m == "GET":
            data = registry.blobs[big]
            if mode == "truncated-blob":
                return Reply(200, {}, data, cut_after=len(data) // 2)
            if mode == "wrong-content":
                return Reply(200, {}, bytes(b ^ 1 for b in data[:10]) + data[10:])
            if mode == "longer-than-descriptor":
                return Reply(200, {}, data + b"x" * 1000)
            if mode == "empty-blob":
                return Reply(200, {}, b"")
        if mode == "truncated-manifest" and "/manifests/" in p:
            return Reply(200, r.headers, r.body, cut_after=len(r.body) // 2)
        return r

    registry.reg.script = script
    store, exc = _pull(tmp_path)
    _refused(counter, mode, exc)
    _clean(store)
    assert not store.has_blob(big) or hashlib.sha256(store.blob_path(big).read_bytes()).hexdigest() == big.split(":")[1]


def test_manifest_digest_mismatch_when_pulling_by_digest(registry: Registry, tmp_path: Path, counter: dict) -> None:  # type: ignore[type-arg]
    wanted = "sha256:" + "ab" * 32
    store, exc = _pull(tmp_path, f"{REG}/{REPO}@{wanted}")
    _refused(counter, "manifest-digest-mismatch", exc, IntegrityError)
    _clean(store)


# ---- manifests that lie -------------------------------------------------------------------------
def _mutate(manifest: dict[str, Any], how: str, value: Any) -> bytes:
    m = json.loads(json.dumps(manifest))
    target = m["layers"][0] if how.startswith("layer.") else m["config"] if how.startswith("config.") else m
    key = how.split(".", 1)[1] if "." in how else how
    if value is _DROP:
        target.pop(key, None)
    else:
        target[key] = value
    return json.dumps(m).encode()


_DROP = object()
_MANIFEST_CASES: list[tuple[str, Any]] = [
    ("config", _DROP), ("layers", "notalist"), ("layers", [5]), ("config", "x"), ("schemaVersion", 1), ("schemaVersion", _DROP),
    ("layer.digest", _DROP), ("layer.digest", "sha256:zz"), ("layer.digest", "md5:" + "0" * 32), ("layer.digest", "sha256:" + "0" * 64),
    ("layer.digest", "sha256:../../../../etc/passwd"), ("layer.size", -1), ("layer.size", "12"), ("layer.size", _DROP),
    ("layer.size", 1), ("layer.size", 10**12), ("config.digest", "sha256:" + "1" * 64), ("config.size", 0),
    ("mediaType", "application/vnd.oci.image.index.v1+json"),
]


@pytest.mark.parametrize("how,value", _MANIFEST_CASES, ids=[f"{h}={'drop' if v is _DROP else str(v)[:12]}" for h, v in _MANIFEST_CASES])
def test_lying_manifest(registry: Registry, tmp_path: Path, counter: dict, how: str, value: Any) -> None:  # type: ignore[type-arg]
    registry.manifest = _mutate(json.loads(registry.manifest), how, value)
    store, exc = _pull(tmp_path)
    _refused(counter, "lying-manifest", exc)
    _clean(store)


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'"a string"', b"null", b"{}", b"\xff\xfe", b"{" * 100_000, b" " * (17 << 20)])
def test_malformed_manifest(registry: Registry, tmp_path: Path, counter: dict, body: bytes) -> None:  # type: ignore[type-arg]
    registry.manifest = body
    store, exc = _pull(tmp_path)
    _refused(counter, "malformed-manifest", exc)
    _clean(store)


@pytest.mark.parametrize("config_body", [b"not json", b"[]", b'{"schemaVersion": 99}', b'{"schemaVersion": 1, "files": [{"path": "../../escape", "size": 0}]}'])
def test_lying_config_is_refused_at_restore(registry: Registry, tmp_path: Path, counter: dict, config_body: bytes) -> None:  # type: ignore[type-arg]
    """A config the registry serves consistently (right digest) but with hostile content:
    pull stores it, materialize (restore) must refuse it and write nothing."""
    m = json.loads(registry.manifest)
    digest = "sha256:" + hashlib.sha256(config_body).hexdigest()
    m["config"].update(digest=digest, size=len(config_body))
    registry.blobs[digest] = config_body
    registry.manifest = json.dumps(m).encode()
    store, exc = _pull(tmp_path)
    counter.setdefault("lying-config", [0, 0])[0] += 1
    if exc is None:
        dest = tmp_path / "restore-here"
        with pytest.raises(GpusnapError) as err:
            api.materialize_checkpoint(store.root, f"{REG}/{REPO}:1", dest, form="criu-dir")
        assert "\n" not in str(err.value)
        assert not dest.exists() and not (tmp_path / "escape").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".restore-here")]
    else:
        assert isinstance(exc, GpusnapError)
        _clean(store)
    counter["lying-config"][1] += 1


_bad_digest = st.one_of(
    st.text(max_size=80),
    st.binary(min_size=32, max_size=32).map(lambda b: "sha256:" + b.hex()),  # well-formed, wrong
    st.sampled_from(["sha512:" + "0" * 128, "sha256:" + "A" * 64, "sha256:", "sha256:../../x"]),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(min_value=0, max_value=50), field=st.sampled_from(["digest", "size"]), data=st.data())
def test_fuzzed_descriptor_lies(registry: Registry, tmp_path: Path, counter: dict, which: int, field: str, data: st.DataObject) -> None:  # type: ignore[type-arg]
    """Any descriptor (config or layer) whose digest or size is not the blob's: refused, nothing kept."""
    original = json.loads(registry.manifest)
    m = json.loads(registry.manifest)
    descs = [m["config"], *m["layers"]]
    d = descs[which % len(descs)]
    if field == "digest":
        d["digest"] = data.draw(_bad_digest.filter(lambda v: v != d["digest"]))
    else:
        d["size"] = data.draw(st.one_of(st.integers(), st.text(max_size=5), st.none(), st.floats(allow_nan=False)).filter(lambda v: str(v) != str(d["size"]) and not (isinstance(v, (int, float)) and v == d["size"])))
    registry.manifest = json.dumps(m).encode()
    try:
        store, exc = _pull(tmp_path)
        _refused(counter, "fuzzed-descriptor-lie", exc)
        _clean(store)
    finally:
        registry.manifest = json.dumps(original).encode()
