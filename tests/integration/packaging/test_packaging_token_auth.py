"""Bearer-token auth against the real registry configured with ``auth: token``.

The registry itself checks every token (signature against the test's certificate, audience,
issuer, expiry, granted actions); the token service that issues them is a small server in this
test — the part a real deployment gets from its identity provider. It checks the Basic
credentials the client sends and grants what the scope asks for.
"""

from __future__ import annotations

import base64
import datetime
import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID
from gs_pkg_containers import files_of
from stack.registry import PKG_PORTS, Registry, free_port

from gpusnap.errors import RegistryError
from gpusnap.packaging import api

pytestmark = pytest.mark.integration
ISSUER, SERVICE = "gs-pkg-issuer", "gs-pkg-registry"
USER, PASSWORD = "gs-pkg-token-user", "gs-pkg-token-pw"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenService:
    def __init__(self, root: Path) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
                     .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(hours=1)).sign(self.key, hashes.SHA256()))
        self.bundle = root / "token-ca.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.issued: list[str] = []
        self.port = free_port(PKG_PORTS)
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def token(self, scopes: list[str]) -> str:
        access = []
        for scope in scopes:
            kind, name, actions = scope.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(datetime.datetime.now(datetime.timezone.utc).timestamp())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()]}
        claims = {"iss": ISSUER, "sub": USER, "aud": SERVICE, "exp": now + 300, "nbf": now - 10, "iat": now,
                  "jti": uuid.uuid4().hex, "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = self.key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64url(sig)}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
                if self.headers.get("Authorization") != expected:
                    self.send_response(401)
                    self.end_headers()
                    return
                query = parse_qs(urlsplit(self.path).query)
                token = service.token(query.get("scope", []))
                service.issued.append(" ".join(query.get("scope", [])))
                body = json.dumps({"token": token, "expires_in": 300}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def token_registry(tmp_path: Path) -> Iterator[tuple[Registry, TokenService]]:
    svc = TokenService(tmp_path)
    reg = Registry(tmp_path / "registry-token", PKG_PORTS,
                   auth_yaml=(f"auth:\n  token:\n    realm: {svc.realm}\n    service: {SERVICE}\n    issuer: {ISSUER}\n"
                              f"    rootcertbundle: {svc.bundle}\n"))
    try:
        reg.start()
        yield reg, svc
    finally:
        reg.kill()
        svc.stop()


@pytest.mark.parametrize("processes", [0, 2], ids=["in-process", "2-transfer-processes"])
def test_push_and_pull_with_bearer_tokens(tmp_path: Path, token_registry: tuple[Registry, TokenService], processes: int) -> None:
    """Also with the uploads in transfer processes: they get the credentials from the pushing
    process, ask the token service themselves, mount across repositories, and a refusal reaches
    the user as the same one-line error."""
    reg, svc = token_registry
    src = tmp_path / "ck"
    src.mkdir()
    (src / "pages-1.img").write_bytes(bytes(range(256)) * 20000)
    (src / "inventory.img").write_bytes(b"inv")
    store = tmp_path / "store"
    api.store_checkpoint(store, src, form="criu-dir", ref="gs-pkg/token")
    remote = f"{reg.host}/gs-pkg/token:v1"

    with pytest.raises(RegistryError, match="requires a login"):
        api.push(store, "gs-pkg/token", remote, insecure=True, processes=processes)

    home = Path(__import__("os").environ["HOME"])
    cfg = home / ".docker" / "config.json"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(f"{USER}:wrong".encode()).decode()}}}))
    with pytest.raises(RegistryError, match="refused the credentials"):
        api.push(store, "gs-pkg/token", remote, insecure=True, processes=processes)

    cfg.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}}}))
    api.push(store, "gs-pkg/token", remote, insecure=True, processes=processes)
    assert any("repository:gs-pkg/token:pull,push" in s for s in svc.issued)
    # A second repository on the same registry: blobs are mounted (token with two scopes).
    pushed = api.push(store, "gs-pkg/token", f"{reg.host}/gs-pkg/token-copy:v1", insecure=True, processes=processes)
    assert pushed.mounted_blobs > 0 and pushed.uploaded_bytes == 0
    assert any("repository:gs-pkg/token:pull" in s and "token-copy" in s for s in svc.issued)

    local = api.pull(tmp_path / "store2", f"{reg.host}/gs-pkg/token-copy:v1", insecure=True)
    out = api.materialize_checkpoint(tmp_path / "store2", local, tmp_path / "out", form="criu-dir")
    assert files_of(out) == files_of(src)
