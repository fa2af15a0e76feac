"""Encrypted checkpoints end to end, as a user runs them: `gpusnap checkpoint --encrypt-key
--push` of a real container (runc-direct engine, real CRIU, real registry), then restore from
the registry on a clean store with a wrong key (refused before anything is downloaded), with no
key, and with the right one (the counter continues). And dedup kept within one key holder: the
same checkpoint pushed under two tenant keys and for recipients only shares no ciphertext."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

from stack.registry import Registry

from gpusnap.errors import ExitCode

pytestmark = [pytest.mark.integration, pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runc"), reason="needs root and runc")]
GPUSNAP = str(Path(sys.executable).parent / "gpusnap")
MARK = "gs-rel-secret-marker"
COUNTER = f"M={MARK}; i=0; while true; do echo $i; i=$((i+1)); sleep 0.3; done"


def _gs(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUSNAP, *args], capture_output=True, text=True, env=env, timeout=300)


def _numbers(env: dict[str, str], name: str) -> list[int]:
    out = _gs(env, "logs", name).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _wait_numbers(env: dict[str, str], name: str, n: int) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        nums = _numbers(env, name)
        if len(nums) >= n:
            return nums
        time.sleep(0.3)
    raise AssertionError(f"{name}: fewer than {n} numbers: {_numbers(env, name)}")


def test_encrypted_checkpoint_push_and_restore(tmp_path: Path, registry: Registry, ledger) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "gs"
    env = {**os.environ, "GPUSNAP_RUN_DIR": str(root / "run"), "GPUSNAP_STATE_DIR": str(root / "state"),
           "GPUSNAP_STORE": str(root / "store"), "GPUSNAP_CONFIG": str(root / "none.toml"), "COLUMNS": "100"}
    key, wrong = tmp_path / "key", tmp_path / "wrong"
    for k in (key, wrong):
        k.write_text(os.urandom(32).hex())
        k.chmod(0o600)
    name = f"gs-rel-enc-{uuid.uuid4().hex[:6]}"
    ref = f"{registry.host}/gs-rel/enc:v1"
    try:
        r = _gs(env, "run", name, "--", "sh", "-c", COUNTER)
        assert r.returncode == 0, r.stderr
        _wait_numbers(env, name, 4)
        r = _gs(env, "checkpoint", name, "--push", ref, "--insecure", "--encrypt-key", str(key))
        assert r.returncode == 0, r.stderr
        last = _numbers(env, name)[-1]
        # What reached the registry: every layer sealed, the marker nowhere in any blob.
        m = requests.get(f"http://{registry.host}/v2/gs-rel/enc/manifests/v1", headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).json()
        assert m["layers"] and all(d["mediaType"].endswith("+encrypted") for d in m["layers"])
        for d in m["layers"]:
            blob = requests.get(f"http://{registry.host}/v2/gs-rel/enc/blobs/{d['digest']}", timeout=60).content
            assert MARK.encode() not in blob
        # The local store holds ciphertext only, too.
        for blob in (root / "store" / "blobs" / "sha256").iterdir():
            assert MARK.encode() not in blob.read_bytes()
        _gs(env, "delete", name)
        shutil.rmtree(root / "store")

        r = _gs(env, "restore", ref, "--name", name, "--insecure", "--decrypt-key", str(wrong))
        assert r.returncode == ExitCode.INTEGRITY, r.stderr
        assert "wrong key" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
        blobs = root / "store" / "blobs" / "sha256"
        assert not blobs.exists() or not any(blobs.iterdir()), "a wrong key must fail before anything is downloaded"

        r = _gs(env, "restore", ref, "--name", name, "--insecure")
        assert r.returncode == ExitCode.USAGE and "--decrypt-key" in r.stderr, r.stderr

        r = _gs(env, "restore", ref, "--name", name, "--insecure", "--decrypt-key", str(key))
        assert r.returncode == 0, r.stderr
        after = _wait_numbers(env, name, 3)
        assert last + 1 in after, (last, after)
        held = True
    finally:
        _gs(env, "delete", name)
    ledger.record("crypto", "end to end: wrong key / no key refused, right key restores", tried=2, refused=2)
    ledger.record("fault", "restore with a wrong decryption key", passed=int(held), detail="refused before download")


def _layers(registry: Registry, repo: str, tag: str) -> set[str]:
    m = requests.get(f"http://{registry.host}/v2/{repo}/manifests/{tag}", headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).json()
    assert m["layers"] and all(d["mediaType"].endswith("+encrypted") for d in m["layers"])
    return {d["digest"] for d in [m["config"], *m["layers"]]}


def test_dedup_stays_within_one_key_holder(tmp_path: Path, registry: Registry, ledger) -> None:  # type: ignore[no-untyped-def]
    """One stored checkpoint pushed five ways. Under one tenant key (keyed, the default) the
    ciphertexts are equal, so dedup works; under another tenant's key, or for recipients only
    (random keys under a throwaway master), no ciphertext equals another: nobody confirms a
    chunk by having the host encrypt it again. The recipients-only copy restores with the
    recipient's private key; asking for keyed dedup without a tenant key is refused first."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import x25519

    root = tmp_path / "gs"
    env = {**os.environ, "GPUSNAP_RUN_DIR": str(root / "run"), "GPUSNAP_STATE_DIR": str(root / "state"),
           "GPUSNAP_STORE": str(root / "store"), "GPUSNAP_CONFIG": str(root / "none.toml"), "COLUMNS": "100"}
    keys = {}
    for tenant in ("a", "b"):
        keys[tenant] = tmp_path / f"{tenant}.key"
        keys[tenant].write_text(os.urandom(32).hex())
        keys[tenant].chmod(0o600)
    priv = x25519.X25519PrivateKey.generate()
    pub, priv_pem = tmp_path / "r.pub.pem", tmp_path / "r.pem"
    pub.write_bytes(priv.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    priv_pem.write_bytes(priv.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    priv_pem.chmod(0o600)
    name = f"gs-rel-ded-{uuid.uuid4().hex[:6]}"
    repo = "gs-rel/dedup"
    try:
        assert _gs(env, "run", name, "--", "sh", "-c", COUNTER).returncode == 0
        _wait_numbers(env, name, 3)
        r = _gs(env, "checkpoint", name, "--json")
        assert r.returncode == 0, r.stderr
        ref = json.loads(r.stdout)["ref"]
        last = _numbers(env, name)[-1]
        pushes = {"a1": ["--encrypt-key", str(keys["a"])], "a2": ["--encrypt-key", str(keys["a"])], "b": ["--encrypt-key", str(keys["b"])],
                  "r1": ["--recipient", str(pub)], "r2": ["--recipient", str(pub)]}
        for tag, opts in pushes.items():
            r = _gs(env, "push", ref, f"{registry.host}/{repo}:{tag}", "--insecure", *opts)
            assert r.returncode == 0, r.stderr
        assert _gs(env, "push", ref, f"{registry.host}/{repo}:plain", "--insecure").returncode == 0  # what a registry could swap in
        got = {tag: _layers(registry, repo, tag) for tag in pushes}
        assert got["a1"] == got["a2"]  # one key holder: dedup
        for x, y in (("a1", "b"), ("a1", "r1"), ("r1", "r2"), ("b", "r2")):
            assert not got[x] & got[y], (x, y)
        r = _gs(env, "push", ref, f"{registry.host}/{repo}:refused", "--insecure", "--recipient", str(pub), "--encrypt-mode", "keyed")
        assert r.returncode == ExitCode.USAGE and r.stderr.strip().count("\n") == 0 and "--encrypt-key" in r.stderr, r.stderr
        assert requests.get(f"http://{registry.host}/v2/{repo}/manifests/refused", timeout=10).status_code == 404

        _gs(env, "delete", name)
        shutil.rmtree(root / "store")
        # Expecting an encrypted checkpoint, a plain one in its place is refused before it is pulled.
        r = _gs(env, "restore", f"{registry.host}/{repo}:plain", "--name", name, "--insecure", "--decrypt-key", str(keys["a"]))
        assert r.returncode == ExitCode.INTEGRITY and "is not encrypted" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
        blobs = root / "store" / "blobs" / "sha256"
        assert not blobs.exists() or not any(blobs.iterdir())
        r = _gs(env, "restore", f"{registry.host}/{repo}:r1", "--name", name, "--insecure", "--decrypt-key", str(priv_pem))
        assert r.returncode == 0, r.stderr
        assert last + 1 in _wait_numbers(env, name, 3)
        held = True
    finally:
        _gs(env, "delete", name)
    ledger.record("crypto", "cross-tenant equality: ciphertexts of other keys / recipients-only pushes compared", tried=4, refused=4)
    ledger.record("crypto", "a plain checkpoint swapped in for an encrypted one", tried=1, refused=1)
    ledger.record("fault", "restore of a recipients-only (random keys) checkpoint", passed=int(held))
