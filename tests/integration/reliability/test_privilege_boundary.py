"""The privilege boundary of gpusnap-runtime, on real runc and CRIU (docs/security.md, issue 13).

gpusnap-runtime runs as root and writes CRIU's config file from the container's annotations.
Whoever sets those annotations (on Kubernetes, possibly a pod's author) must not reach anything
the container could not reach anyway. Two boundaries are tried here:

- create: every class of CRIU option a container may not request (code, namespaces, profiles,
  host paths, cgroups, the network, anything unknown), and the other annotations that reach root
  programs, are refused with exit 2 and one line, before anything exists: config.json byte for
  byte as before, no CRIU config file, no state directory, no container known to runc.
- restore: a checkpoint taken where the admin's config adds a CRIU option does not carry it to
  a host whose config lacks it; the restoring host's config alone decides.

Both use a real CRIU plugin that records every time CRIU loads it (a plugin directory given
through ``libdir`` is how a container would have run code as root on the host before the
allow-list), so "CRIU did not get the option" is observed, not inferred.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the stack package
from stack.proc import run, unique, wait_for  # noqa: E402
from stack.shim import RUNC, Pipes, Shim, busybox_bundle  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runc") or not shutil.which("gcc"),
                       reason="needs root, the real container stack and gcc (sudo bash tests/run.sh)"),
]

TAG = "gs-rel"
# Appends to a bind-mounted host file, opened per write (an fd held on a host file is one CRIU
# cannot dump).
COUNTER = "i=0; while true; do i=$((i+1)); echo $i >> /data/count; sleep 0.2; done"

# A CRIU plugin (criu-plugin.h's cr_plugin_desc_t, version 0.2.0, no hooks) whose init appends
# the stage CRIU loads it for (0 dump, 2 restore) to MARK. Compiled by the test: there is no
# plugin on this host that says when it was loaded.
PLUGIN_C = r"""
#include <stdio.h>
typedef struct { const char *name; int (*init)(int); void (*exit)(int, int); unsigned int version;
                 unsigned int max_hooks; void *hooks[64]; } desc_t;
static int init(int stage) { FILE *f = fopen(MARK, "a"); if (f) { fprintf(f, "loaded %d\n", stage); fclose(f); } return 0; }
static void fini(int stage, int ret) { (void)stage; (void)ret; }
desc_t CR_PLUGIN_DESC = { "gs_rel_mark", init, fini, (0 << 16) + (2 << 8) + 0, 0, { 0 } };
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(plugin directory, marker file) of the recording plugin."""
    base = tmp_path_factory.mktemp("plugin")
    plugdir = base / "plugins"
    plugdir.mkdir()
    marker = base / "loaded"
    src = base / "mark.c"
    src.write_text(PLUGIN_C)
    run(["gcc", "-shared", "-fPIC", "-O1", f'-DMARK="{marker}"', "-o", str(plugdir / "gs_rel_mark.so"), str(src)])
    return plugdir, marker


def loads(marker: Path) -> list[str]:
    return marker.read_text().split("\n")[:-1] if marker.exists() else []


def host_config(path: Path, criu_options: list[str]) -> Path:
    """A gpusnap config file as an admin writes it: root-owned, 0644, in a root-owned directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"criu_options = {json.dumps(criu_options)}\n")
    path.chmod(0o644)
    return path


def _tree(*roots: Path) -> dict[str, bytes]:
    """Every file and directory under ``roots``; the compiled config.json schema under
    <run_dir>/schema is a cache every container shares (written on the first validation)."""
    out: dict[str, bytes] = {}
    for root in roots:
        if not root.exists():
            continue
        for p in sorted(root.rglob("*")):
            if "schema" in p.relative_to(root).parts[:1] and root.name == "run":
                continue
            out[str(p)] = p.read_bytes() if p.is_file() and not p.is_symlink() else b"<dir>"
    return out


