"""Pull's download path against a scripted in-process registry (no network, ephemeral port).

What is checked: every blob is verified and fdatasynced before the tag, with no syncfs; the
readinto path handles Content-Length, chunked and content-encoded bodies; a body cut off midway
resumes with a Range request from the right offset; a body longer than its descriptor is
refused; completed responses give their connection back to the pool; blobs the store already
holds are not fetched; a failed pull leaves no tag and nothing in ingest/.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gpusnap.errors import IntegrityError
from gpusnap.packaging import store as store_mod
from gpusnap.packaging.registry import RegistryClient, pull_artifact
from gpusnap.packaging.store import MEDIA_OCI_MANIFEST, OciStore
from gpusnap.packaging.verify import verify_store

REPO = "gs-pkg/pull"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    client_port: int


@dataclass
class FakeRegistry:
    """A registry of one manifest; ``mode(digest, headers)`` picks how a blob is served."""

    blobs: dict[str, bytes]
    manifest: bytes = b""
    seen: list[Seen] = field(default_factory=list)
    mode: Callable[[str, dict[str, str]], str] = lambda digest, headers: "plain"
    port: int = 0

    def blob_gets(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "GET" and "/blobs/" in s.path]


def _handler(fake: FakeRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None, *, chunked: bool = False,
                  cut_after: int | None = None, reset: bool = False) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if chunked:
                for i in range(0, len(body), 7000):  # odd piece sizes: reads do not line up with them
                    part = body[i:i + 7000]
                    self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
            elif cut_after is not None:
                self.wfile.write(body[:cut_after])
                self.wfile.flush()
                self.close_connection = True
                if reset:  # RST instead of FIN: the client's read fails instead of ending
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                else:
                    self.connection.shutdown(socket.SHUT_RDWR)
            else:
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            headers = {k.lower(): v for k, v in self.headers.items()}
            fake.seen.append(Seen("GET", self.path, headers, self.client_address[1]))
            if "/manifests/" in self.path:
                self._send(200, fake.manifest, {"Content-Type": MEDIA_OCI_MANIFEST})
                return
            digest = self.path.rsplit("/", 1)[1]
            data = fake.blobs.get(digest)
            if data is None:
                self._send(404, b'{"errors":[{"code":"BLOB_UNKNOWN"}]}')
                return
            mode = fake.mode(digest, headers)
            start = int(headers["range"].split("=")[1].rstrip("-")) if "range" in headers else 0
            status, extra = (206, {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}) if start else (200, {})
            body = data[start:]
            if mode == "cut":
                self._send(status, body, extra, cut_after=len(body) // 2)
            elif mode == "reset":
                self._send(status, body, extra, cut_after=len(body) // 2, reset=True)
            elif mode == "chunked":
                self._send(status, body, extra, chunked=True)
            elif mode == "gzip":  # a server that compresses although the client asked for identity
                self._send(status, gzip.compress(body), {**extra, "Content-Encoding": "gzip"})
            elif mode == "longer":
                self._send(status, body + b"x" * 1000, extra)
            else:
                self._send(status, body, extra)

    return Handler


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeRegistry]:
    rnd = __import__("random").Random(7)
    layers = [rnd.randbytes(n) for n in (3 << 20, (1 << 20) + 12345, 70_000, 1)]
    config = b'{"schemaVersion": 1}'
    blobs = {_digest(b): b for b in [config, *layers]}
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": MEDIA_OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.gpusnap.test.config+json", "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/octet-stream", "digest": _digest(b), "size": len(b)} for b in layers],
    }).encode()
    f = FakeRegistry(blobs, manifest)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(f))
    server.daemon_threads = True
    f.port = server.server_address[1]
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    try:
        yield f
    finally:
        server.shutdown()
        server.server_close()


def _client(fake: FakeRegistry, workers: int = 4) -> RegistryClient:
    return RegistryClient(f"127.0.0.1:{fake.port}", insecure=True, credentials=None, retries=3, backoff_s=0.01, timeout_s=10,
                          workers=workers)


def _ref(fake: FakeRegistry) -> str:
    return f"127.0.0.1:{fake.port}/{REPO}:v1"


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count fdatasync and syncfs calls (the real calls still happen)."""
    counts = {"fdatasync": 0, "syncfs": 0}
    real_fdatasync, real_syncfs = os.fdatasync, store_mod._syncfs
    lock = threading.Lock()

    def fdatasync(fd: int) -> None:
        with lock:
            counts["fdatasync"] += 1
        real_fdatasync(fd)

    def syncfs(path: Path) -> None:
        counts["syncfs"] += 1
        real_syncfs(path)

    monkeypatch.setattr(store_mod.os, "fdatasync", fdatasync)
    monkeypatch.setattr(store_mod, "_syncfs", syncfs)
    return counts


