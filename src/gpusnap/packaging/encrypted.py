"""Encrypted checkpoint artifacts: every layer sealed with :mod:`gpusnap.packaging.crypto`.

An encrypted artifact is the plaintext artifact with each layer descriptor replaced by its
encrypted blob (media type ``+encrypted``, the wrapped-key annotations of ocicrypt's naming).
Unlike ocicrypt's images, the config blob is sealed too: gpusnap's config carries the
container's command line, environment-derived metadata and file names, which can hold secrets.
What stays readable is the manifest's annotations (form, engine, arch, kernel, CRIU version,
container and image names): enough for ``gpusnap ls`` and for a pull to decide what it needs.

The manifest records the plaintext manifest's digest; decryption rebuilds the plaintext manifest
and must arrive at exactly that digest, which binds every decrypted layer to the original.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpusnap.errors import IntegrityError, UsageError
from gpusnap.packaging import crypto
from gpusnap.packaging.store import MEDIA_OCI_MANIFEST, Descriptor, OciStore, sha256_digest

A_PLAINTEXT_MANIFEST = "io.gpusnap.checkpoint.plaintext-manifest"
_ENC_KEYS = (crypto.ANNOTATION_PUBOPTS,)


def is_encrypted_manifest(manifest: dict[str, Any]) -> bool:
    return any(crypto.is_encrypted(str(d.get("mediaType", ""))) for d in manifest.get("layers", []))


def _strip_enc(annotations: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in annotations.items() if not k.startswith(crypto.ANNOTATION_KEYS_PREFIX) and k not in _ENC_KEYS}


def encrypt_manifest(store: OciStore, digest: str, config: crypto.EncryptionConfig) -> tuple[str, int]:
    """Encrypt every layer of manifest ``digest`` into ``store``; returns the new manifest (digest, size).

    The caller holds ``store.writing()`` until the result is tagged (gc must not take it).
    """
    manifest = store.manifest(digest)
    if is_encrypted_manifest(manifest):
        raise UsageError(f"{digest} is already encrypted; encrypt the plaintext checkpoint instead")
    if "subject" in manifest:
        raise UsageError("encrypting an artifact that already has a subject is not supported; encrypt before attaching it")
    def seal(d: Descriptor) -> dict[str, Any]:
        with store.open_blob(d.digest) as src, store.writer() as w:
            enc_digest, enc_size, blob_key = crypto.encrypt_stream(
                src, w, plaintext_digest=d.digest, plaintext_size=d.size, config=config  # type: ignore[arg-type]
            )
            w.commit(enc_digest, enc_size)
        ann = {**d.annotations, **crypto.encryption_annotations(config, blob_key)}
        return Descriptor(crypto.encrypted_media_type(d.media_type), enc_digest, enc_size, ann, d.artifact_type).to_dict()

    out = dict(manifest)
    out["config"] = seal(Descriptor.from_dict(manifest["config"]))
    out["layers"] = [seal(Descriptor.from_dict(raw)) for raw in manifest.get("layers", [])]
    out["annotations"] = {**(manifest.get("annotations") or {}), A_PLAINTEXT_MANIFEST: digest}
    data = json.dumps(out, separators=(",", ":")).encode()
    return store.put_bytes(data), len(data)


def check_keys_fit(manifest: dict[str, Any], keys: crypto.DecryptionKeys) -> None:
    """Fail before any download when none of ``keys`` can open the artifact's layers."""
    for raw in manifest.get("layers", []):
        if not crypto.is_encrypted(str(raw.get("mediaType", ""))):
            continue
        ann = raw.get("annotations") or {}
        if not keys:
            raise UsageError("this checkpoint is encrypted; pass --decrypt-key with its key file or private key")
        masters = {m.id for m in keys.masters}
        wanted = crypto.wanted_key_ids(ann)
        privates = {crypto.public_key_id(p.public_key()) for p in keys.private_keys}  # noqa: SLF001
        if not (wanted & (masters | privates)):
            raise IntegrityError(
                f"wrong key: none of the given decryption keys opens this checkpoint (it was encrypted for key ids "
                f"{', '.join(sorted(wanted)) or 'unknown'}); pass --decrypt-key with the key or private key it was encrypted for"
            )