# (kind, annotations, what the one line must say); "{plugdir}" and "{world}" are filled in.
CASES: list[tuple[str, dict[str, str], str]] = [
    ("libdir", {"gpusnap.io/criu-options": "libdir {plugdir}"}, "loads or runs code"),
    ("join-ns", {"gpusnap.io/criu-options": "join-ns net:/proc/1/ns/net"}, "joins a namespace"),
    ("lsm-profile", {"gpusnap.io/criu-options": "lsm-profile apparmor:unconfined"}, "changes a security profile"),
    ("ext-mount-map", {"gpusnap.io/criu-options": "ext-mount-map /:/host"}, "names a host path"),
    ("cgroup-root", {"gpusnap.io/criu-options": "cgroup-root /"}, "changes cgroups"),
    ("tls-cacert", {"gpusnap.io/criu-options": "tls-cacert /etc/shadow"}, "names a host path"),
    ("page-server", {"gpusnap.io/criu-options": "tcp-established,page-server"}, "sends data over the network"),
    ("address", {"gpusnap.io/criu-options": "address 1.2.3.4"}, "sends data over the network"),
    ("action-script", {"gpusnap.io/criu-options": "action-script /bin/true"}, "loads or runs code"),
    ("exec-cmd", {"gpusnap.io/criu-options": "exec-cmd"}, "loads or runs code"),
    ("ext-unix-sk", {"gpusnap.io/criu-options": "ext-unix-sk"}, "sockets outside the container"),
    ("unknown-option", {"gpusnap.io/criu-options": "gs-no-such-option"}, "not on the list"),
    ("smuggled-line", {"gpusnap.io/criu-options": "tcp-established\nlibdir {plugdir}"}, "malformed"),
    ("value-out-of-bounds", {"gpusnap.io/criu-options": "ghost-limit 64G"}, "at most 512M"),
    ("criu-env-ld-preload", {"gpusnap.io/criu-env": '{"LD_PRELOAD": "/tmp/gs-rel-evil.so"}'}, "only KFD_*"),
    ("criu-env-value", {"gpusnap.io/criu-env": '{"KFD_FW_VER_CHECK": "0 --libdir=/tmp"}'}, "must be numbers"),
    ("own-criu-config-world-writable", {"org.criu.config": "{world}"}, "writable by other users"),
    ("own-criu-config-missing", {"org.criu.config": "/nonexistent/gs-rel.conf"}, "cannot be read"),
    ("tcp-established-untyped", {"gpusnap.io/tcp-established": "sometimes"}, "yes/no"),
]


@pytest.fixture(scope="module")
def counts(module_ledger):  # type: ignore[no-untyped-def]
    seen: dict[str, list[int]] = {}
    yield seen
    for name, (tried, refused, unchanged) in sorted(seen.items()):
        module_ledger.record("privilege", name, tried=tried, refused=refused, passed=unchanged)


@pytest.mark.parametrize(("kind", "annotations", "expect"), CASES, ids=[c[0] for c in CASES])
def test_create_refuses_what_a_container_may_not_ask_of_root(tmp_path: Path, plugin: tuple[Path, Path], counts: dict[str, list[int]],
                                                             kind: str, annotations: dict[str, str], expect: str) -> None:
    plugdir, marker = plugin
    world = tmp_path / "world.conf"
    world.write_text(f"libdir {plugdir}\n")
    world.chmod(0o666)
    bundle = busybox_bundle(tmp_path / "c", ["sleep", "30"])
    spec = bundle.config()
    spec.setdefault("annotations", {}).update({k: v.replace("{plugdir}", str(plugdir)).replace("{world}", str(world)) for k, v in annotations.items()})
    (bundle.path / "config.json").write_text(json.dumps(spec, indent=2))
    shim = Shim.at(tmp_path / "host", unique(TAG, "rt"))
    before = _tree(bundle.path, shim.run_dir, bundle.root)
    loaded_before = loads(marker)
    cid = unique(TAG, "priv")
    tally = counts.setdefault(f"create:{kind}", [0, 0, 0])
    tally[0] += 1
    try:
        proc = run([str(shim.wrapper), "--root", str(bundle.root), "create", "--bundle", str(bundle.path), cid], check=False, env=shim.env(),
                   stdin=subprocess.DEVNULL)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1 and expect in lines[0] and "Traceback" not in proc.stderr, proc.stderr
        tally[1] += 1
        assert _tree(bundle.path, shim.run_dir, bundle.root) == before
        assert not shim.state_dir.exists()
        assert run([RUNC, "--root", str(bundle.root), "state", cid], check=False).returncode != 0
        assert loads(marker) == loaded_before  # CRIU never loaded the plugin
        tally[2] += 1
    finally:
        run([RUNC, "--root", str(bundle.root), "delete", "--force", cid], check=False)


def _counter(data: Path) -> list[int]:
    path = data / "count"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _wait_past(data: Path, value: int) -> None:
    wait_for(lambda: (_counter(data) or [0])[-1] > value + 1, f"the counter to pass {value + 1}", 30)


