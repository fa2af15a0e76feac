"""Encrypted checkpoints in the store: sealed layers, dedup between checkpoints, wrong keys."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import x25519

from gpusnap.errors import IntegrityError, UsageError
from gpusnap.packaging import api, crypto
from gpusnap.packaging.encrypted import A_PLAINTEXT_MANIFEST
from gpusnap.packaging.store import OciStore
from gpusnap.packaging.verify import verify_store


def _criu_dir(root: Path, pages: bytes, seed: bytes = b"") -> Path:
    root.mkdir(parents=True)
    (root / "inventory.img").write_bytes(b"inventory" + seed)
    (root / "core-1.img").write_bytes(b"core" + seed)
    (root / "pages-1.img").write_bytes(pages)
    return root


@pytest.fixture
def key() -> crypto.EncryptionConfig:
    return crypto.EncryptionConfig(master=crypto.MasterKey(os.urandom(32)))


def test_every_layer_sealed_and_round_trip(tmp_path: Path, key: crypto.EncryptionConfig) -> None:
    pages = os.urandom(3 << 20)
    src = _criu_dir(tmp_path / "ck", pages)
    store_dir = tmp_path / "store"
    api.store_checkpoint(store_dir, src, form="criu-dir", ref="gs-rel-enc:1", encryption=key)
    store = OciStore(store_dir)
    m = store.manifest(store.resolve("gs-rel-enc:1").digest)
    assert m["layers"] and all(d["mediaType"].endswith("+encrypted") for d in m["layers"])
    assert m["annotations"][A_PLAINTEXT_MANIFEST].startswith("sha256:")
    # No plaintext left at rest: not the pages, not the small CRIU files.
    needle = pages[1 << 20 : (1 << 20) + 64]
    for blob in store.blobs_dir.iterdir():
        data = blob.read_bytes()
        assert needle not in data and b"inventory" not in data
    assert verify_store(store).ok
    out = api.materialize_checkpoint(store_dir, "gs-rel-enc:1", tmp_path / "out", form="criu-dir", decryption=crypto.DecryptionKeys(masters=(key.master,)))
    assert (out / "pages-1.img").read_bytes() == pages
    assert (out / "inventory.img").read_bytes() == b"inventory"
    assert not list(tmp_path.glob(".gpusnap-decrypt-*"))  # the private plaintext store is gone
    assert m["config"]["mediaType"].endswith("+encrypted"), "the config holds command lines: sealed too"
    info = api.inspect(store_dir, "gs-rel-enc:1")  # without a key: what the annotations say
    assert info.form == "criu-dir" and info.sizes == {}
    full = api.inspect(store_dir, "gs-rel-enc:1", decryption=crypto.DecryptionKeys(masters=(key.master,)))
    assert full.form == "criu-dir" and full.sizes["pages"] == len(pages)


def test_wrong_or_missing_key_writes_nothing(tmp_path: Path, key: crypto.EncryptionConfig) -> None:
    src = _criu_dir(tmp_path / "ck", os.urandom(1 << 20))
    api.store_checkpoint(tmp_path / "store", src, form="criu-dir", ref="gs-rel-enc:1", encryption=key)
    wrong = crypto.DecryptionKeys(masters=(crypto.MasterKey(os.urandom(32)),))
    with pytest.raises(IntegrityError, match="wrong key"):
        api.materialize_checkpoint(tmp_path / "store", "gs-rel-enc:1", tmp_path / "out", form="criu-dir", decryption=wrong)
    with pytest.raises(UsageError, match="--decrypt-key"):
        api.materialize_checkpoint(tmp_path / "store", "gs-rel-enc:1", tmp_path / "out", form="criu-dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "store"]


def test_dedup_between_checkpoints_with_the_same_key(tmp_path: Path, key: crypto.EncryptionConfig) -> None:
    pages = os.urandom(2 << 20)
    a = _criu_dir(tmp_path / "a", pages, b"1")
    b = _criu_dir(tmp_path / "b", pages, b"2")  # same memory, other small CRIU files
    (a / "pages-2.img").write_bytes(os.urandom(1 << 20))
    (b / "pages-2.img").write_bytes(os.urandom(1 << 20))
    store_dir = tmp_path / "store"
    api.store_checkpoint(store_dir, a, form="criu-dir", ref="gs-rel-enc:a", encryption=key)
    api.store_checkpoint(store_dir, b, form="criu-dir", ref="gs-rel-enc:b", encryption=key)
    store = OciStore(store_dir)
    la = {d["digest"] for d in store.manifest(store.resolve("gs-rel-enc:a").digest)["layers"]}
    lb = {d["digest"] for d in store.manifest(store.resolve("gs-rel-enc:b").digest)["layers"]}
    assert la & lb, "unchanged memory chunks must encrypt to the same blobs"
    assert la != lb
    other = crypto.EncryptionConfig(master=crypto.MasterKey(os.urandom(32)))
    api.store_checkpoint(store_dir, a, form="criu-dir", ref="gs-rel-enc:other", encryption=other)
    lo = {d["digest"] for d in store.manifest(store.resolve("gs-rel-enc:other").digest)["layers"]}
    assert not (lo & la), "another key must give unrelated blobs"


def test_recipient_private_key_opens_it(tmp_path: Path) -> None:
    priv = x25519.X25519PrivateKey.generate()
    cfg = crypto.EncryptionConfig(master=crypto.MasterKey(os.urandom(32)), recipients=(priv.public_key(),))
    pages = os.urandom(1 << 20)
    api.store_checkpoint(tmp_path / "store", _criu_dir(tmp_path / "ck", pages), form="criu-dir", ref="gs-rel-enc:r", encryption=cfg)
    out = api.materialize_checkpoint(tmp_path / "store", "gs-rel-enc:r", tmp_path / "out", form="criu-dir", decryption=crypto.DecryptionKeys(private_keys=(priv,)))
    assert (out / "pages-1.img").read_bytes() == pages


def test_tampered_manifest_detected(tmp_path: Path, key: crypto.EncryptionConfig) -> None:
    """Swapping two encrypted layers' descriptors passes AEAD per layer but not the manifest binding."""
    import json

    from gpusnap.packaging.store import MEDIA_OCI_MANIFEST, Descriptor

    pages = os.urandom(1 << 20)
    store_dir = tmp_path / "store"
    api.store_checkpoint(store_dir, _criu_dir(tmp_path / "ck", pages), form="criu-dir", ref="gs-rel-enc:t", encryption=key)
    store = OciStore(store_dir)
    m = store.manifest(store.resolve("gs-rel-enc:t").digest)
    m["layers"][-1]["annotations"]["io.gpusnap.checkpoint.file"] = "checkpoint/evil.img"
    data = json.dumps(m, separators=(",", ":")).encode()
    store.tag("gs-rel-enc:t", Descriptor(MEDIA_OCI_MANIFEST, store.put_bytes(data), len(data)))
    with pytest.raises(IntegrityError, match="altered"):
        api.materialize_checkpoint(store_dir, "gs-rel-enc:t", tmp_path / "out", form="criu-dir", decryption=crypto.DecryptionKeys(masters=(key.master,)))
    assert not (tmp_path / "out").exists()
