"""bin/gpusnap-runtime (the sh front) decides as the Python shim does, and starts Python only
when it must.

Real processes on fake PATH trees: the front, the real Python shim (its launcher records that
it started), and fake runc scripts that print which runc ran with which arguments. For every
case the front's result (exit status, stdout, stderr) must equal the Python shim's, run the way
the front runs it (GPUSNAP_FRONT set).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusnap.runc.argv import parse
from gpusnap.runtime_shim.main import _intercepts

REPO = Path(__file__).resolve().parents[3]
FRONT_SRC = REPO / "bin" / "gpusnap-runtime"


def _exe(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(0o755)
    return path


@dataclass
class Tree:
    base: Path
    front: Path
    shim_py: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def fake_runc(self, rel: str) -> Path:
        return _exe(self.base / rel, '#!/bin/sh\necho "ran $0 with $*"\n')

    def config(self, text: str) -> Path:
        path = self.base / "config.toml"
        path.write_bytes(text.encode())
        self.env["GPUSNAP_CONFIG"] = str(path)
        return path

    def run(self, binary: Path | str, argv: list[str], extra: dict[str, str] | None = None) -> tuple[int, str, str, bool]:
        self.log.unlink(missing_ok=True)
        env = {**self.env, "FRONT_TEST_LOG": str(self.log), **(extra or {})}
        proc = subprocess.run([str(binary), *argv], capture_output=True, text=True, env=env, cwd=self.base, timeout=30)
        return proc.returncode, proc.stdout, proc.stderr, self.log.exists()

    def both(self, argv: list[str], invoked_as: Path | None = None) -> tuple[tuple[int, str, str], bool]:
        """The front's result and whether it started Python; asserts the Python shim agrees."""
        front = invoked_as or self.front
        rc, out, err, started = self.run(front, argv)
        py = self.run(self.shim_py, argv, {"GPUSNAP_FRONT": str(front)})
        assert (rc, out, err) == py[:3], f"front {(rc, out, err)} != python {py[:3]} for {argv}"
        return (rc, out, err), started


# /bin/sh is dash on Debian, bash elsewhere; busybox's ash on small images.
SHELLS = [sh for sh in ("/bin/sh", "/bin/bash", "/usr/bin/busybox sh") if Path(sh.split()[0]).is_file()]


