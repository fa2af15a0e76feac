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
    changed, _ = _encrypt(data[:-1] + bytes([data[-1] ^ 0xFF]), _cfg(master))  # always a different last byte
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


def _pub_file(tmp_path: Path, name: str = "pub.pem") -> tuple[Path, x25519.X25519PrivateKey]:
    priv = x25519.X25519PrivateKey.generate()
    pub = tmp_path / name
    pub.write_bytes(priv.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return pub, priv


def test_recipients_only_get_random_keys_under_a_throwaway_master(tmp_path: Path) -> None:
    """No host-wide convergence key: with no tenant secret, nothing keys dedup, so nobody can
    confirm a guessed chunk by encrypting it through the same host."""
    pub, priv = _pub_file(tmp_path)
    a = crypto.encryption_from_options(None, [pub])
    b = crypto.encryption_from_options(None, [pub])
    assert a is not None and b is not None and a.mode == b.mode == crypto.MODE_RANDOM and a.master != b.master
    data = os.urandom(10_000)
    blob_a, ann_a = _encrypt(data, a)
    blob_b, _ = _encrypt(data, b)
    assert blob_a != blob_b
    assert crypto.ANNOTATION_KEYS_PREFIX + crypto.SCHEME_MASTER not in ann_a  # the throwaway master opens nothing
    assert _decrypt(blob_a, ann_a, crypto.DecryptionKeys(private_keys=(priv,))) == data
    assert not list(tmp_path.glob("**/*.key"))  # nothing written for it
    assert crypto.encryption_from_options(None, []) is None


def test_keyed_mode_dedups_within_one_tenant_key_only(tmp_path: Path) -> None:
    tenant_a, tenant_b = tmp_path / "a.key", tmp_path / "b.key"
    crypto.generate_master_key_file(tenant_a)
    crypto.generate_master_key_file(tenant_b)
    data = os.urandom(10_000)
    a1 = crypto.encryption_from_options(tenant_a, [])
    assert a1 is not None and a1.mode == crypto.MODE_KEYED
    same = _encrypt(data, a1)[0] == _encrypt(data, crypto.encryption_from_options(tenant_a, []))[0]  # type: ignore[arg-type]
    across = _encrypt(data, a1)[0] == _encrypt(data, crypto.encryption_from_options(tenant_b, []))[0]  # type: ignore[arg-type]
    assert same and not across
    # random with a tenant key: no dedup even for the key holder, and the key still opens it
    r = crypto.encryption_from_options(tenant_a, [], "random")
    assert r is not None and r.mode == crypto.MODE_RANDOM
    blob, ann = _encrypt(data, r)
    assert blob != _encrypt(data, r)[0]
    assert _decrypt(blob, ann, crypto.DecryptionKeys(masters=(a1.master,))) == data


def test_mode_options_refused_with_one_line(tmp_path: Path) -> None:
    pub, _ = _pub_file(tmp_path)
    with pytest.raises(UsageError, match="keyed needs --encrypt-key"):
        crypto.encryption_from_options(None, [pub], "keyed")
    with pytest.raises(UsageError, match="unknown"):
        crypto.encryption_from_options(None, [pub], "convergent")
    with pytest.raises(UsageError, match="needs --encrypt-key or --recipient"):
        crypto.encryption_from_options(None, [], "random")


def test_blobs_of_the_v1_code_still_decrypt() -> None:
    """Blobs written by the encryption code before keyed/random modes (data/v1-encrypted-blobs.json,
    made by that code): one under a master key, one for an X25519 recipient under the old
    per-host convergence key."""
    import base64
    import json

    doc = json.loads((Path(__file__).parent / "data" / "v1-encrypted-blobs.json").read_text())
    plain = base64.b64decode(doc["plaintext_b64"])
    master = crypto.MasterKey(bytes.fromhex(doc["master_key_hex"]))
    priv = serialization.load_pem_private_key(doc["x25519_private_pem"].encode(), password=None)
    for name, keys in (("master", crypto.DecryptionKeys(masters=(master,))), ("recipient", crypto.DecryptionKeys(private_keys=(priv,)))):  # type: ignore[arg-type]
        blob = base64.b64decode(doc[name]["blob_b64"])
        assert _digest(blob) == doc[name]["digest"]
        assert _decrypt(blob, doc[name]["annotations"], keys) == plain
