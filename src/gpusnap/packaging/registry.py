"""An OCI distribution client for checkpoint push and pull, on ``requests``.

Why not oras-py (checked: oras 0.2.43): its plain upload does ``fd.read()`` of the whole blob
into memory (a 10 GB checkpoint would need 10 GB of RAM), its download writes without checking
the digest, and it has no cross-repository mount, no resumable uploads, no parallel transfers
and no referrers fallback. Those are exactly what moving multi-GB checkpoints needs, so this
module implements the distribution API directly:

* auth: anonymous, Basic, and Bearer tokens (``WWW-Authenticate`` challenge → token endpoint
  with the user's credentials, see auth.py), cached per scope;
* push: HEAD first (skip what the registry has), cross-repo mount from repositories this store
  pushed to or pulled from, monolithic PUT for small blobs, chunked PATCH for large ones with
  resume from the registry's reported offset after a failure, several blobs in parallel, every
  body streamed from disk (memory bounded by the chunk size, not the blob size);
* pull: blobs streamed into the store's ingest area with the digest computed on the fly (the
  body is read with ``readinto`` into one reusable buffer per transfer, hashed and written
  from there: no per-read allocation, no extra copy); each blob is written back as it arrives
  and fdatasynced when it completes, overlapping the flush with the other transfers; a blob
  becomes visible only when its digest and size match; interrupted downloads resume with a
  Range request;
* retries with exponential backoff on connection errors, 429 and 5xx (not for an address that
  never answered: no such host at once; refused, no TLS or an untrusted certificate twice).
"""

from __future__ import annotations

import http.client
import json
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlencode, urljoin, urlsplit

import requests
from requests.adapters import HTTPAdapter

from gpusnap.errors import GpusnapError, IntegrityError, NotFoundError, RegistryError, RegistryUnreachable, UsageError
from gpusnap.packaging.auth import AuthSources, Credentials, find_credentials
from gpusnap.packaging.progress import Progress, default_progress
from gpusnap.packaging.store import (
    MEDIA_DOCKER_LIST,
    MEDIA_DOCKER_MANIFEST,
    MEDIA_OCI_INDEX,
    MEDIA_OCI_MANIFEST,
    Descriptor,
    OciStore,
    sha256_digest,
    validate_digest,
)
from gpusnap.packaging.transfer_procs import TransferProcesses, WorkerDied, push_processes

MANIFEST_ACCEPT = ", ".join([MEDIA_OCI_MANIFEST, MEDIA_OCI_INDEX, MEDIA_DOCKER_MANIFEST, MEDIA_DOCKER_LIST])
MONOLITHIC_LIMIT = 32 << 20  # blobs up to this size go in one streamed PUT
PATCH_SIZE = 64 << 20  # larger blobs go in PATCH requests of this size (resume granularity)
READ_SIZE = 1 << 20
# Blob downloads: one buffer per transfer, refilled by readinto. 256 KiB keeps the receive copy,
# the hash and the page-cache copy in L2 (with 8 transfers, 1 MiB buffers cost ~50 % more sys time).
RECV_SIZE = 256 << 10
SEND_SIZE = 4 << 20  # request bodies are read from disk in pieces of this size (8 workers: 32 MiB)
MAX_MANIFEST = 16 << 20
WORKERS = 8