@pytest.fixture(params=SHELLS)
def tree(tmp_path: Path, request: pytest.FixtureRequest) -> Tree:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    front = bin_dir / "gpusnap-runtime"
    front.write_bytes(FRONT_SRC.read_bytes().replace(b"#!/bin/sh\n", f"#!{request.param}\n".encode(), 1))
    front.chmod(0o755)
    # The real launcher's lines, plus one that records that Python started.
    shim_py = _exe(bin_dir / "gpusnap-runtime-py", (
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "open(os.environ['FRONT_TEST_LOG'], 'a').write('python\\n')\n"
        "from gpusnap.runtime_shim.main import main\n"
        "sys.exit(main())\n"
    ))
    t = Tree(tmp_path, front, shim_py, tmp_path / "python-started")
    t.fake_runc("a/runc")
    t.env = {
        "PATH": f"{tmp_path / 'a'}",
        "GPUSNAP_CONFIG": str(tmp_path / "no-config.toml"),
        "GPUSNAP_RUN_DIR": str(tmp_path / "run"),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    return t


def test_passthrough_execs_the_first_runc_on_path_without_python(tree: Tree) -> None:
    (rc, out, _), started = tree.both(["--root", "/r", "state", "c1"])
    assert (rc, out, started) == (0, f"ran {tree.base}/a/runc with --root /r state c1\n", False)


def test_the_front_installed_as_runc_skips_itself(tree: Tree) -> None:
    link = tree.base / "links" / "runc"
    link.parent.mkdir()
    link.symlink_to(tree.front)
    tree.env["PATH"] = f"{link.parent}:{tree.base / 'a'}"
    (_, out, _), started = tree.both(["list"], invoked_as=link)
    assert out == f"ran {tree.base}/a/runc with list\n" and not started
    # Nothing but itself called runc: the Python shim's error, not a loop.
    tree.env["PATH"] = str(link.parent)
    (rc, _, err), started = tree.both(["list"], invoked_as=link)
    assert rc == 5 and "runc not found on PATH" in err and started


@pytest.mark.parametrize("path", ["{a}/", "{a}//", ":{a}:", "{empty}::{a}"])
def test_path_spelling_gives_the_same_runc_path(tree: Tree, path: str) -> None:
    (tree.base / "empty").mkdir()
    tree.env["PATH"] = path.format(a=tree.base / "a", empty=tree.base / "empty")
    (rc, out, _), started = tree.both(["state", "c1"])
    assert rc == 0 and out.startswith("ran ") and not started


def test_configured_runc_from_env_by_path_or_name(tree: Tree) -> None:
    other = tree.fake_runc("b/runc-1.2")
    tree.env["GPUSNAP_RUNC"] = str(other)
    (_, out, _), started = tree.both(["state", "c1"])
    assert out == f"ran {other} with state c1\n" and not started
    tree.env.update(GPUSNAP_RUNC="runc-1.2", PATH=f"{tree.base / 'a'}:{tree.base / 'b'}")
    (_, out, _), started = tree.both(["state", "c1"])
    assert out == f"ran {other} with state c1\n" and not started


PLAIN_CONFIGS = [
    'runc = "{b}"\n',
    '# a comment\n\n\trunc = "{b}"   # where runc is\nrun_dir="{run}"\nlock_timeout_ms = 5000\nstore_dir = \'/var/x\'\n',
    "runc='{b}'",  # no final newline
    'gpu_backend = "none"\nrunc = "{b}"\nnetwork_prefix = "gs-#1"\n',
]


@pytest.mark.parametrize("text", PLAIN_CONFIGS)
def test_plain_config_files_are_read_by_the_front(tree: Tree, text: str) -> None:
    other = tree.fake_runc("b/runc")
    tree.config(text.format(b=other, run=tree.base / "run2"))
    (_, out, _), started = tree.both(["state", "c1"])
    assert out == f"ran {other} with state c1\n" and not started
    tree.env["GPUSNAP_RUNC"] = str(tree.base / "a" / "runc")  # the environment wins over the file
    (_, out, _), started = tree.both(["state", "c1"])
    assert out == f"ran {tree.base}/a/runc with state c1\n" and not started


@pytest.mark.parametrize(
    "text,code",
    [
        ('runc = "{b}"\nbogus = 1\n', 2),  # unknown setting
        ('runc = "{b}"\n[engine]\nx = "y"\n', 2),  # a table
        ('runc = "{b}\n', 2),  # not TOML
        ('runc = "{b}"\nrunc = "{b}"\n', 2),  # a key twice
        ('lock_timeout_ms = "soon"\n', 2),
        ('runc = "/nonexistent/runc"\n', 5),
        ('runc = "{b}"\r\n', 0),  # CRLF: valid, left to the real parser
        ('runc = "{esc}"\n', 0),  # an escape: left to the real parser
        ('"runc" = "{b}"\n', 0),  # a quoted key: left to the real parser
        ('runc = """{b}"""\n', 0),
        ('lock_timeout_ms = 1_000\nrunc = "{b}"\n', 0),
        ("\ufeffrunc = '{b}'\n", 2),  # a BOM
    ],
)
def test_other_config_files_go_to_the_python_shim(tree: Tree, text: str, code: int) -> None:
    other = tree.fake_runc("b/runc")
    tree.config(text.format(b=other, esc=str(other).replace("/", "\\u002f")))
    (rc, out, err), started = tree.both(["state", "c1"])
    assert started and rc == code, (out, err)
    if code:
        assert len(err.strip().splitlines()) == 1 and err.startswith("gpusnap-runtime: ")
    else:
        assert out == f"ran {other} with state c1\n"


def test_environment_the_config_file_rejects(tree: Tree) -> None:
    tree.config("")
    tree.env["GPUSNAP_LOCK_TIMEOUT_MS"] = "ten"
    (rc, _, err), started = tree.both(["state", "c1"])
    assert rc == 2 and "lock_timeout_ms" in err and started
    tree.env["GPUSNAP_LOCK_TIMEOUT_MS"] = "10"
    (rc, _, _), started = tree.both(["state", "c1"])
    assert rc == 0 and not started


@pytest.mark.parametrize("setting", ["missing", "itself", "trailing-slash"])
def test_unusable_runc_gets_the_python_shims_error(tree: Tree, setting: str) -> None:
    value = {"missing": str(tree.base / "no" / "runc"), "itself": str(tree.front), "trailing-slash": str(tree.base / "a") + "/"}[setting]
    tree.env["GPUSNAP_RUNC"] = value
    (rc, _, err), started = tree.both(["state", "c1"])
    assert rc == 5 and started and err.startswith("gpusnap-runtime: ") and len(err.splitlines()) == 1
    del tree.env["GPUSNAP_RUNC"]
    tree.env["PATH"] = str(tree.base / "nothing")
    (rc, _, err), started = tree.both(["state", "c1"])
    assert rc == 5 and started and "runc not found on PATH" in err


@pytest.mark.parametrize(
    "argv,python",
    [
        (["create", "--bundle", "b", "c1"], True),
        (["--root", "/r", "--log", "/l", "--log-format", "json", "--systemd-cgroup", "run", "c1"], True),
        (["--root=/r", "checkpoint", "c1"], True),
        (["restore", "c1"], True),
        (["features"], True),
        (["--version"], True),
        (["-v"], True),
        (["--debug", "--version=false", "list"], True),
        (["--root", "/r", "--log", "/l", "--log-format", "json", "--systemd-cgroup", "state", "c1"], False),
        (["--unknown", "create", "c1"], False),  # runc's own error for the flag
        (["--", "state", "c1"], False),
        (["--", "create", "c1"], True),
        (["--root"], False),
        (["--root", "create"], False),  # "create" is --root's value; runc finds no command
        (["---x", "create"], False),
        (["-", "state"], False),
        ([], False),
        (["--help"], False),
        (["kill", "c1", "KILL"], False),
        (["start", "c1"], False),
    ],
)
def test_which_calls_start_python(tree: Tree, argv: list[str], python: bool) -> None:
    (rc, out, _), started = tree.both(argv)
    assert started == python


def test_delete_drops_the_criu_config_as_python_would(tree: Tree) -> None:
    conf = tree.base / "run" / "criu" / "c1.conf"
    (_, out, _), started = tree.both(["delete", "--force", "c1"])
    assert out == f"ran {tree.base}/a/runc with delete --force c1\n" and not started
    conf.parent.mkdir(parents=True)
    for argv, gone in ((["delete", "c1", "c2"], False), (["--root", "/r", "delete", "-f", "c1"], True), (["delete", "c1"], True)):
        conf.write_text("tcp-established\n")
        rc, out, _, started = tree.run(tree.front, argv)
        assert rc == 0 and out == f"ran {tree.base}/a/runc with {' '.join(argv)}\n" and not started
        assert conf.exists() != gone


def _python_would(argv: list[str], conf_ids: set[str]) -> tuple[bool, bool]:
    """What gpusnap.runtime_shim.main would do: (act itself, drop a CRIU config) before exec."""
    inv = parse(argv)
    acts = bool(inv.command is None and inv.global_opts.get("version") and not inv.global_opts.get("help")) or _intercepts(inv)
    drops = False
    if inv.command == "delete":
        ids = [a for a in inv.positionals if not a.startswith("-")]
        drops = len(ids) == 1 and ids[0] in conf_ids
    return acts, drops


TOKENS = st.sampled_from([
    "create", "run", "checkpoint", "restore", "features", "state", "delete", "kill", "list", "c1", "c2", "..",
    "--root", "--root=/r", "-root", "/r", "--log", "--log-format", "json", "--criu", "--rootless", "true",
    "--debug", "--systemd-cgroup", "--help", "-h", "--version", "-v", "--version=false", "--", "-", "---x",
    "--bogus", "-f", "--force", "--bundle", "b", "=", "",
])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=st.lists(TOKENS, max_size=6))
def test_the_front_never_skips_what_python_would_do(tree: Tree, argv: list[str]) -> None:
    """For any command line: where the front execs runc itself, the Python shim would only have
    exec'd that same runc, after dropping the same CRIU config (the front may hand over more than
    needed, never less)."""
    conf = tree.base / "run" / "criu" / "c1.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("x\n")
    rc, out, err, started = tree.run(tree.front, argv)
    if not started:
        acts, drops = _python_would(argv, {"c1"})
        assert not acts, argv
        assert conf.exists() != drops, argv
        assert (rc, out) == (0, f"ran {tree.base}/a/runc with {' '.join(argv)}\n")
