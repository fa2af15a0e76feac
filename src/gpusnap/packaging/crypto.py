"""Encrypted checkpoint layers: streaming authenticated encryption, keyed per tenant (or random).

Conventions follow OCI image encryption (ocicrypt) where they fit: an encrypted layer keeps its
media type with ``+encrypted`` appended, its wrapped keys live in descriptor annotations named
``org.opencontainers.image.enc.keys.<scheme>`` and its cipher options in
``org.opencontainers.image.enc.pubopts`` (base64 JSON). The cipher itself is our own and the
schemes are named ``gpusnap-*``, so ocicrypt tools will not mistake these blobs for theirs.

Blob format (why hand-written: ``cryptography`` offers AEAD primitives but no streaming
container for them, and a checkpoint layer is far too large to seal in one call)::

    header  = MAGIC(8) | version(1) | segment_size(u32) | plaintext_size(u64) | wrapped_key(40)
    segment = AES-256-GCM(blob_key, nonce=u96(index), data=chunk,
                          aad=sha256(header) | u64(index) | u8(is_last))

Every segment is bound to the header (so the length and the wrapped key cannot be swapped), to
its position (reordering fails) and to whether it is the last one (truncation fails). Memory is
one segment whatever the layer size.

Keys: two modes. ``keyed`` (the default when a tenant key, ``--encrypt-key``, is given):
``blob_key = HKDF-SHA256(tenant key, info="gpusnap blob key v1" | plaintext digest)``, so the same
plaintext under the same tenant key always yields the same ciphertext and chunk dedup in the store
and in registries keeps working between that key holder's checkpoints. It is convergent only
within one key: whoever holds the key (or sees two ciphertext digests under it) learns whether
two layers are equal, but without the key nothing about the content can be confirmed, and two
tenants' equal chunks never meet. ``random``: a fresh random key per blob (the default for
recipients-only encryption, where there is no tenant secret to key dedup by); no dedup, and the
ciphertext says nothing about the content to anyone. Earlier versions keyed recipients-only
pushes by one per-host "convergence" key shared by every tenant of the host, so two tenants'
equal chunks had equal ciphertexts; those artifacts still decrypt (decryption never re-derives
a blob key, it unwraps it). Nonces are the segment index: a blob key is only ever used for one
plaintext, so a (key, nonce) pair never seals two different segments.

The header carries ``blob_key`` wrapped with RFC 3394 AES key wrap under a key derived from the
master (the tenant key, or a throwaway key for recipients-only pushes). Key wrap is deterministic (dedup again) and checks its own integrity, so a wrong master
key is detected before a single byte is written. Recipients (X25519 or RSA-OAEP public keys) get
the blob key wrapped for them in the descriptor's annotations; that wrapping is randomised, which
costs nothing for dedup because annotations live in the manifest, not in the blob.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import struct
import tempfile
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from gpusnap.errors import IntegrityError, NotFoundError, UsageError

# `cryptography` is imported where it is used, not here: this module is loaded by every push,
# pull, inspect and restore from a registry (to tell encrypted artifacts from plain ones), and
# importing `cryptography` there added 10-15 ms to a plain inspect on the VM (80 ms on its own).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import rsa, x25519

    PublicKey = x25519.X25519PublicKey | rsa.RSAPublicKey
    PrivateKey = x25519.X25519PrivateKey | rsa.RSAPrivateKey

ENCRYPTED_SUFFIX = "+encrypted"
ANNOTATION_KEYS_PREFIX = "org.opencontainers.image.enc.keys."
ANNOTATION_PUBOPTS = "org.opencontainers.image.enc.pubopts"
SCHEME_MASTER = "gpusnap-master"  # value: key ids of master keys able to unwrap the header
SCHEME_X25519 = "gpusnap-x25519"
SCHEME_RSA = "gpusnap-rsa-oaep"
CIPHER_NAME = "GPUSNAP_AES_256_GCM_SEGMENTED_V1"

MAGIC = b"GSNPENC\x00"
VERSION = 1
DEFAULT_SEGMENT_SIZE = 1 << 20
MAX_SEGMENT_SIZE = 64 << 20  # refuse headers that would make us allocate absurd buffers
_HEADER = struct.Struct(">8sBIQ40s")
HEADER_SIZE = _HEADER.size
TAG_SIZE = 16
KEY_SIZE = 32


def _hkdf(secret: bytes, info: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=KEY_SIZE, salt=None, info=info).derive(secret)


def key_id(material: bytes) -> str:
    """A short public name for a key, so errors can say which key a blob needs."""
    return hashlib.sha256(b"gpusnap key id\x00" + material).hexdigest()[:16]


# --------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class MasterKey:
    """A 256-bit symmetric key (``--encrypt-key`` / ``--decrypt-key`` file)."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_SIZE:
            raise UsageError(f"an encryption key must be {KEY_SIZE} bytes, got {len(self.secret)}")

    @property
    def id(self) -> str:
        return key_id(_hkdf(self.secret, b"gpusnap key id v1"))

    def blob_key(self, plaintext_digest: str) -> bytes:
        return _hkdf(self.secret, b"gpusnap blob key v1\x00" + plaintext_digest.encode())

    def kek(self) -> bytes:
        return _hkdf(self.secret, b"gpusnap key wrap v1")


