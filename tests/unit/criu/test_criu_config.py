from __future__ import annotations

from pathlib import Path

import os

import pytest

from gpusnap.config import check_admin_file
from gpusnap.criu.config import (
    CONTAINER_OPTIONS,
    check_annotations,
    check_user_criu_config,
    criu_config_path,
    host_options,
    options_from_annotations,
    render_config,
    write_config,
)
from gpusnap.errors import ExitCode, UsageError


def test_options() -> None:
    assert options_from_annotations({}) == ["link-remap"]
    assert options_from_annotations({"gpusnap.io/tcp-established": "true"}) == ["link-remap", "tcp-established"]
    assert options_from_annotations({"gpusnap.io/tcp-established": "no"}) == ["link-remap"]
    assert options_from_annotations({"gpusnap.io/criu-options": "--tcp-close, file-locks,link-remap"}) == ["link-remap", "tcp-close", "file-locks"]


def test_typed_values_are_normalised() -> None:
    got = options_from_annotations({"gpusnap.io/criu-options": "ghost-limit=2M,timeout 30,network-lock=nftables"})
    assert got == ["link-remap", f"ghost-limit {2 << 20}", "timeout 30", "network-lock nftables"]


# One example of each class of option that would let a container's annotations steer root CRIU
# (issue 13): code loading, namespaces, profiles, mount and cgroup rewiring, host files, network.
REFUSED = [
    ("libdir /tmp/evil", "loads or runs code"),
    ("action-script /tmp/x", "loads or runs code"),
    ("exec-cmd", "loads or runs code"),
    ("join-ns net:/proc/1/ns/net", "joins a namespace"),
    ("lsm-profile apparmor:unconfined", "changes a security profile"),
    ("ext-mount-map /:/host", "names a host path"),
    ("cgroup-root /", "changes cgroups"),
    ("tls-cacert /etc/shadow", "names a host path"),
    ("page-server", "sends data over the network"),
    ("address 1.2.3.4", "sends data over the network"),
    ("ext-unix-sk", "reaches sockets outside the container"),
    ("log-file=/etc/passwd", "names a host path"),
    ("no-such-option", "not on the list"),
]


@pytest.mark.parametrize(("option", "why"), REFUSED)
def test_refused_options_say_why_in_one_line(option: str, why: str) -> None:
    with pytest.raises(UsageError) as err:
        options_from_annotations({"gpusnap.io/criu-options": f"tcp-established,{option}"})
    assert err.value.exit_code == ExitCode.USAGE
    assert why in str(err.value) and "\n" not in str(err.value) and "criu_options" in str(err.value)


@pytest.mark.parametrize("value", ["ghost-limit", "ghost-limit 1T", "ghost-limit 513M", "ghost-limit -1", "timeout 0", "timeout 601",
                                   "timeout x", "network-lock none", "tcp-established=1", "file-locks yes", "a  b", "x\nlibdir /tmp"])
def test_bad_values_refused(value: str) -> None:
    with pytest.raises(UsageError):
        options_from_annotations({"gpusnap.io/criu-options": value})


def test_bool_annotations_are_typed() -> None:
    with pytest.raises(UsageError, match="yes/no"):
        options_from_annotations({"gpusnap.io/tcp-established": "maybe"})
    with pytest.raises(UsageError, match="amd-relaxed-checks"):
        check_annotations({"gpusnap.io/amd-relaxed-checks": "definitely"})


@pytest.mark.parametrize("env", ['{"LD_PRELOAD":"/tmp/x.so"}', '{"KFD_FW_VER_CHECK":"0; rm -rf /"}', '{"PATH":"/tmp"}', "[1]", "nope"])
def test_criu_env_annotation_typed(env: str) -> None:
    with pytest.raises(UsageError, match="criu-env"):
        check_annotations({"gpusnap.io/criu-env": env})
    check_annotations({"gpusnap.io/criu-env": '{"KFD_FW_VER_CHECK":"0","KFD_NUMA_CHECK":"1"}'})


def test_managed_marker_only_true() -> None:
    with pytest.raises(UsageError, match="criu-config"):
        check_annotations({"gpusnap.io/criu-config": "false"})


