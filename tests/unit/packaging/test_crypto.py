"""Encrypted layers: round trips, dedup between checkpoints, recipients, wrong keys, key files."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa, x25519

from gpusnap.errors import IntegrityError, UsageError
from gpusnap.packaging import crypto

MT = "application/vnd.gpusnap.checkpoint.layer.v1.tar"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _cfg(master: crypto.MasterKey, *recipients: crypto.PublicKey, seg: int = 4096) -> crypto.EncryptionConfig:
    return crypto.EncryptionConfig(master=master, recipients=tuple(recipients), segment_size=seg)


def _encrypt(data: bytes, cfg: crypto.EncryptionConfig) -> tuple[bytes, dict[str, str]]:
    out = io.BytesIO()
    digest, size, key = crypto.encrypt_stream(io.BytesIO(data), out, plaintext_digest=_digest(data), plaintext_size=len(data), config=cfg)
    blob = out.getvalue()
    assert digest == _digest(blob) and size == len(blob)
    return blob, crypto.encryption_annotations(cfg, key)


def _decrypt(blob: bytes, ann: dict[str, str], keys: crypto.DecryptionKeys) -> bytes:
    out = io.BytesIO()
    digest, size = crypto.decrypt_stream(io.BytesIO(blob), out, annotations=ann, keys=keys)
    assert digest == _digest(out.getvalue()) and size == len(out.getvalue())
    return out.getvalue()


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096, 100_000])
def test_round_trip_every_size(size: int) -> None:
    master = crypto.MasterKey(os.urandom(32))
    data = os.urandom(size)
    blob, ann = _encrypt(data, _cfg(master))
    assert size < 16 or data not in blob
    assert _decrypt(blob, ann, crypto.DecryptionKeys(masters=(master,))) == data


def test_same_key_same_plaintext_gives_same_blob_so_dedup_works() -> None:
    master = crypto.MasterKey(os.urandom(32))
    data = os.urandom(20_000)
    a, _ = _encrypt(data, _cfg(master))
    b, _ = _encrypt(data, _cfg(master))
    assert a == b
    other, _ = _encrypt(data, _cfg(crypto.MasterKey(os.urandom(32))))
    assert other != a
    changed, _ = _encrypt(data[:-1] + b"\x00", _cfg(master))
    assert changed[crypto.HEADER_SIZE :] != a[crypto.HEADER_SIZE :]


def test_wrong_master_key_is_one_clear_error_and_writes_nothing(tmp_path: Path) -> None:
    master = crypto.MasterKey(os.urandom(32))
    src = tmp_path / "layer"
    src.write_bytes(os.urandom(10_000))
    enc = crypto.encrypt_file(src, tmp_path / "enc", media_type=MT, config=_cfg(master))
    wrong = crypto.MasterKey(os.urandom(32))
    with pytest.raises(IntegrityError, match="wrong key.*--decrypt-key") as err:
        crypto.decrypt_file(tmp_path / "enc", tmp_path / "out", annotations=enc.annotations, keys=crypto.DecryptionKeys(masters=(wrong,)))
    assert master.id in str(err.value)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["enc", "layer"]


def test_no_key_given_for_encrypted_layer_is_usage_error(tmp_path: Path) -> None:
    blob, ann = _encrypt(b"x" * 10, _cfg(crypto.MasterKey(os.urandom(32))))
    with pytest.raises(UsageError, match="--decrypt-key"):
        _decrypt(blob, ann, crypto.DecryptionKeys())


def test_file_api_sets_descriptor_fields(tmp_path: Path) -> None:
    master = crypto.MasterKey(os.urandom(32))
    src = tmp_path / "layer"
    src.write_bytes(b"hello" * 1000)
    enc = crypto.encrypt_file(src, tmp_path / "enc", media_type=MT, config=_cfg(master))
    assert enc.media_type == MT + "+encrypted" and crypto.is_encrypted(enc.media_type)
    assert crypto.decrypted_media_type(enc.media_type) == MT
    assert enc.plaintext_digest == _digest(src.read_bytes())
    assert enc.digest == _digest((tmp_path / "enc").read_bytes())
    assert enc.annotations[crypto.ANNOTATION_KEYS_PREFIX + crypto.SCHEME_MASTER] == master.id
    assert crypto.ANNOTATION_PUBOPTS in enc.annotations
    assert (tmp_path / "enc").stat().st_mode & 0o077 == 0
    digest, _ = crypto.decrypt_file(tmp_path / "enc", tmp_path / "out", annotations=enc.annotations, keys=crypto.DecryptionKeys(masters=(master,)), expected_digest=enc.plaintext_digest)
    assert (tmp_path / "out").read_bytes() == src.read_bytes()


def test_plaintext_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    master = crypto.MasterKey(os.urandom(32))
    with pytest.raises(IntegrityError, match="does not match its digest"):
        crypto.encrypt_stream(io.BytesIO(b"abc"), io.BytesIO(), plaintext_digest=_digest(b"abd"), plaintext_size=3, config=_cfg(master))
    with pytest.raises(IntegrityError, match="shorter"):
        crypto.encrypt_stream(io.BytesIO(b"ab"), io.BytesIO(), plaintext_digest=_digest(b"abc"), plaintext_size=3, config=_cfg(master))


@pytest.mark.parametrize("kind", ["x25519", "rsa"])
def test_recipient_opens_with_private_key_only(kind: str) -> None:
    priv = x25519.X25519PrivateKey.generate() if kind == "x25519" else rsa.generate_private_key(public_exponent=65537, key_size=2048)
    other = x25519.X25519PrivateKey.generate()
    master = crypto.MasterKey(os.urandom(32))
    data = os.urandom(9000)
    blob, ann = _encrypt(data, _cfg(master, priv.public_key(), other.public_key()))
    assert _decrypt(blob, ann, crypto.DecryptionKeys(private_keys=(priv,))) == data
    stranger = x25519.X25519PrivateKey.generate()
    with pytest.raises(IntegrityError, match="wrong key"):
        _decrypt(blob, ann, crypto.DecryptionKeys(private_keys=(stranger,)))
    # Recipient wrapping is randomised but the blob is not: dedup holds with recipients too.
    again, ann2 = _encrypt(data, _cfg(master, priv.public_key()))
    assert again == blob and ann2 != ann


def test_key_files(tmp_path: Path) -> None:
    path = tmp_path / "k"
    key = crypto.generate_master_key_file(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert crypto.load_master_key(path) == key
    raw = tmp_path / "raw"
    raw.write_bytes(key.secret)
    raw.chmod(0o600)
    assert crypto.load_master_key(raw) == key
    path.chmod(0o644)
    with pytest.raises(UsageError, match="chmod 600"):
        crypto.load_master_key(path)
    short = tmp_path / "short"
    short.write_text("abcd")
    short.chmod(0o600)
    with pytest.raises(UsageError, match="256-bit"):
        crypto.load_master_key(short)
    priv = x25519.X25519PrivateKey.generate()
    pem_pub = tmp_path / "pub.pem"
    pem_pub.write_bytes(priv.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    assert isinstance(crypto.load_recipient(pem_pub), x25519.X25519PublicKey)
    pem_priv = tmp_path / "priv.pem"
    pem_priv.write_bytes(priv.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    pem_priv.chmod(0o600)
    keys = crypto.load_decryption_keys([pem_priv, raw])
    assert len(keys.private_keys) == 1 and keys.masters == (key,)
    with pytest.raises(UsageError, match="not a PEM public key"):
        crypto.load_recipient(short)
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    weak_pub = tmp_path / "weak.pem"
    weak_pub.write_bytes(weak.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(UsageError, match="2048"):
        crypto.load_recipient(weak_pub)


def test_options_without_key_use_a_private_host_convergence_key(tmp_path: Path) -> None:
    priv = x25519.X25519PrivateKey.generate()
    pub = tmp_path / "pub.pem"
    pub.write_bytes(priv.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    conv = tmp_path / "state" / "convergence.key"
    a = crypto.encryption_from_options(None, [pub], conv)
    b = crypto.encryption_from_options(None, [pub], conv)
    assert a is not None and b is not None and a.master == b.master
    assert conv.stat().st_mode & 0o777 == 0o600
    assert crypto.encryption_from_options(None, [], conv) is None