def public_key_id(pub: PublicKey) -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import x25519

    if isinstance(pub, x25519.X25519PublicKey):
        raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    else:
        raw = pub.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key_id(raw)


MODE_KEYED = "keyed"  # blob key from the tenant's secret and the content: dedup within that secret
MODE_RANDOM = "random"  # a fresh key per blob: no dedup, nothing learnable from ciphertexts
ENCRYPTION_MODES = (MODE_KEYED, MODE_RANDOM)


@dataclass(frozen=True)
class EncryptionConfig:
    """What to encrypt with: a master key (the tenant's, or a throwaway one), optional
    recipients, and how blob keys are made (``mode``)."""

    master: MasterKey
    recipients: tuple[PublicKey, ...] = ()
    segment_size: int = DEFAULT_SEGMENT_SIZE
    mode: str = MODE_KEYED
    master_opens: bool = True  # False: ``master`` is thrown away after the push; only recipients open it

    def __post_init__(self) -> None:
        if self.mode not in ENCRYPTION_MODES:
            raise UsageError(f"encryption mode {self.mode!r} is unknown; use {' or '.join(ENCRYPTION_MODES)}")
        if not self.master_opens and not self.recipients:
            raise UsageError("nobody could decrypt this: give --encrypt-key or at least one --recipient")

    def blob_key(self, plaintext_digest: str) -> bytes:
        if self.mode == MODE_RANDOM:
            return os.urandom(KEY_SIZE)
        return self.master.blob_key(plaintext_digest)


@dataclass(frozen=True)
class DecryptionKeys:
    masters: tuple[MasterKey, ...] = ()
    private_keys: tuple[PrivateKey, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.masters or self.private_keys)


def generate_master_key_file(path: Path) -> MasterKey:
    """Write a new random key (hex text) readable only by its owner."""
    key = MasterKey(os.urandom(KEY_SIZE))
    _write_private(path, key.secret.hex().encode() + b"\n")
    return key


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _read_key_file(path: Path, what: str) -> bytes:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise NotFoundError(f"{what} {path} does not exist; give the path of an existing key file") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what} {path} is not a regular file")
    if st.st_size > 64 * 1024:
        raise UsageError(f"{what} {path} is {st.st_size} bytes, too large for a key file")
    return path.read_bytes()


def _check_private_mode(path: Path, what: str) -> None:
    # Like ssh: a secret that others can read is already compromised, so refuse to use it.
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"{what} {path} is readable by other users (mode {oct(mode & 0o777)}); run chmod 600 {path}")


def _parse_master(data: bytes, path: Path) -> MasterKey | None:
    text = data.strip()
    if len(data) == KEY_SIZE and not all(32 <= b < 127 for b in data):
        return MasterKey(data)
    with suppress(ValueError):
        raw = bytes.fromhex(text.decode("ascii"))
        if len(raw) == KEY_SIZE:
            return MasterKey(raw)
    with suppress(ValueError, UnicodeDecodeError):
        raw = base64.b64decode(text, validate=True)
        if len(raw) == KEY_SIZE:
            return MasterKey(raw)
    return None