@pytest.mark.parametrize("mode", ["plain", "chunked", "gzip"])
def test_pull_verifies_and_syncs_every_blob_without_syncfs(tmp_path: Path, fake: FakeRegistry, syncs: dict[str, int], mode: str) -> None:
    fake.mode = lambda d, h: mode
    store = OciStore(tmp_path / "store")
    ref = pull_artifact(store, _ref(fake), client=_client(fake))
    assert store.resolve(ref).digest == _digest(fake.manifest)
    for digest, data in fake.blobs.items():
        assert store.blob_path(digest).read_bytes() == data
    assert verify_store(store).ok
    assert list(store.ingest_dir.iterdir()) == []
    # every blob and the manifest were flushed one by one; nothing needed a filesystem-wide sync
    assert syncs == {"fdatasync": len(fake.blobs) + 1, "syncfs": 0}
    assert all(s.headers.get("accept-encoding") == "identity" for s in fake.blob_gets())


def test_cut_off_blob_resumes_from_where_it_stopped(tmp_path: Path, fake: FakeRegistry) -> None:
    big = max(fake.blobs, key=lambda d: len(fake.blobs[d]))
    cuts = [0]

    def mode(digest: str, headers: dict[str, str]) -> str:
        if digest == big and cuts[0] == 0:
            cuts[0] += 1
            return "cut"
        return "plain"

    fake.mode = mode
    store = OciStore(tmp_path / "store")
    pull_artifact(store, _ref(fake), client=_client(fake))
    gets = [s for s in fake.blob_gets() if s.path.endswith(big)]
    half = (len(fake.blobs[big])) // 2
    assert [s.headers.get("range") for s in gets] == [None, f"bytes={half}-"]
    assert store.blob_path(big).read_bytes() == fake.blobs[big]
    assert verify_store(store).ok


def test_body_longer_than_descriptor_is_refused_and_nothing_is_kept(tmp_path: Path, fake: FakeRegistry) -> None:
    big = max(fake.blobs, key=lambda d: len(fake.blobs[d]))
    fake.mode = lambda d, h: "longer" if d == big else "plain"
    store = OciStore(tmp_path / "store")
    with pytest.raises(IntegrityError, match="larger than its descriptor"):
        pull_artifact(store, _ref(fake), client=_client(fake))
    assert store.tags() == []
    assert list(store.ingest_dir.iterdir()) == []
    assert list(store.blobs_dir.iterdir()) == []


def test_completed_downloads_reuse_one_connection(tmp_path: Path, fake: FakeRegistry) -> None:
    store = OciStore(tmp_path / "store")
    pull_artifact(store, _ref(fake), client=_client(fake, workers=1))
    assert len(fake.blob_gets()) == len(fake.blobs)
    # One requests Session per thread: the manifest comes on the caller's connection, every
    # blob on the one worker's.
    assert len({s.client_port for s in fake.blob_gets()}) == 1, "the readinto path must give the connection back to the pool"


def test_blobs_already_in_the_store_are_not_fetched(tmp_path: Path, fake: FakeRegistry) -> None:
    store = OciStore(tmp_path / "store")
    have = max(fake.blobs, key=lambda d: len(fake.blobs[d]))
    store.put_bytes(fake.blobs[have], have)
    store.publish()
    pull_artifact(store, _ref(fake), client=_client(fake))
    fetched = {s.path.rsplit("/", 1)[1] for s in fake.blob_gets()}
    assert fetched == set(fake.blobs) - {have}
    assert verify_store(store).ok


def test_connection_reset_midway_becomes_a_resume(tmp_path: Path, fake: FakeRegistry) -> None:
    """A reset (an OSError out of readinto, not a clean end) is retried with Range like a cut."""
    big = max(fake.blobs, key=lambda d: len(fake.blobs[d]))
    resets = [0]

    def mode(digest: str, headers: dict[str, str]) -> str:
        if digest == big and resets[0] == 0:
            resets[0] += 1
            return "reset"
        return "plain"

    fake.mode = mode
    store = OciStore(tmp_path / "store")
    pull_artifact(store, _ref(fake), client=_client(fake))
    gets = [s for s in fake.blob_gets() if s.path.endswith(big)]
    assert len(gets) == 2
    second = gets[1].headers.get("range")  # what arrived before the reset is kept (if anything did)
    assert second is None or 0 < int(second.split("=")[1].rstrip("-")) < len(fake.blobs[big])
    assert store.blob_path(big).read_bytes() == fake.blobs[big]
    assert verify_store(store).ok