def _admin_file(path: Path, text: str, mode: int = 0o644) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_host_options_from_config_and_admin_criu_config(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc" / "criu").mkdir(parents=True)
    root.chmod(0o755)
    assert host_options((), root) == []
    _admin_file(root / "etc" / "criu" / "runc.conf", "# the admin's\nghost-limit 8M\n\n--ext-unix-sk\n")
    assert host_options(("libdir /opt/criu/plugins", "ext-mount-map=auto"), root) == [
        "ghost-limit 8M", "ext-unix-sk", "libdir /opt/criu/plugins", "ext-mount-map auto"]
    # runc's own options: not even the admin may take them from runc
    with pytest.raises(UsageError, match="images-dir"):
        host_options(("images-dir /tmp",), root)


def test_amd_containers_get_the_hosts_plugin_dir(tmp_path: Path) -> None:
    plugdir = tmp_path / "usr" / "lib" / "criu"
    plugdir.mkdir(parents=True)
    (plugdir / "amdgpu_plugin.so").write_bytes(b"")
    assert host_options((), tmp_path, gpu_vendor="amd") == [f"libdir {plugdir}"]
    assert host_options((), tmp_path, gpu_vendor="nvidia") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks need root to create files owned by others")
def test_admin_files_must_be_root_owned_and_not_writable_by_others(tmp_path: Path) -> None:
    conf = _admin_file(tmp_path / "runc.conf", "tcp-close\n")
    check_admin_file(conf, "x")
    conf.chmod(0o664)
    with pytest.raises(UsageError, match="chmod go-w"):
        check_admin_file(conf, "x")
    conf.chmod(0o644)
    os.chown(conf, 65534, 65534)
    with pytest.raises(UsageError, match="not root"):
        check_admin_file(conf, "x")
    os.chown(conf, 0, 0)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UsageError, match="directory other users can write"):
        check_admin_file(_admin_file(shared / "c.conf", ""), "x")
    with pytest.raises(UsageError, match="cannot be read"):
        check_user_criu_config(str(tmp_path / "missing.conf"))
    with pytest.raises(UsageError, match="absolute"):
        check_user_criu_config("relative.conf")
    check_user_criu_config(str(conf))


def test_allow_list_is_small_and_pathless() -> None:
    # A reviewer's guard: nothing on the container allow-list takes a path, a program or an address.
    assert set(CONTAINER_OPTIONS) == {"link-remap", "tcp-established", "tcp-close", "tcp-skip-in-flight", "skip-in-flight",
                                      "file-locks", "ghost-limit", "network-lock", "timeout"}


def test_write(tmp_path: Path) -> None:
    path = criu_config_path(tmp_path / "run", "c1")
    write_config(path, ["link-remap", "tcp-established"])
    assert path == tmp_path / "run" / "criu" / "c1.conf"
    assert path.read_text() == render_config(["link-remap", "tcp-established"])
    assert [ln for ln in path.read_text().splitlines() if not ln.startswith("#")] == ["link-remap", "tcp-established"]
    assert [p.name for p in path.parent.iterdir()] == ["c1.conf"]


def test_network_lock_option_needs_criu_42() -> None:
    from gpusnap.criu.config import takes_network_lock_option

    assert not takes_network_lock_option((4, 1, 1))  # segfaults on it in runc's RPC mode
    assert takes_network_lock_option((4, 2, 0))
    assert takes_network_lock_option((5, 0, 0))


def test_network_lock_skip_annotation_round_trip() -> None:
    from gpusnap.criu.config import skips_network_lock, with_network_lock_skip

    ann = {"gpusnap.io/criu-options": "file-locks,network-lock iptables"}
    with_network_lock_skip(ann, True)
    assert ann["gpusnap.io/criu-options"] == "file-locks,network-lock skip"  # one lock method, ours
    assert skips_network_lock(ann)
    assert options_from_annotations(ann) == ["link-remap", "file-locks", "network-lock skip"]
    with_network_lock_skip(ann, False)
    assert ann == {"gpusnap.io/criu-options": "file-locks"} and not skips_network_lock(ann)
    empty: dict[str, str] = {"gpusnap.io/criu-options": "network-lock skip"}
    with_network_lock_skip(empty, False)
    assert empty == {}  # no empty annotation left behind