def load_master_key(path: Path) -> MasterKey:
    """Read a symmetric key file: 32 raw bytes, 64 hex digits or base64 of 32 bytes."""
    data = _read_key_file(path, "key file")
    _check_private_mode(path, "key file")
    key = _parse_master(data, path)
    if key is None:
        raise UsageError(
            f"key file {path} does not hold a 256-bit key (32 raw bytes, 64 hex digits or base64); "
            "create one with: head -c 32 /dev/urandom | xxd -p -c 64 > KEYFILE && chmod 600 KEYFILE"
        )
    return key


def load_recipient(path: Path) -> PublicKey:
    """Read a recipient's public key (PEM; X25519 or RSA of at least 2048 bits)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa, x25519

    data = _read_key_file(path, "recipient key")
    try:
        pub = serialization.load_pem_public_key(data)
    except ValueError:
        raise UsageError(f"recipient key {path} is not a PEM public key; give an X25519 or RSA public key (openssl pkey -pubout)") from None
    if isinstance(pub, rsa.RSAPublicKey):
        if pub.key_size < 2048:
            raise UsageError(f"recipient key {path} is RSA-{pub.key_size}; use at least 2048 bits")
        return pub
    if isinstance(pub, x25519.X25519PublicKey):
        return pub
    raise UsageError(f"recipient key {path} is a {type(pub).__name__}; only X25519 and RSA keys can receive checkpoints")


def load_decryption_keys(paths: Iterable[Path]) -> DecryptionKeys:
    """Read ``--decrypt-key`` files: symmetric key files and/or PEM private keys."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa, x25519

    masters: list[MasterKey] = []
    privates: list[PrivateKey] = []
    for path in paths:
        data = _read_key_file(path, "decryption key")
        _check_private_mode(path, "decryption key")
        if b"-----BEGIN" in data:
            try:
                priv = serialization.load_pem_private_key(data, password=None)
            except (ValueError, TypeError) as exc:
                raise UsageError(f"decryption key {path} is not an unencrypted PEM private key ({exc})") from None
            if not isinstance(priv, (x25519.X25519PrivateKey, rsa.RSAPrivateKey)):
                raise UsageError(f"decryption key {path} is a {type(priv).__name__}; only X25519 and RSA keys are supported")
            privates.append(priv)
            continue
        key = _parse_master(data, path)
        if key is None:
            raise UsageError(f"decryption key {path} is neither a 256-bit key file nor a PEM private key")
        masters.append(key)
    return DecryptionKeys(tuple(masters), tuple(privates))


# --------------------------------------------------------------------------- recipient wrapping

_X25519_INFO = b"gpusnap x25519 wrap v1"


def _wrap_for(pub: PublicKey, blob_key: bytes) -> dict[str, str]:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, x25519
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if isinstance(pub, x25519.X25519PublicKey):
        eph = x25519.X25519PrivateKey.generate()
        eph_pub = eph.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        kek = _hkdf(eph.exchange(pub), _X25519_INFO + eph_pub)
        nonce = os.urandom(12)
        ct = AESGCM(kek).encrypt(nonce, blob_key, eph_pub)
        return {"kid": public_key_id(pub), "epk": _b64(eph_pub), "ct": _b64(nonce + ct)}
    ct = pub.encrypt(blob_key, padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None))
    return {"kid": public_key_id(pub), "ct": _b64(ct)}


def _unwrap_with(priv: PrivateKey, entry: dict[str, str]) -> bytes | None:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding, x25519
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    try:
        ct = base64.b64decode(entry["ct"])
        if isinstance(priv, x25519.X25519PrivateKey):
            eph_pub = base64.b64decode(entry["epk"])
            kek = _hkdf(priv.exchange(x25519.X25519PublicKey.from_public_bytes(eph_pub)), _X25519_INFO + eph_pub)
            key = AESGCM(kek).decrypt(ct[:12], ct[12:], eph_pub)
        else:
            key = priv.decrypt(ct, padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None))
    except (KeyError, ValueError, TypeError, InvalidTag):
        return None
    return key if len(key) == KEY_SIZE else None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _encode_list(entries: list[dict[str, str]]) -> str:
    return _b64(json.dumps(entries, sort_keys=True).encode())