def test_restore_takes_criu_options_from_the_restoring_hosts_config_only(tmp_path: Path, plugin: tuple[Path, Path],
                                                                        counts: dict[str, list[int]]) -> None:
    """Host A's admin loads a CRIU plugin for every container; host B's does not. A checkpoint
    taken on A and restored on B runs CRIU without it; taken on B and restored on A, with it."""
    plugdir, marker = plugin
    config_a = host_config(tmp_path / "etc-a" / "config.toml", [f"libdir {plugdir}"])
    config_b = host_config(tmp_path / "etc-b" / "config.toml", [])
    host_a = Shim.at(tmp_path / "host-a", unique(TAG, "rt-a"), {"GPUSNAP_CONFIG": str(config_a)})
    host_b = Shim.at(tmp_path / "host-b", unique(TAG, "rt-b"), {"GPUSNAP_CONFIG": str(config_b)})
    data = tmp_path / "data"
    data.mkdir()
    bundle = busybox_bundle(tmp_path / "c", ["sh", "-c", COUNTER], data=data)
    cid = unique(TAG, "carry")
    pipes: list[Pipes] = []
    tally = counts.setdefault("restore:host-option-not-carried", [0, 0, 0])
    tally[0] += 1

    def rt(shim: Shim, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([str(shim.wrapper), "--root", str(bundle.root), *args], check=check, env=shim.env())

    def start(shim: Shim, *args: str) -> None:
        pipes.append(Pipes())
        subprocess.run([str(shim.wrapper), "--root", str(bundle.root), *args], check=True, env=shim.env(), timeout=120, **pipes[-1].kwargs())

    def conf_lines(shim: Shim) -> list[str]:
        return [ln for ln in (shim.run_dir / "criu" / f"{cid}.conf").read_text().splitlines() if not ln.startswith("#")]

    try:
        marker.unlink(missing_ok=True)
        start(host_a, "run", "-d", "--bundle", str(bundle.path), cid)
        assert f"libdir {plugdir}" in conf_lines(host_a)
        _wait_past(data, 2)
        rt(host_a, "checkpoint", "--image-path", str(tmp_path / "images-a"), cid)
        assert loads(marker) == ["loaded 0"]  # A's admin option is in force on A
        # The bundle the engine hands back at restore is the one A's runtime rewrote.
        carried = bundle.config()["annotations"]
        assert carried["org.criu.config"] == str(host_a.run_dir / "criu" / f"{cid}.conf")
        at_checkpoint = _counter(data)[-1]

        start(host_b, "restore", "-d", "--bundle", str(bundle.path), "--image-path", str(tmp_path / "images-a"), cid)
        _wait_past(data, at_checkpoint)
        assert _counter(data) == list(range(1, len(_counter(data)) + 1))  # resumed, not restarted
        assert loads(marker) == ["loaded 0"]  # CRIU on B never loaded A's plugin
        assert conf_lines(host_b) == ["link-remap"]
        assert bundle.config()["annotations"]["org.criu.config"] == str(host_b.run_dir / "criu" / f"{cid}.conf")
        tally[1] += 1

        # The other way round: B's checkpoint restored on A gets A's option, from A.
        rt(host_b, "checkpoint", "--image-path", str(tmp_path / "images-b"), cid)
        assert loads(marker) == ["loaded 0"]
        at_checkpoint = _counter(data)[-1]
        start(host_a, "restore", "-d", "--bundle", str(bundle.path), "--image-path", str(tmp_path / "images-b"), cid)
        _wait_past(data, at_checkpoint)
        assert loads(marker) == ["loaded 0", "loaded 2"]
        tally[2] += 1
    finally:
        run([RUNC, "--root", str(bundle.root), "delete", "--force", cid], check=False)
        for p in pipes:
            p.close()


def test_restore_refuses_a_checkpoint_whose_spec_asks_for_more(tmp_path: Path, plugin: tuple[Path, Path], counts: dict[str, list[int]]) -> None:
    """A checkpoint's config.json (from a registry, say) asking for a refused option: the restore
    is refused with exit 2, before CRIU runs; nothing is restored and the images stay as they were."""
    plugdir, marker = plugin
    host = Shim.at(tmp_path / "host", unique(TAG, "rt"))
    data = tmp_path / "data"
    data.mkdir()
    bundle = busybox_bundle(tmp_path / "c", ["sh", "-c", COUNTER], data=data)
    cid = unique(TAG, "crafted")
    pipes = Pipes()
    tally = counts.setdefault("restore:crafted-checkpoint-spec", [0, 0, 0])
    tally[0] += 1
    try:
        subprocess.run([str(host.wrapper), "--root", str(bundle.root), "run", "-d", "--bundle", str(bundle.path), cid], check=True,
                       env=host.env(), timeout=120, **pipes.kwargs())
        _wait_past(data, 2)
        images = tmp_path / "images"
        run([str(host.wrapper), "--root", str(bundle.root), "checkpoint", "--image-path", str(images), cid], env=host.env())
        spec = bundle.config()
        spec["annotations"]["gpusnap.io/criu-options"] = f"libdir {plugdir}"
        (bundle.path / "config.json").write_text(json.dumps(spec))
        before = _tree(bundle.path, images, host.run_dir / "criu")
        loaded_before = loads(marker)
        proc = run([str(host.wrapper), "--root", str(bundle.root), "restore", "-d", "--bundle", str(bundle.path), "--image-path", str(images), cid],
                   check=False, env=host.env(), stdin=subprocess.DEVNULL)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "loads or runs code" in proc.stderr, proc.stderr
        tally[1] += 1
        assert _tree(bundle.path, images, host.run_dir / "criu") == before
        assert run([RUNC, "--root", str(bundle.root), "state", cid], check=False).returncode != 0
        assert loads(marker) == loaded_before
        tally[2] += 1
    finally:
        run([RUNC, "--root", str(bundle.root), "delete", "--force", cid], check=False)
        pipes.close()