def decrypt_into(src: OciStore, digest: str, dest: OciStore, keys: crypto.DecryptionKeys) -> str:
    """Decrypt the encrypted manifest ``digest`` of ``src`` into ``dest``; returns the plaintext manifest digest.

    ``dest`` is normally a private temporary store: plaintext never lands in the shared store.
    """
    manifest = src.manifest(digest)
    check_keys_fit(manifest, keys)
    expected = (manifest.get("annotations") or {}).get(A_PLAINTEXT_MANIFEST)

    def unseal(raw: dict[str, Any]) -> dict[str, Any]:
        d = Descriptor.from_dict(raw)
        if not crypto.is_encrypted(d.media_type):
            raise IntegrityError(f"blob {d.digest} of an encrypted checkpoint is not encrypted; the manifest was altered")
        with src.open_blob(d.digest) as fin, dest.writer() as w:
            plain_digest, plain_size = crypto.decrypt_stream(fin, w, annotations=d.annotations, keys=keys)  # type: ignore[arg-type]
            w.commit(plain_digest, plain_size)
        return Descriptor(crypto.decrypted_media_type(d.media_type), plain_digest, plain_size, _strip_enc(d.annotations), d.artifact_type).to_dict()

    out = dict(manifest)
    out["config"] = unseal(manifest["config"])
    out["layers"] = [unseal(raw) for raw in manifest.get("layers", [])]
    ann = {k: v for k, v in (manifest.get("annotations") or {}).items() if k != A_PLAINTEXT_MANIFEST}
    if ann:
        out["annotations"] = ann
    else:
        out.pop("annotations", None)
    data = json.dumps(out, separators=(",", ":")).encode()
    got = sha256_digest(data)
    if expected and got != expected:
        raise IntegrityError(f"decrypted checkpoint is {got}, expected {expected}; the encrypted manifest was altered")
    return dest.put_bytes(data, got)


def decrypt_config(store: OciStore, manifest: dict[str, Any], keys: crypto.DecryptionKeys) -> dict[str, Any]:
    """The plaintext config of an encrypted artifact, in memory (configs are small)."""
    check_keys_fit(manifest, keys)
    d = Descriptor.from_dict(manifest["config"])
    if d.size > 64 << 20:
        raise IntegrityError(f"encrypted config {d.digest} is {d.size} bytes; that is not a checkpoint config")
    import io

    out = io.BytesIO()
    with store.open_blob(d.digest) as fin:
        crypto.decrypt_stream(fin, out, annotations=d.annotations, keys=keys)  # type: ignore[arg-type]
    try:
        config = json.loads(out.getvalue())
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise IntegrityError(f"decrypted config {d.digest} is not a JSON object; the artifact is corrupt")
    return config


def config_from_annotations(manifest: dict[str, Any]) -> dict[str, Any]:
    """What an encrypted artifact shows without a key: its manifest annotations."""
    a = manifest.get("annotations") or {}
    return {
        "form": a.get("io.gpusnap.checkpoint.form", ""),
        "created": a.get("org.opencontainers.image.created", ""),
        "engine": {"name": a.get("org.criu.checkpoint.engine.name", ""), "version": a.get("org.criu.checkpoint.engine.version", "")},
        "container": {"name": a.get("org.criu.checkpoint.container.name", "")},
        "image": {"name": a.get("org.criu.checkpoint.rootfsImageName", "")},
        "criuVersion": a.get("org.criu.checkpoint.criu.version", ""),
        "kernel": a.get("org.criu.checkpoint.host.kernel", ""),
        "arch": a.get("org.criu.checkpoint.host.arch", ""),
        "encrypted": True,
    }


def encrypt_tag(store: OciStore, ref: str, config: crypto.EncryptionConfig, *, new_ref: str | None = None) -> str:
    """Encrypt the artifact tagged ``ref`` and tag the result ``new_ref`` (default: ``ref`` itself)."""
    desc = store.resolve(ref)
    with store.writing():
        digest, size = encrypt_manifest(store, desc.digest, config)
        store.tag(new_ref or ref, Descriptor(MEDIA_OCI_MANIFEST, digest, size, artifact_type=desc.artifact_type))
    return digest


@contextmanager
def decrypted_store(store: OciStore, ref: str, keys: crypto.DecryptionKeys, *, workdir: Path | None = None) -> Iterator[tuple[OciStore, str]]:
    """A private (0700) temporary store holding the decrypted artifact tagged ``ref``; removed afterwards."""
    desc = store.resolve(ref)
    tmp = Path(tempfile.mkdtemp(prefix=".gpusnap-decrypt-", dir=workdir))
    try:
        plain = OciStore(tmp)
        digest = decrypt_into(store, desc.digest, plain, keys)
        data = plain.read_bytes(digest)
        plain.tag("decrypted:latest", Descriptor(MEDIA_OCI_MANIFEST, digest, len(data), artifact_type=desc.artifact_type))
        yield plain, "decrypted:latest"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