def _decode_list(value: str) -> list[dict[str, str]]:
    try:
        data = json.loads(base64.b64decode(value, validate=True))
    except (ValueError, TypeError):
        raise IntegrityError("encryption annotation is not base64 JSON; the manifest is corrupt") from None
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise IntegrityError("encryption annotation is not a list of wrapped keys; the manifest is corrupt")
    return data


# --------------------------------------------------------------------------- streaming


@dataclass(frozen=True)
class EncryptedBlob:
    """The result of encrypting one layer: what its descriptor must say."""

    digest: str  # sha256:<hex> of the ciphertext
    size: int
    media_type: str
    annotations: dict[str, str]
    plaintext_digest: str
    plaintext_size: int


def encrypted_media_type(media_type: str) -> str:
    return media_type if media_type.endswith(ENCRYPTED_SUFFIX) else media_type + ENCRYPTED_SUFFIX


def decrypted_media_type(media_type: str) -> str:
    return media_type[: -len(ENCRYPTED_SUFFIX)] if media_type.endswith(ENCRYPTED_SUFFIX) else media_type


def is_encrypted(media_type: str) -> bool:
    return media_type.endswith(ENCRYPTED_SUFFIX)


def _aad(header_hash: bytes, index: int, last: bool) -> bytes:
    return header_hash + struct.pack(">QB", index, 1 if last else 0)


def _nonce(index: int) -> bytes:
    return b"\x00\x00\x00\x00" + struct.pack(">Q", index)