_REF_RE = re.compile(r"^(?P<name>[a-z0-9]+(?:[._\-/][a-z0-9]+)*)(?::(?P<tag>[\w][\w.\-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


@dataclass(frozen=True)
class RemoteRef:
    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> "RemoteRef":
        first, _, rest = text.partition("/")
        if rest and ("." in first or ":" in first or first == "localhost"):
            registry, path = first, rest
        else:
            registry, path = "docker.io", text if "/" in text else f"library/{text}"
        m = _REF_RE.fullmatch(path)
        if not m:
            raise UsageError(f"invalid registry reference {text!r}; use HOST[:PORT]/REPOSITORY[:TAG|@sha256:DIGEST]")
        tag = m.group("tag")
        if not tag and not m.group("digest"):
            tag = "latest"
        return cls(registry, m.group("name"), tag, m.group("digest"))

    @property
    def reference(self) -> str:
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        s = f"{self.registry}/{self.repository}"
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s


@dataclass
class PushResult:
    remote: str  # the reference pushed to, with its tag
    digest: str
    uploaded_bytes: int
    skipped_bytes: int  # blobs the registry already had (HEAD) or mounted from another repository
    mounted_blobs: int
    blobs: int
    seconds: float


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return scheme.lower(), params


class RegistryClient:
    """One registry host; thread-safe for the parallel transfers of one push or pull."""

    def __init__(
        self,
        registry: str,
        *,
        insecure: bool = False,
        credentials: Credentials | None = None,
        auth_sources: AuthSources | None = None,
        retries: int = 6,
        backoff_s: float = 0.5,
        timeout_s: float = 60.0,
        monolithic_limit: int = MONOLITHIC_LIMIT,
        patch_size: int = PATCH_SIZE,
        workers: int = WORKERS,
    ) -> None:
        self.registry = registry
        self.monolithic_limit = monolithic_limit
        self.patch_size = patch_size
        self.workers = workers
        self.base = f"{'http' if insecure else 'https'}://{registry}"
        self.creds = credentials if credentials is not None else find_credentials(registry, auth_sources)
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        # One Session per thread: requests does not promise a Session is thread-safe, and a
        # thread that keeps its own keeps its own kept-alive connection for every blob it moves.
        self._local = threading.local()
        self._lock = threading.Lock()
        self._auth: dict[str, str] = {}  # scope → Authorization header value
        self.recoveries: list[tuple[str, int, int]] = []  # (blob, offset at failure, offset resumed from)
        self._challenge: tuple[str, dict[str, str]] | None = None
        # Whether the registry has answered this client (or the one it was made from): until
        # it has, an address that cannot work (_never_answers) is reported after one retry at
        # most instead of after the whole backoff (15 s), which is for registries that drop
        # out in the middle of a transfer.
        self.reached = False

    @property
    def session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            adapter = HTTPAdapter(pool_connections=2, pool_maxsize=2)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            session.headers["User-Agent"] = "gpusnap"
            self._local.session = session
        return session

    def auth_state(self) -> dict[str, str]:
        """The Authorization values earned so far (scope → header): what another process
        talking to the same registry for this client adopts (:meth:`adopt_auth`) instead of
        asking the token service again."""
        with self._lock:
            return dict(self._auth)

    def adopt_auth(self, state: dict[str, str]) -> None:
        with self._lock:
            self._auth.update(state)

    # ---- auth ---------------------------------------------------------------------------------
    def _authorize(self, scope: str, challenge_header: str) -> None:
        scheme, params = _parse_challenge(challenge_header)
        with self._lock:
            self._challenge = (scheme, params)
        if scheme == "basic":
            if not self.creds or not (self.creds.username or self.creds.password):
                raise RegistryError(f"{self.registry} requires a login; run `docker login {self.registry}` or `podman login {self.registry}`")
            value = requests.auth._basic_auth_str(self.creds.username, self.creds.password)  # type: ignore[attr-defined]
        elif scheme == "bearer":
            value = "Bearer " + self._fetch_token(params, scope)
        else:
            raise RegistryError(f"{self.registry} asks for unsupported auth scheme {scheme!r}")
        with self._lock:
            self._auth[scope] = value

    def _fetch_token(self, params: dict[str, str], scope: str) -> str:
        realm = params.get("realm")
        if not realm:
            raise RegistryError(f"{self.registry}: bearer challenge without a realm; the registry is misconfigured")
        query: dict[str, Any] = {"service": params.get("service", "")}
        if scope:
            query["scope"] = scope.split()  # several scopes (a mount) are repeated parameters
        try:
            if self.creds and self.creds.identity_token:
                r = self.session.post(realm, data={**query, "grant_type": "refresh_token", "refresh_token": self.creds.identity_token,
                                                   "client_id": "gpusnap"}, timeout=self.timeout_s)
            else:
                auth = (self.creds.username, self.creds.password) if self.creds and self.creds.username else None
                r = self.session.get(realm, params=query, auth=auth, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise RegistryError(f"cannot reach the token service of {self.registry} ({realm}): {exc}") from None
        if r.status_code in (401, 403):
            raise RegistryError(self._denied_message(r.status_code))
        if r.status_code != 200:
            raise RegistryError(f"token service of {self.registry} answered HTTP {r.status_code}")
        try:
            body = r.json()
        except ValueError:
            body = None
        token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else None
        if not token or not isinstance(token, str):
            raise RegistryError(f"token service of {self.registry} returned no token (not a JSON object with a token string)")
        return token

    def _denied_message(self, status: int) -> str:
        if self.creds:
            return (f"{self.registry} refused the credentials from {self.creds.source or 'the caller'} (HTTP {status}); "
                    f"check the user name and password, or log in again with `docker login {self.registry}`")
        return f"{self.registry} requires a login (HTTP {status}); run `docker login {self.registry}` or `podman login {self.registry}`"

    # ---- requests with auth and retries -------------------------------------------------------
    def request(
        self,
        method: str,
        url: str,
        *,
        scope: str,
        headers: dict[str, str] | None = None,
        body: Callable[[], Any] | None = None,
        stream: bool = False,
        ok: tuple[int, ...] = (200,),
        allow: tuple[int, ...] = (),
        retry: bool = True,
    ) -> requests.Response:
        """Send with auth; ``body`` is a factory so a retry sends a fresh stream, not a spent one."""
        if not url.startswith("http"):
            url = self.base + url
        attempts = self.retries if retry else 1
        authed_once = False
        last_exc: Exception | None = None
        attempt = 0
        while attempt < attempts:
            h = dict(headers or {})
            with self._lock:
                if scope in self._auth:
                    h["Authorization"] = self._auth[scope]
            try:
                r = self.session.request(method, url, headers=h, data=body() if body else None, stream=stream,
                                         timeout=self.timeout_s, allow_redirects=True)
            except requests.RequestException as exc:
                last_exc = exc
                attempt += 1
                if not self.reached and (attempt >= 2 or _no_such_host(exc)) and _never_answers(exc):
                    break  # no such host, or refused / no TLS twice, before it ever answered
                if attempt < attempts:
                    time.sleep(self.backoff_s * (2 ** (attempt - 1)))
                continue
            self.reached = True
            if r.status_code == 401 and not authed_once:
                authed_once = True
                challenge = r.headers.get("WWW-Authenticate", "")
                r.close()
                if not challenge:
                    raise RegistryError(self._denied_message(401))
                self._authorize(scope, challenge)
                continue
            if r.status_code in (401, 403):
                r.close()
                raise RegistryError(self._denied_message(r.status_code))
            if r.status_code in ok or r.status_code in allow:
                return r
            if (r.status_code == 429 or r.status_code >= 500) and attempt + 1 < attempts:
                r.close()
                attempt += 1
                time.sleep(self.backoff_s * (2 ** (attempt - 1)))
                continue
            raise RegistryError(f"{method} {urlsplit(url).path} on {self.registry}: HTTP {r.status_code} {_error_text(r)}")
        raise RegistryUnreachable(f"cannot reach registry {self.registry} ({unreachable_cause(last_exc)}); check the address and that it is up"
                            f"{'' if self.base.startswith('http:') else ', or use --insecure for a plain-HTTP registry'}")

    # ---- manifests ----------------------------------------------------------------------------
    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str, str]:
        """(bytes, media type, digest) — the digest is computed here, never taken on trust."""
        r = self.request("GET", f"/v2/{repo}/manifests/{reference}", scope=f"repository:{repo}:pull",
                         headers={"Accept": MANIFEST_ACCEPT}, stream=True, allow=(404,))
        with r:
            if r.status_code == 404:
                raise NotFoundError(f"{self.registry}/{repo}:{reference} does not exist in the registry")
            try:
                data = _read_limited(r, MAX_MANIFEST)
            except requests.RequestException as exc:
                raise RegistryError(f"manifest download from {self.registry}/{repo} broke off ({exc}); try again") from None
        digest = sha256_digest(data)
        if reference.startswith("sha256:") and digest != reference:
            raise IntegrityError(f"manifest from {self.registry}/{repo}@{reference} has digest {digest}; refusing it")
        media = r.headers.get("Content-Type", "").split(";")[0] or json.loads(data).get("mediaType", MEDIA_OCI_MANIFEST)
        return data, media, digest

    def put_manifest(self, repo: str, reference: str, data: bytes, media_type: str) -> requests.Response:
        return self.request("PUT", f"/v2/{repo}/manifests/{reference}", scope=f"repository:{repo}:pull,push",
                            headers={"Content-Type": media_type}, body=lambda: data, ok=(201, 200))

    # ---- blobs --------------------------------------------------------------------------------
    def blob_exists(self, repo: str, digest: str) -> bool:
        r = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", scope=f"repository:{repo}:pull,push", allow=(404,))
        r.close()
        return r.status_code == 200

    def _location(self, r: requests.Response) -> str:
        loc = r.headers.get("Location")
        if not loc:
            raise RegistryError(f"{self.registry} started an upload without a Location header")
        return urljoin(self.base + "/", loc)

    def try_mount(self, repo: str, digest: str, from_repo: str) -> tuple[bool, str | None]:
        """(mounted, upload URL the registry opened instead, if any)."""
        scope = f"repository:{repo}:pull,push repository:{from_repo}:pull"
        r = self.request("POST", f"/v2/{repo}/blobs/uploads/?{urlencode({'mount': digest, 'from': from_repo})}",
                         scope=scope, ok=(201, 202))
        r.close()
        return (True, None) if r.status_code == 201 else (False, self._location(r))

    def start_upload(self, repo: str) -> str:
        r = self.request("POST", f"/v2/{repo}/blobs/uploads/", scope=f"repository:{repo}:pull,push", ok=(202,))
        r.close()
        return self._location(r)

    def upload_blob(self, repo: str, desc: Descriptor, path: "Path | Callable[[], IO[bytes]]", progress: Progress,
                    upload_url: str | None = None) -> None:
        """``path``: the blob's file, or a function opening it (a store blob that a publish may
        move from ingest/ to blobs/ while it is being sent: see :func:`blob_opener`)."""
        scope = f"repository:{repo}:pull,push"
        url = upload_url or self.start_upload(repo)
        if desc.size <= self.monolithic_limit:
            sent = [0]

            def body() -> _FileBody:
                sent[0] = 0
                return _file_iter(path, 0, desc.size, progress, sent)

            for attempt in range(self.retries):
                try:
                    r = self.request("PUT", _with_query(url, digest=desc.digest), scope=scope, body=body,
                                     headers={"Content-Type": "application/octet-stream"},
                                     ok=(201,), retry=False)
                    r.close()
                    return
                except RegistryError:
                    progress.advance(-sent[0])
                    if attempt + 1 >= self.retries:
                        raise
                    time.sleep(self.backoff_s * (2 ** attempt))
                    url = self._restart_upload(repo)
            return
        self._chunked_upload(repo, desc, path, progress, url)

    def _restart_upload(self, repo: str) -> str:
        return self.start_upload(repo)

    def _upload_offset(self, url: str, scope: str) -> int | None:
        """Bytes the registry holds for an upload session, or None if the session is gone."""
        r = self.request("GET", url, scope=scope, ok=(204,), allow=(404,))
        r.close()
        if r.status_code == 404:
            return None
        rng = r.headers.get("Range", "")
        m = re.match(r"^(?:bytes=)?0-(\d+)$", rng)
        return int(m.group(1)) + 1 if m else 0

    def _upload_offset_retrying(self, url: str, scope: str) -> int | None:
        for attempt in range(self.retries):
            try:
                return self._upload_offset(url, scope)
            except RegistryError:
                if attempt + 1 >= self.retries:
                    raise
                time.sleep(self.backoff_s * (2 ** attempt))
        return None

    def _chunked_upload(self, repo: str, desc: Descriptor, path: "Path | Callable[[], IO[bytes]]", progress: Progress, url: str) -> None:
        scope = f"repository:{repo}:pull,push"
        offset = 0
        failures = 0
        while offset < desc.size:
            n = min(self.patch_size, desc.size - offset)
            start = offset
            sent = [0]
            try:
                r = self.request("PATCH", url, scope=scope, retry=False, ok=(202,),
                                 body=lambda s=start, k=n, t=sent: _file_iter(path, s, k, progress, t),
                                 headers={"Content-Type": "application/octet-stream",
                                          "Content-Range": f"{start}-{start + n - 1}"})
                r.close()
                url = self._location(r)
                offset += n
                failures = 0
            except RegistryError:
                progress.advance(-sent[0])
                failures += 1
                if failures >= self.retries:
                    raise
                time.sleep(self.backoff_s * (2 ** (failures - 1)))
                # Never PATCH again blindly: a half-received PATCH may have left bytes the
                # session's state does not account for. Ask the registry what it holds (the
                # resume); if it no longer knows the session, start this blob again.
                held = self._upload_offset_retrying(url, scope)
                if held is None:
                    url, held = self.start_upload(repo), 0
                with self._lock:
                    self.recoveries.append((desc.digest, offset, held))
                progress.advance(held - offset)
                offset = held
        r = self.request("PUT", _with_query(url, digest=desc.digest), scope=scope, ok=(201,), headers={"Content-Length": "0"})
        r.close()

    def download_blob(self, repo: str, desc: Descriptor, store: OciStore, progress: Progress, _restarts: int = 0) -> bool:
        """Stream a blob into the store; True if it was added (False: it was already there)."""
        if _restarts > self.retries:
            raise RegistryError(f"download of {desc.digest} from {self.registry} kept breaking off and the registry ignores Range; try again later")
        if store.has_blob(desc.digest):
            progress.advance(desc.size)
            return False
        scope = f"repository:{repo}:pull"
        failures = 0
        buf = memoryview(bytearray(RECV_SIZE))
        # sync: the blob is fdatasynced when it completes, while the other transfers go on, so
        # publishing the pull needs no syncfs at the end; unbuffered: writes come in RECV_SIZE
        # pieces already.
        with store.writer(sync=True, buffered=False) as w:
            while True:
                # identity: the digest is over the bytes as stored; a compressed transfer would
                # only add work on both sides.
                headers = {"Accept-Encoding": "identity"}
                if w.size:
                    headers["Range"] = f"bytes={w.size}-"
                try:
                    r = self.request("GET", f"/v2/{repo}/blobs/{desc.digest}", scope=scope, stream=True, headers=headers,
                                     ok=(200, 206), allow=(404,))
                    with r:
                        if r.status_code == 404:
                            raise NotFoundError(f"blob {desc.digest} is missing from {self.registry}/{repo}")
                        if w.size and r.status_code == 200:  # the server ignored Range: start over
                            progress.advance(-w.size)
                            w.abort()
                            return self.download_blob(repo, desc, store, progress, _restarts + 1)
                        _receive_body(r, w, desc, buf, progress, self.registry)
                    if w.size < desc.size:
                        raise requests.ConnectionError(f"stream ended at {w.size} of {desc.size} bytes")
                    w.commit(desc.digest, desc.size)
                    return True
                except (requests.RequestException, RegistryError) as exc:
                    failures += 1
                    if failures >= self.retries:
                        if isinstance(exc, GpusnapError):
                            raise
                        raise RegistryError(f"download of {desc.digest} from {self.registry} failed: {exc}") from None
                    time.sleep(self.backoff_s * (2 ** (failures - 1)))


def _receive_body(r: requests.Response, w: Any, desc: Descriptor, buf: memoryview, progress: Progress, registry: str) -> None:
    """Copy a blob response body into the writer ``w`` (which hashes it), never past ``desc.size``."""
    too_large = f"blob {desc.digest} from {registry} is larger than its descriptor says; refusing it"
    for n in read_body_into(r, buf):
        if w.size + n > desc.size:
            raise IntegrityError(too_large)
        w.write(buf[:n])
        progress.advance(n)


def read_body_into(r: requests.Response, buf: memoryview) -> Iterator[int]:
    """The body of ``r`` piece by piece: each yielded ``n`` means ``buf[:n]`` holds the next bytes."""
    body = BodyReader(r)
    while n := body.readinto(buf):
        yield n


class BodyReader:
    """A response body read into buffers the caller chooses (``readinto``; 0 at its end).

    Fast path: ``readinto`` on the standard library's response under urllib3 (it handles
    Content-Length and chunked framing), so the bytes go from the socket straight into the
    caller's buffer — a reused receive buffer, or the destination file's own mapping
    (gpusnap.packaging.fetch) — instead of a new ``bytes`` per read and the copies through
    urllib3's buffers. A fully read response gives its connection back to the pool, as
    ``iter_content`` would. Anything else (a content-encoded body, another urllib3 backend)
    goes through ``iter_content``. Read errors become ``requests.ConnectionError``, so callers
    resume with a Range request either way.
    """

    def __init__(self, r: requests.Response) -> None:
        self.r = r
        fp = getattr(r.raw, "_fp", None)
        encoding = r.headers.get("Content-Encoding", "identity").strip().lower()
        self.fp = fp if isinstance(fp, http.client.HTTPResponse) and encoding in ("", "identity") else None
        self.chunks: Iterator[bytes] | None = None if self.fp is not None else r.iter_content(RECV_SIZE)
        self.left = memoryview(b"")

    def readinto(self, buf: memoryview) -> int:
        if self.fp is None:
            if not self.left:
                self.left = memoryview(next(self.chunks, b""))  # type: ignore[arg-type]
            n = min(len(buf), len(self.left))
            buf[:n] = self.left[:n]
            self.left = self.left[n:]
            return n
        try:
            n = self.fp.readinto(buf)
        except (OSError, http.client.HTTPException) as exc:
            raise requests.ConnectionError(f"blob download broke off: {exc!r}") from None
        if not n and self.fp.isclosed():  # the whole body was read: the connection can serve the next blob
            self.r.raw.release_conn()
        return n


def _no_such_host(exc: BaseException) -> bool:
    """The name does not resolve (EAI_NONAME: not a temporary resolver failure)."""
    return "Name or service not known" in str(exc) or "nodename nor servname provided" in str(exc)


def _never_answers(exc: BaseException) -> bool:
    """An error that says the address itself is wrong (no such host, nothing listening there,
    a server that does not speak TLS or whose certificate this host does not trust), not that an
    answer was slow or cut off."""
    text = str(exc)
    return _no_such_host(exc) or any(s in text for s in ("Connection refused", "WRONG_VERSION_NUMBER", "CERTIFICATE_VERIFY_FAILED"))


def unreachable_cause(exc: BaseException | None) -> str:
    """Why a request got no answer, in a few words: requests nests urllib3's exceptions (retry,
    connection, socket), and its text repeats the URL and class names around the one part a user
    can act on, the system's own error ("Connection refused", "Name or service not known")."""
    if exc is None:
        return "no answer"
    text = str(exc)
    found = re.findall(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if found:
        return found[-1].strip().rstrip(".")
    if isinstance(exc, requests.Timeout):
        return "timed out"
    tls = re.search(r"\[SSL: ([A-Z_]+)\] ([^(\"']+)", text)
    if tls:
        reason = "TLS: " + tls.group(2).strip().rstrip(".")
        if tls.group(1) == "CERTIFICATE_VERIFY_FAILED":
            reason += "; to trust the registry's CA: REQUESTS_CA_BUNDLE=CA.pem"
        return reason
    return text if len(text) <= 200 else text[:200] + "..."


def _error_text(r: requests.Response) -> str:
    try:
        errs = r.json().get("errors") or []
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errs) or r.reason
    except ValueError:
        return r.reason or ""


def _read_limited(r: requests.Response, limit: int) -> bytes:
    buf = bytearray()
    for data in r.iter_content(READ_SIZE):
        buf += data
        if len(buf) > limit:
            raise IntegrityError(f"manifest larger than {limit} bytes; refusing it")
    return bytes(buf)


def _with_query(url: str, **params: str) -> str:
    return url + ("&" if "?" in url else "?") + urlencode(params)


class _FileBody:
    """``length`` bytes of ``path`` from ``offset`` as a request body.

    ``__len__`` makes requests send a Content-Length (not chunked encoding) and ``__iter__``
    makes urllib3 write it SEND_SIZE at a time, so memory stays flat whatever the blob size.
    """

    def __init__(self, path: "Path | Callable[[], IO[bytes]]", offset: int, length: int, progress: Progress, sent: list[int]) -> None:
        self._path, self._offset, self._length = path, offset, length
        self._progress, self._sent = progress, sent

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[bytes | memoryview]:
        end = self._offset + self._length
        with (self._path() if callable(self._path) else open(self._path, "rb")) as f:
            if os.fstat(f.fileno()).st_size < end:
                raise IntegrityError(f"{self._path} is shorter than expected; the store is corrupt")
            # Each piece is sent from a mapping of its part of the file: it goes from the page
            # cache to the socket with no copy in between. read() gave every piece a fresh
            # buffer, which the kernel zeroed and read() then filled: two passes over memory
            # per byte sent (a quarter of the push's CPU), on a host where the store and CRIU's
            # dump want that bandwidth too. One piece is mapped at a time (peak RSS stays flat):
            # its mapping goes once http.client has sent it and asks for the next.
            for at in range(self._offset, end, SEND_SIZE):
                n = min(SEND_SIZE, end - at)
                start = at - at % mmap.ALLOCATIONGRANULARITY
                piece = memoryview(mmap.mmap(f.fileno(), at - start + n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                             prot=mmap.PROT_READ, offset=start))[at - start:]
                self._sent[0] += n
                self._progress.advance(n)
                yield piece
                del piece


def _file_iter(path: "Path | Callable[[], IO[bytes]]", offset: int, length: int, progress: Progress, sent: list[int]) -> _FileBody:
    return _FileBody(path, offset, length, progress, sent)


def blob_opener(store: OciStore, digest: str) -> Callable[[], IO[bytes]]:
    """Opens a store blob wherever it is when opened. A blob committed by a store that is still
    going on waits in ingest/ (``OciStore.open_blob`` finds it there from any store object)
    until the store's publish renames it into blobs/, which may happen between two requests of
    its upload, or between open_blob's look at blobs/ and its look at ingest/: then a second
    look finds it in blobs/."""

    def open_() -> IO[bytes]:
        try:
            return store.open_blob(digest)
        except NotFoundError:
            pass
        try:
            return store.open_blob(digest)
        except NotFoundError:
            raise NotFoundError(f"blob {digest} left the store {store.root} while being pushed; store the checkpoint again") from None

    return open_


# ---- push and pull --------------------------------------------------------------------------
def _remotes_file(store: OciStore) -> Path:
    return store.root / "remotes.json"


def remember_remote(store: OciStore, digest: str, ref: RemoteRef) -> None:
    """Record that ``digest`` is in ``ref``'s repository: the source of cross-repo mounts."""
    path = _remotes_file(store)
    with store._index_lock():
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            data = {}
        repos = data.setdefault(digest, [])
        entry = f"{ref.registry}/{ref.repository}"
        if entry not in repos:
            repos.append(entry)
        store._atomic_write(path, json.dumps(data, indent=1).encode())


def _mount_sources(store: OciStore, ref: RemoteRef) -> dict[str, str]:
    """blob digest → another repository on the same registry known to hold it."""
    try:
        data = json.loads(_remotes_file(store).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    out: dict[str, str] = {}
    for manifest_digest, repos in data.items():
        others = [r.split("/", 1)[1] for r in repos if r.split("/", 1)[0] == ref.registry and r.split("/", 1)[1] != ref.repository]
        if not others or not store.has_blob(manifest_digest):
            continue
        try:
            m = store.manifest(manifest_digest)
        except GpusnapError:
            continue
        for d in [m.get("config", {}), *m.get("layers", [])]:
            if d.get("digest"):
                out.setdefault(d["digest"], others[0])
    return out


def _referrers_fallback(client: RegistryClient, repo: str, subject: Descriptor, manifest_desc: dict[str, Any]) -> None:
    """OCI 1.1 referrers tag schema for registries without the referrers API (``sha256-<hex>``)."""
    tag = subject.digest.replace(":", "-")
    try:
        data, _, _ = client.get_manifest(repo, tag)
        index = json.loads(data)
    except NotFoundError:
        index = {"schemaVersion": 2, "mediaType": MEDIA_OCI_INDEX, "manifests": []}
    index["manifests"] = [m for m in index.get("manifests", []) if m.get("digest") != manifest_desc["digest"]] + [manifest_desc]
    client.put_manifest(repo, tag, json.dumps(index, separators=(",", ":")).encode(), MEDIA_OCI_INDEX)


def put_blob(store: OciStore, client: RegistryClient, repo: str, bd: Descriptor, mount_from: str | None, prog: Progress) -> str:
    """Put the store's blob ``bd`` on ``repo`` unless it is there already: HEAD, then a
    cross-repository mount from ``mount_from`` where given, then an upload. How it got there:
    "skipped" (there already), "mounted" or "uploaded". Run in the pushing process or in a
    transfer process (gpusnap.packaging.transfer_worker)."""
    if client.blob_exists(repo, bd.digest):
        return "skipped"
    upload_url = None
    if mount_from is not None:
        mounted, upload_url = client.try_mount(repo, bd.digest, mount_from)
        if mounted:
            return "mounted"
    prog.add_total(bd.size)
    client.upload_blob(repo, bd, blob_opener(store, bd.digest), prog, upload_url)
    return "uploaded"


class _BlobSender:
    """Puts the blobs of a store on a registry repository (:func:`put_blob`), each once.
    Thread-safe; shared by :func:`push_artifact` and :class:`PipelinedPush`.

    ``processes`` > 0: the transfers run in that many transfer processes (the calling threads
    only wait for them), so that the uploads' interpreter work — a request, a mapping and a
    send per 4 MiB, on 8 streams — does not take turns on one interpreter lock with the store,
    which hashes and writes the next pages in this process meanwhile."""

    def __init__(self, store: OciStore, client: RegistryClient, target: RemoteRef, prog: Progress, *,
                 processes: int = 0, nice: int = 0) -> None:
        self.store, self.client, self.repo, self.prog = store, client, target.repository, prog
        self.mounts = _mount_sources(store, target)
        self.stats = {"uploaded": 0, "skipped": 0, "mounted": 0}
        self.on_registry: set[str] = set()  # blobs this push saw on the registry or put there
        self._lock = threading.Lock()
        self.procs: Any = None
        if processes > 0:
            try:
                self.procs = TransferProcesses(client, self.repo, {}, processes, on_bytes=prog.advance, on_total=prog.add_total,
                                               stopped=lambda: False, store=str(store.root), nice=nice)
            except OSError:  # no process to be had (fork refused): the uploads run here, slower
                self.procs = None

    def send(self, bd: Descriptor) -> None:
        with self._lock:
            if bd.digest in self.on_registry:
                return
        mount_from = self.mounts.get(bd.digest)
        how = None
        if self.procs is not None:
            try:
                how = self.procs.push(bd, mount_from)
            except WorkerDied:
                pass  # a worker killed, or none could start: this blob goes from here (an upload can start over)
        if how is None:
            how = put_blob(self.store, self.client, self.repo, bd, mount_from, self.prog)
        self._done(bd, how)

    def forget(self) -> None:
        """After a BLOB_UNKNOWN answer: ask the registry about every blob again."""
        with self._lock:
            self.on_registry.clear()

    def close(self, *, kill: bool = False) -> None:
        """End the transfer processes, if any (``kill``: now, without waiting for their blobs)."""
        if self.procs is not None:
            self.procs.close(kill=kill)

    def _done(self, bd: Descriptor, how: str) -> None:
        with self._lock:
            if bd.digest in self.on_registry:
                return
            self.on_registry.add(bd.digest)
            self.stats["skipped" if how == "mounted" else how] += bd.size
            self.stats["mounted"] += int(how == "mounted")


def push_artifact(
    store: OciStore,
    ref: str,
    remote: str,
    *,
    insecure: bool = False,
    progress: Progress | None = None,
    subject: str | None = None,
    client: RegistryClient | None = None,
    sender: "_BlobSender | None" = None,
    processes: int | None = None,
) -> PushResult:
    """``sender``: the one a :class:`PipelinedPush` used while the checkpoint was stored; the
    blobs it already put on the registry are not asked about again. ``processes``: transfer
    processes for the uploads (0: all in this process; None: chosen from the size and the
    cores, :func:`gpusnap.packaging.transfer_procs.push_processes`)."""
    started = time.monotonic()
    target = RemoteRef.parse(remote)
    if target.digest and not target.tag:
        raise UsageError(f"push needs a tag, not a digest: {remote}")
    desc = store.resolve(ref)
    manifest_bytes = store.read_bytes(desc.digest)
    manifest = json.loads(manifest_bytes)
    client = client or (sender.client if sender is not None else RegistryClient(target.registry, insecure=insecure))
    repo = target.repository
    subject_desc: Descriptor | None = None
    if subject:
        sref = RemoteRef.parse(subject)
        if sref.registry != target.registry or sref.repository != repo:
            raise UsageError(f"the subject {subject} must be in the same repository as {remote} (the referrers API is per repository)")
        sdata, smedia, sdigest = client.get_manifest(repo, sref.reference)
        subject_desc = Descriptor(smedia, sdigest, len(sdata))
        manifest["subject"] = subject_desc.to_dict()
        manifest_bytes = json.dumps(manifest, separators=(",", ":")).encode()
        with store.writing():
            new_digest = store.put_bytes(manifest_bytes)
            desc = Descriptor(desc.media_type, new_digest, len(manifest_bytes), artifact_type=desc.artifact_type)
            if not ref.startswith("sha256:"):
                store.tag(ref, desc)
    blobs: dict[str, Descriptor] = {}
    for d in [manifest["config"], *manifest.get("layers", [])]:
        bd = Descriptor.from_dict(d)
        blobs.setdefault(bd.digest, bd)
    for bd in blobs.values():
        if not store.has_blob(bd.digest):
            raise NotFoundError(f"blob {bd.digest} of {ref} is missing from the store; pull or store the checkpoint again")
    own_progress = progress is None and sender is None
    prog = sender.prog if sender is not None else (progress or default_progress(f"push {target}"))
    own_sender = sender is None
    if sender is None:
        n = processes if processes is not None else push_processes(sum(bd.size for bd in blobs.values()))
        sender = _BlobSender(store, client, target, prog, processes=n)

    try:
        _parallel(sender.send, list(blobs.values()), client.workers)
        for attempt in range(3):
            try:
                r = client.put_manifest(repo, target.tag or "latest", manifest_bytes, manifest.get("mediaType", MEDIA_OCI_MANIFEST))
                break
            except RegistryError as exc:
                # Seen under load (100 pushes sharing a blob, distribution 2.8): a blob that HEAD
                # reported, or whose PUT was acknowledged, is "unknown" to the manifest check.
                # Check every blob again, upload what is missing, and put the manifest again.
                if "BLOB_UNKNOWN" not in str(exc) or attempt == 2:
                    raise
                time.sleep(client.backoff_s * (attempt + 1))
                sender.forget()
                _parallel(sender.send, list(blobs.values()), client.workers)
        got = r.headers.get("Docker-Content-Digest")
        if got and got != desc.digest:
            raise IntegrityError(f"{target.registry} stored the manifest as {got}, expected {desc.digest}")
        if subject_desc is not None and not r.headers.get("OCI-Subject"):
            _referrers_fallback(client, repo, subject_desc, {
                "mediaType": manifest.get("mediaType", MEDIA_OCI_MANIFEST), "digest": desc.digest, "size": len(manifest_bytes),
                "artifactType": manifest.get("artifactType", manifest["config"]["mediaType"]),
                **({"annotations": manifest["annotations"]} if manifest.get("annotations") else {}),
            })
    finally:
        if own_sender:
            sender.close()
        if own_progress:
            prog.close()
    remember_remote(store, desc.digest, target)
    stats = sender.stats
    return PushResult(str(target), desc.digest, stats["uploaded"], stats["skipped"], stats["mounted"], len(blobs),
                      time.monotonic() - started)


# What PipelinedPush.finish waits for: the uploads the store's blobs started, then the blobs the
# store made last (its piece table, config) and the manifest.
FINISH_PHASES = ("the uploads still going", "the last blobs and the manifest")


class PipelinedPush:
    """``checkpoint --push`` without waiting for the whole store: each blob goes to the
    registry as soon as the store has committed it (``on_blob``), on a bounded pool of upload
    threads, while the store goes on with the next ones; :meth:`finish` then sends whatever is
    left and the manifest, last, so the registry has a tag only when every blob is there.

    A failed upload makes the next ``on_blob`` raise it, which stops the store (the checkpoint
    step list then rolls back); :meth:`cancel` waits for the uploads in flight and drops the
    rest. Blobs uploaded before a failure stay on the registry untagged (its own garbage
    collection removes them); a later push finds them with HEAD.
    """

    def __init__(self, store: OciStore, remote: str, *, insecure: bool = False, progress: Progress | None = None,
                 client: RegistryClient | None = None, nice: int = 0, processes: int | None = None) -> None:
        self.store = store
        self.remote = remote
        self.target = RemoteRef.parse(remote)
        if self.target.digest and not self.target.tag:
            raise UsageError(f"push needs a tag, not a digest: {remote}")
        client = client or RegistryClient(self.target.registry, insecure=insecure)
        self._own_progress = progress is None
        # The size is not known yet: the processes start now, while the runtime starts the
        # checkpoint, so that they are ready when the first pack is.
        n = processes if processes is not None else push_processes(None)
        self.sender = _BlobSender(store, client, self.target, progress or default_progress(f"push {self.target}"),
                                  processes=n, nice=nice)
        from gpusnap.host.priority import yielding_pool

        self._pool = yielding_pool(client.workers, "gpusnap-push", nice)
        self._futures: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False
        self.phases: dict[str, float] = {}

    def on_blob(self, desc: Descriptor) -> None:
        """The store committed ``desc`` (called on one of the store's threads): queue its upload."""
        with self._lock:
            for f in self._futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            self._futures = [f for f in self._futures if not f.done()] + [self._pool.submit(self.sender.send, desc)]

    def finish(self, ref: str, subject: str | None = None) -> Any:
        """Wait for the uploads, send what the store made last, then the manifest: the PushResult.
        How long each part took is in ``phases`` (FINISH_PHASES)."""
        try:
            t0 = time.perf_counter()
            self._wait()
            t1 = time.perf_counter()
            result = push_artifact(self.store, ref, self.remote, subject=subject, sender=self.sender)
            self.phases = {FINISH_PHASES[0]: round(t1 - t0, 3), FINISH_PHASES[1]: round(time.perf_counter() - t1, 3)}
            return result
        finally:
            self.close()

    def _wait(self) -> None:
        with self._lock:
            futures = list(self._futures)
        for f in futures:
            f.result()

    def cancel(self) -> None:
        with self._lock:
            for f in self._futures:
                f.cancel()
        self.sender.close(kill=True)  # the uploads in flight fail at once (Aborted), not after their blob
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.sender.close()
        if self._own_progress:
            self.sender.prog.close()


def _parallel(fn: Callable[[Descriptor], Any], items: list[Descriptor], workers: int) -> list[Any]:
    """Run ``fn`` over ``items`` on worker threads, biggest first; the first error cancels the rest."""
    items = sorted(items, key=lambda d: -d.size)
    results = []
    with ThreadPoolExecutor(max_workers=min(workers, max(1, len(items)))) as pool:
        futures = [pool.submit(fn, d) for d in items]
        try:
            for f in futures:
                results.append(f.result())
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return results


def check_manifest_shape(manifest: Any, remote: str) -> None:
    """Refuse what is not an image manifest before a byte of its blobs is fetched."""
    if not isinstance(manifest, dict):
        raise IntegrityError(f"manifest of {remote} is not a JSON object; refusing it")
    if manifest.get("schemaVersion") != 2:
        raise IntegrityError(f"manifest of {remote} has schemaVersion {manifest.get('schemaVersion')!r}, not 2; refusing it")
    media = manifest.get("mediaType", MEDIA_OCI_MANIFEST)
    if media not in (MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST):
        raise UsageError(f"{remote} is a {media}, not a checkpoint manifest")
    if not isinstance(manifest.get("config"), dict):
        raise IntegrityError(f"manifest of {remote} has no config descriptor; refusing it")
    layers = manifest.get("layers", [])
    if not isinstance(layers, list) or not all(isinstance(d, dict) for d in layers):
        raise IntegrityError(f"manifest of {remote} has malformed layers; refusing it")


def pull_artifact(
    store: OciStore,
    remote: str,
    *,
    insecure: bool = False,
    progress: Progress | None = None,
    client: RegistryClient | None = None,
) -> str:
    source = RemoteRef.parse(remote)
    client = client or RegistryClient(source.registry, insecure=insecure)
    repo = source.repository
    data, media, digest = client.get_manifest(repo, source.reference)
    if media in (MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST):
        raise UsageError(f"{remote} is an index of several images, not a checkpoint; pull one manifest by digest")
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):
        raise IntegrityError(f"manifest of {remote} is not JSON") from None
    check_manifest_shape(manifest, remote)
    blobs: dict[str, Descriptor] = {}
    for d in [manifest.get("config"), *manifest.get("layers", [])]:
        if d:
            bd = Descriptor.from_dict(d)
            validate_digest(bd.digest)
            blobs.setdefault(bd.digest, bd)
    own_progress = progress is None
    prog = progress or default_progress(f"pull {source}")
    prog.add_total(sum(b.size for b in blobs.values()))
    def one(bd: Descriptor) -> None:
        client.download_blob(repo, bd, store, prog)

    local_ref = str(RemoteRef(source.registry, source.repository, source.tag, None if source.tag else source.digest))
    with store.writing():
        try:
            _parallel(one, list(blobs.values()), client.workers)
            store.put_bytes(data, digest, sync=True)
            store.tag(local_ref, Descriptor(media or MEDIA_OCI_MANIFEST, digest, len(data), artifact_type=manifest.get("artifactType")))
        except BaseException:
            # Nothing half-done: what this pull downloaded is still pending in ingest/ (only
            # a tag publishes blobs), so dropping it leaves the store exactly as it was.
            store.discard_pending()
            raise
        finally:
            if own_progress:
                prog.close()
    remember_remote(store, digest, source)
    return local_ref
