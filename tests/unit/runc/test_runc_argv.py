from __future__ import annotations

import pytest

from gpusnap.runc.argv import parse, with_global_flag


@pytest.mark.parametrize(
    "argv",
    [
        ["--root", "/run/x", "--log", "/l.json", "--log-format", "json", "--systemd-cgroup", "create", "--bundle", "/b", "--pid-file", "/p", "cid"],
        ["--root=/run/x", "--log=/l.json", "--log-format=json", "--systemd-cgroup", "create", "-b", "/b", "--pid-file=/p", "cid"],
        ["-root", "/run/x", "-log", "/l.json", "-log-format=json", "-systemd-cgroup", "create", "cid", "-bundle", "/b", "-pid-file", "/p"],
    ],
)
def test_flag_spellings_parse_alike(argv: list[str]) -> None:
    inv = parse(argv)
    assert inv.global_opts == {"root": "/run/x", "log": "/l.json", "log-format": "json", "systemd-cgroup": True}
    assert inv.command == "create" and inv.container_id == "cid" and inv.known
    assert inv.value("bundle") == "/b" and inv.value("pid-file") == "/p"
    assert inv.global_args() == argv[: argv.index("create")]


def test_rootless_and_criu_take_values() -> None:
    inv = parse(["--rootless", "true", "--criu", "/opt/criu", "--debug", "checkpoint", "--leave-running", "--image-path", "/i", "c1"])
    assert inv.global_opts == {"rootless": "true", "criu": "/opt/criu", "debug": True}
    assert inv.flag("leave-running") and not inv.flag("tcp-established") and inv.value("image-path") == "/i"


def test_bool_flag_with_explicit_value() -> None:
    inv = parse(["restore", "--detach=false", "--tcp-established=true", "c1"])
    assert not inv.flag("detach") and inv.flag("tcp-established")
    assert parse(["restore", "-d", "c1"]).flag("detach")


def test_double_dash_ends_flags() -> None:
    inv = parse(["run", "--", "-weird-id"])
    assert inv.container_id == "-weird-id"


@pytest.mark.parametrize(
    ("argv", "command", "known"),
    [
        (["--no-such-global", "create", "c"], None, True),  # runc rejects it: hand over unchanged
        (["create", "--no-such-flag", "c"], "create", False),
        (["checkpoint", "--image-path"], "checkpoint", False),  # value missing
        (["--root"], None, True),
        ([], None, True),
        (["--version"], None, True),
    ],
)
def test_lines_left_to_runc(argv: list[str], command: str | None, known: bool) -> None:
    inv = parse(argv)
    assert inv.command == command and inv.known is known


def test_passthrough_commands_keep_everything_as_positionals() -> None:
    inv = parse(["--root", "/r", "exec", "--preserve-fds", "2", "-t", "cid", "sh"])
    assert inv.command == "exec" and inv.positionals == ["--preserve-fds", "2", "-t", "cid", "sh"]
    assert inv.argv == ["--root", "/r", "exec", "--preserve-fds", "2", "-t", "cid", "sh"]


def test_global_flags_and_version() -> None:
    assert parse(["-v"]).global_opts == {"v": True}
    assert parse(["--version"]).global_opts == {"version": True}
    assert parse(["--debug=false", "list"]).global_opts == {"debug": False}


def test_with_global_flag_adds_only_when_absent() -> None:
    inv = parse(["--root", "/r", "checkpoint", "c"])
    assert with_global_flag(inv.argv, inv, "criu", "/c") == ["--criu", "/c", "--root", "/r", "checkpoint", "c"]
    inv = parse(["--criu=/mine", "checkpoint", "c"])
    assert with_global_flag(inv.argv, inv, "criu", "/c") == ["--criu=/mine", "checkpoint", "c"]


@pytest.mark.parametrize(("cid", "ok"), [("abc-1_2.3+x", True), ("../etc", False), ("..", False), ("", False), ("a/b", False), ("a b", False)])
def test_container_ids_follow_runcs_rule(cid: str, ok: bool) -> None:
    from gpusnap.runc.argv import valid_container_id

    assert valid_container_id(cid) is ok


from hypothesis import given
from hypothesis import strategies as st

_VALUES = st.text(alphabet="abcxyz/._0123456789", min_size=1, max_size=12)


@given(
    root=_VALUES,
    image=_VALUES,
    leave=st.booleans(),
    dashes=st.sampled_from(["-", "--"]),
    joined=st.booleans(),
    id_first=st.booleans(),
)
def test_any_spelling_and_order_gives_the_same_reading(root: str, image: str, leave: bool, dashes: str, joined: bool, id_first: bool) -> None:
    def flag(name: str, value: str) -> list[str]:
        return [f"{dashes}{name}={value}"] if joined else [f"{dashes}{name}", value]

    opts = [*flag("image-path", image), *([f"{dashes}leave-running"] if leave else [])]
    tail = ["cid", *opts] if id_first else [*opts, "cid"]
    inv = parse([*flag("root", root), "checkpoint", *tail])
    assert inv.global_opts == {"root": root} and inv.command == "checkpoint" and inv.known
    assert inv.container_id == "cid" and inv.value("image-path") == image and inv.flag("leave-running") is leave