def _read_full(src: BinaryIO, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = src.read(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def encrypt_stream(
    src: BinaryIO,
    dst: BinaryIO,
    *,
    plaintext_digest: str,
    plaintext_size: int,
    config: EncryptionConfig,
) -> tuple[str, int, bytes]:
    """Encrypt ``plaintext_size`` bytes from ``src`` into ``dst``; returns (digest, size, blob key).

    The caller knows the plaintext digest already (store blobs are content-addressed); it is
    re-checked here so a blob that changed on disk is not sealed under a key meant for another.
    """
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.keywrap import aes_key_wrap

    seg = config.segment_size
    if not 0 < seg <= MAX_SEGMENT_SIZE:
        raise UsageError(f"segment size must be 1..{MAX_SEGMENT_SIZE} bytes, got {seg}")
    blob_key = config.blob_key(plaintext_digest)
    header = _HEADER.pack(MAGIC, VERSION, seg, plaintext_size, aes_key_wrap(config.master.kek(), blob_key))
    hh = hashlib.sha256(header).digest()
    aead = AESGCM(blob_key)
    out_hash = hashlib.sha256(header)
    check = hashlib.sha256()
    dst.write(header)
    written = len(header)
    remaining = plaintext_size
    index = 0
    while True:
        chunk = _read_full(src, min(seg, remaining))
        if len(chunk) != min(seg, remaining):
            raise IntegrityError(f"blob {plaintext_digest} is shorter than its recorded size {plaintext_size}; run `gpusnap verify`")
        remaining -= len(chunk)
        check.update(chunk)
        last = remaining == 0
        sealed = aead.encrypt(_nonce(index), chunk, _aad(hh, index, last))
        dst.write(sealed)
        out_hash.update(sealed)
        written += len(sealed)
        index += 1
        if last:
            break
    if src.read(1):
        raise IntegrityError(f"blob {plaintext_digest} is longer than its recorded size {plaintext_size}; run `gpusnap verify`")
    if f"sha256:{check.hexdigest()}" != plaintext_digest:
        raise IntegrityError(f"blob {plaintext_digest} does not match its digest; run `gpusnap verify`")
    return f"sha256:{out_hash.hexdigest()}", written, blob_key


def _parse_header(header: bytes) -> tuple[int, int, bytes]:
    if len(header) != HEADER_SIZE:
        raise IntegrityError("encrypted blob is truncated (no complete header)")
    magic, version, seg, size, wrapped = _HEADER.unpack(header)
    if magic != MAGIC:
        raise IntegrityError("blob is not a gpusnap encrypted layer (bad magic); the artifact is corrupt or not ours")
    if version != VERSION:
        raise IntegrityError(f"encrypted layer format version {version} is not supported (this gpusnap reads {VERSION}); upgrade gpusnap")
    if not 0 < seg <= MAX_SEGMENT_SIZE:
        raise IntegrityError(f"encrypted layer declares segment size {seg}, outside 1..{MAX_SEGMENT_SIZE}; refusing it")
    return seg, size, wrapped


def _find_blob_key(wrapped: bytes, annotations: dict[str, str], keys: DecryptionKeys) -> bytes:
    from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap

    for master in keys.masters:
        try:
            return aes_key_unwrap(master.kek(), wrapped)
        except InvalidUnwrap:
            continue
    for scheme in (SCHEME_X25519, SCHEME_RSA):
        value = annotations.get(ANNOTATION_KEYS_PREFIX + scheme)
        if not value:
            continue
        entries = _decode_list(value)
        for priv in keys.private_keys:
            kid = public_key_id(priv.public_key())
            for entry in entries:
                if entry.get("kid") == kid:
                    key = _unwrap_with(priv, entry)
                    if key is not None:
                        return key
    wanted = sorted(wanted_key_ids(annotations))
    raise IntegrityError(
        "wrong key: none of the given decryption keys opens this checkpoint"
        + (f" (it was encrypted for key ids {', '.join(wanted)})" if wanted else "")
        + "; pass --decrypt-key with the key or private key it was encrypted for"
    )


def wanted_key_ids(annotations: dict[str, str]) -> set[str]:
    ids: set[str] = set()
    master = annotations.get(ANNOTATION_KEYS_PREFIX + SCHEME_MASTER)
    if master:
        ids.update(x for x in master.split(",") if x)
    for scheme in (SCHEME_X25519, SCHEME_RSA):
        value = annotations.get(ANNOTATION_KEYS_PREFIX + scheme)
        if value:
            with suppress(IntegrityError):
                ids.update(str(e.get("kid", "?")) for e in _decode_list(value))
    return ids


def decrypt_stream(src: BinaryIO, dst: BinaryIO, *, annotations: dict[str, str], keys: DecryptionKeys) -> tuple[str, int]:
    """Decrypt and authenticate ``src`` into ``dst``; returns the plaintext's (digest, size).

    Raises :class:`IntegrityError` before writing anything when no key fits, and while writing if
    the blob was tampered with, truncated or reordered: callers must write ``dst`` to a temporary
    file and only publish it on success (:func:`decrypt_file` does).
    """
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if not keys:
        raise UsageError("this checkpoint is encrypted; pass --decrypt-key with its key file or private key")
    header = _read_full(src, HEADER_SIZE)
    seg, size, wrapped = _parse_header(header)
    blob_key = _find_blob_key(wrapped, annotations, keys)
    aead = AESGCM(blob_key)
    hh = hashlib.sha256(header).digest()
    digest = hashlib.sha256()
    remaining = size
    index = 0
    while True:
        want = min(seg, remaining)
        sealed = _read_full(src, want + TAG_SIZE)
        if len(sealed) != want + TAG_SIZE:
            raise IntegrityError("encrypted layer is truncated; pull it again")
        remaining -= want
        last = remaining == 0
        try:
            chunk = aead.decrypt(_nonce(index), sealed, _aad(hh, index, last))
        except InvalidTag:
            raise IntegrityError(
                f"encrypted layer failed authentication at segment {index}: it was altered, reordered or "
                "truncated (or the key is wrong); pull it again from a trusted source"
            ) from None
        dst.write(chunk)
        digest.update(chunk)
        index += 1
        if last:
            break
    if src.read(1):
        raise IntegrityError("encrypted layer has data after its last segment; it was altered")
    return f"sha256:{digest.hexdigest()}", size


def encryption_annotations(config: EncryptionConfig, blob_key: bytes) -> dict[str, str]:
    from cryptography.hazmat.primitives.asymmetric import rsa, x25519

    ann = {
        ANNOTATION_PUBOPTS: _b64(json.dumps({"cipher": CIPHER_NAME, "segment_size": config.segment_size, "keys": config.mode}, sort_keys=True).encode()),
    }
    if config.master_opens:
        ann[ANNOTATION_KEYS_PREFIX + SCHEME_MASTER] = config.master.id
    x = [_wrap_for(p, blob_key) for p in config.recipients if isinstance(p, x25519.X25519PublicKey)]
    r = [_wrap_for(p, blob_key) for p in config.recipients if isinstance(p, rsa.RSAPublicKey)]
    if x:
        ann[ANNOTATION_KEYS_PREFIX + SCHEME_X25519] = _encode_list(x)
    if r:
        ann[ANNOTATION_KEYS_PREFIX + SCHEME_RSA] = _encode_list(r)
    return ann


def _sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += len(chunk)
    return f"sha256:{h.hexdigest()}", n


def encrypt_file(
    src: Path,
    dst: Path,
    *,
    media_type: str,
    config: EncryptionConfig,
    plaintext_digest: str | None = None,
) -> EncryptedBlob:
    """Encrypt ``src`` into ``dst`` atomically (temp file in dst's directory, mode 0600, rename)."""
    if plaintext_digest is None:
        plaintext_digest, size = _sha256_file(src)
    else:
        size = src.stat().st_size
    with src.open("rb") as fin, _atomic_output(dst) as fout:
        digest, written, blob_key = encrypt_stream(fin, fout, plaintext_digest=plaintext_digest, plaintext_size=size, config=config)
    return EncryptedBlob(
        digest=digest,
        size=written,
        media_type=encrypted_media_type(media_type),
        annotations=encryption_annotations(config, blob_key),
        plaintext_digest=plaintext_digest,
        plaintext_size=size,
    )


def decrypt_file(src: Path, dst: Path, *, annotations: dict[str, str], keys: DecryptionKeys, expected_digest: str | None = None) -> tuple[str, int]:
    """Decrypt ``src`` into ``dst``; ``dst`` appears only if every segment authenticated."""
    with src.open("rb") as fin, _atomic_output(dst) as fout:
        digest, size = decrypt_stream(fin, fout, annotations=annotations, keys=keys)
        if expected_digest is not None and digest != expected_digest:
            raise IntegrityError(f"decrypted layer is {digest}, expected {expected_digest}; the artifact is inconsistent")
    return digest, size


class _atomic_output:
    """A 0600 temp file next to ``dst`` that replaces ``dst`` only when the block succeeds."""

    def __init__(self, dst: Path) -> None:
        self.dst = dst

    def __enter__(self) -> BinaryIO:
        fd, name = tempfile.mkstemp(prefix=".partial-", dir=self.dst.parent)
        self.tmp = Path(name)
        self.f = os.fdopen(fd, "wb")
        return self.f  # type: ignore[return-value]

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                self.f.flush()
                os.fsync(self.f.fileno())
            self.f.close()
        finally:
            if exc_type is None:
                os.replace(self.tmp, self.dst)
            else:
                with suppress(FileNotFoundError):
                    self.tmp.unlink()


def encryption_from_options(
    encrypt_key: Path | None,
    recipients: Sequence[Path],
    mode: str | None = None,
) -> EncryptionConfig | None:
    """Turn CLI options into an :class:`EncryptionConfig` (None when nothing asks for encryption).

    ``--encrypt-key`` is the tenant's secret: by default it keys the blob keys (``keyed``: dedup
    between that key's checkpoints, never with anyone else's). Recipients alone have no secret
    to key by, so their pushes get random blob keys under a throwaway master (``random``).
    """
    if encrypt_key is None and not recipients:
        if mode is not None:
            raise UsageError("--encrypt-mode needs --encrypt-key or --recipient; add one or drop --encrypt-mode")
        return None
    chosen = mode or (MODE_KEYED if encrypt_key is not None else MODE_RANDOM)
    if chosen not in ENCRYPTION_MODES:
        raise UsageError(f"--encrypt-mode {chosen!r} is unknown; use {' or '.join(ENCRYPTION_MODES)}")
    if chosen == MODE_KEYED and encrypt_key is None:
        raise UsageError("--encrypt-mode keyed needs --encrypt-key KEYFILE, the tenant's own secret that keys dedup; add it, or use --encrypt-mode random")
    pubs = tuple(load_recipient(p) for p in recipients)
    if encrypt_key is None:
        return EncryptionConfig(master=MasterKey(os.urandom(KEY_SIZE)), recipients=pubs, mode=chosen, master_opens=False)
    return EncryptionConfig(master=load_master_key(encrypt_key), recipients=pubs, mode=chosen)
