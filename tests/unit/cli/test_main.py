"""The CLI's contract with its caller: exit codes, one-line errors, help text."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.cli.main import main
from gpusnap.errors import ExitCode


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


@pytest.fixture(autouse=True)
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("GPUSNAP_CONFIG", str(tmp_path / "none.toml"))


def test_help_lists_every_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    flat = " ".join(out.split())
    for c in ExitCode:
        assert f"{c.value} {c.name.lower().replace('_', ' ')}" in flat
    for cmd in ("checkpoint", "restore", "run", "ps", "doctor", "demo"):
        assert cmd in out


def test_not_found_is_one_line_with_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "logs", "gs-cli-nosuch")
    assert code == ExitCode.NOT_FOUND
    assert err.strip() == "gpusnap: error: no runc-direct container gs-cli-nosuch; `gpusnap ps` lists them"
    assert out == ""


def test_traceback_only_with_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, err = run(capsys, "logs", "gs-cli-nosuch")
    assert "Traceback" not in err
    _, _, err = run(capsys, "-v", "logs", "gs-cli-nosuch")
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("gpusnap: error: ")


def test_bad_option_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "checkpoint", "x", "--no-such-option")
    assert code == ExitCode.USAGE
    assert "no-such-option" in err


def test_push_and_output_exclude_each_other(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "checkpoint", "x", "--push", "localhost/a:b", "--output", str(tmp_path / "o"))
    assert code == ExitCode.USAGE
    assert "exclude each other" in err


def test_bad_config_file_is_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("nonsense = 1\n")
    monkeypatch.setenv("GPUSNAP_CONFIG", str(cfg))
    code, _, err = run(capsys, "ps")
    assert code == ExitCode.USAGE
    assert "unknown setting(s) nonsense" in err and len(err.strip().splitlines()) == 1


def test_ps_json_empty(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ps", "--json")
    assert code == 0 and out.strip() == "[]"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from gpusnap import __version__

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"gpusnap {__version__}"


def test_shell_completion_completes_commands() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).parent / "gpusnap")
    env = {**os.environ, "COMP_WORDS": "gpusnap che", "COMP_CWORD": "1", "_GPUSNAP_COMPLETE": "complete_bash"}
    proc = subprocess.run([exe], env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["checkpoint"]
    script = subprocess.run([exe, "--show-completion", "bash"], capture_output=True, text=True, timeout=60).stdout
    assert "_gpusnap_completion" in script


@pytest.mark.parametrize("argv", [["demo"], ["run", "x", "--", "sh"], ["checkpoint", "x"], ["restore", "localhost/x:y"]])
def test_commands_that_need_root_say_so(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    import os

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code, _, err = run(capsys, *argv)
    assert code == ExitCode.USAGE
    assert err.strip() == f"gpusnap: error: gpusnap {argv[0]} needs root (CRIU and runc do); run it as root (with sudo if you are not)"


def _commands_of(module_name: str) -> set[str]:
    import importlib

    import typer

    app = typer.Typer()

    @app.callback()
    def _group() -> None: ...

    importlib.import_module(module_name).register(app)
    return set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_command_table_matches_what_each_module_registers() -> None:
    from gpusnap.cli import main as cli_main

    registered = {cmd: name for name in (*cli_main.CORE_MODULES, *cli_main.OPTIONAL_MODULES) for cmd in _commands_of(name)}
    assert registered == cli_main.COMMAND_MODULES


@pytest.mark.parametrize(("args", "word"), [
    (["checkpoint", "x", "--push", "r/a:b"], "checkpoint"),
    (["-v", "restore", "r/a:b"], "restore"),
    (["--config", "/etc/x.toml", "ps"], "ps"),
    (["--config", "checkpoint", "ps"], "ps"),  # the config file's name is not a command
    (["--help"], None),
    (["--version", "checkpoint"], None),
    ([], None),
])
def test_named_command(args: list[str], word: str | None) -> None:
    from gpusnap.cli.main import named_command

    assert named_command(args) == word


def test_one_command_loads_its_module_only_and_unknown_words_get_all(monkeypatch: pytest.MonkeyPatch) -> None:
    import typer

    from gpusnap.cli.main import build_app

    only = set(typer.main.get_command(build_app(["checkpoint", "x"])).commands)  # type: ignore[attr-defined]
    assert only == {"checkpoint", "restore"}
    every = set(typer.main.get_command(build_app(["no-such-command"])).commands)  # type: ignore[attr-defined]
    assert {"checkpoint", "push", "doctor", "install", "cri-image"} <= every
    monkeypatch.setenv("_GPUSNAP_COMPLETE", "complete_bash")
    assert set(typer.main.get_command(build_app(["checkpoint"])).commands) == every  # type: ignore[attr-defined]


def test_unknown_command_is_matched_against_every_command(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A word that names no command loads every module, so its suggestion can come from any
    (``pull`` lives in an optional module)."""
    monkeypatch.setenv("COLUMNS", "200")
    code, _, err = run(capsys, "pulll", "x")
    assert code == ExitCode.USAGE
    assert "No such command 'pulll'. Did you mean 'pull'?" in err


def test_checkpoint_start_up_loads_neither_pydantic_nor_other_commands() -> None:
    """What a `gpusnap checkpoint` pays before its first step (a fresh interpreter: the test
    process has imported everything already)."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from gpusnap.cli.main import build_command\n"
        "cmd = build_command(['checkpoint', 'x', '--push', 'r/a:b'])\n"
        "cmd.make_context('gpusnap', ['checkpoint', 'x', '--push', 'r/a:b'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic' or m in (\n"
        "    'gpusnap.cli.artifacts', 'gpusnap.cli.demo', 'gpusnap.cli.install', 'gpusnap.cli.cri',\n"
        "    'gpusnap.packaging.crypto', 'rich.progress', 'rich.table')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plain_checkpoints_load_no_cryptography(tmp_path: Path) -> None:
    """Storing, inspecting and materializing a plain checkpoint go through the code that tells
    encrypted artifacts from plain ones (gpusnap.packaging.encrypted), and load `cryptography`
    only when a key is given."""
    import subprocess
    import sys

    src = tmp_path / "ck"
    src.mkdir()
    (src / "inventory.img").write_bytes(b"inv")
    (src / "data.bin").write_bytes(bytes(range(256)) * 4096)
    probe = (
        "import sys\nfrom pathlib import Path\nfrom gpusnap.packaging import api\n"
        "store, src, out = (Path(a) for a in sys.argv[1:])\n"
        "api.store_checkpoint(store, src, form='criu-dir', ref='x:1')\n"
        "api.inspect(store, 'x:1')\n"
        "api.materialize_checkpoint(store, 'x:1', out, form='criu-dir')\n"
        "assert 'gpusnap.packaging.encrypted' in sys.modules\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'cryptography'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "s"), str(src), str(tmp_path / "out")],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture
def dead_port() -> int:
    """A loopback port nothing listens on: every connection is refused at once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_command_fails_with_the_same_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The store and registry commands (their own handlers) print what the others print: one
    line starting 'gpusnap: error: '."""
    code, _, err = run(capsys, "rm", "localhost/gpusnap/none:1", "--store", str(tmp_path / "s"))
    assert code == ExitCode.NOT_FOUND and len(err.strip().splitlines()) == 1 and err.startswith("gpusnap: error: ")
    code, _, err = run(capsys, "inspect", "localhost/gpusnap/none:1", "--store", str(tmp_path / "s"))
    assert code == ExitCode.REGISTRY and len(err.strip().splitlines()) == 1
    assert err.startswith("gpusnap: error: localhost/gpusnap/none:1 is not in the local store")


def test_an_unreachable_registry_is_named_with_the_system_s_reason(dead_port: int) -> None:
    """Not the HTTP library's nested repr (pool, URL, retry and connection classes)."""
    from gpusnap.errors import RegistryError
    from gpusnap.packaging.registry import RegistryClient

    client = RegistryClient(f"127.0.0.1:{dead_port}", retries=1, backoff_s=0.01, timeout_s=5)
    with pytest.raises(RegistryError) as exc:
        client.get_manifest("r/x", "1")
    assert str(exc.value) == (f"cannot reach registry 127.0.0.1:{dead_port} (Connection refused); check the address and "
                              "that it is up, or use --insecure for a plain-HTTP registry")


def test_a_local_reference_not_in_the_store_says_so_beside_the_unreachable_registry(tmp_path: Path, dead_port: int) -> None:
    """gpusnap's own names look like registry references: a restore of a mistyped local tag
    must not read as a network problem only."""
    from gpusnap.engines.orchestrate import _not_in_store_either
    from gpusnap.errors import RegistryError, RegistryUnreachable
    from gpusnap.packaging.registry import RegistryClient

    ref = f"127.0.0.1:{dead_port}/gpusnap/x:typo"
    with pytest.raises(RegistryUnreachable) as exc:
        with _not_in_store_either(ref, tmp_path / "store"):
            RegistryClient(f"127.0.0.1:{dead_port}", insecure=True, retries=1).get_manifest("gpusnap/x", "typo")
    assert str(exc.value).startswith(f"{ref} is not in the local store {tmp_path / 'store'} (`gpusnap ls` lists what it holds), "
                                     f"and cannot reach registry 127.0.0.1:{dead_port}")
    assert exc.value.exit_code == ExitCode.REGISTRY
    with pytest.raises(RegistryError, match="^GET /v2/ on r: HTTP 500"):  # the registry answered: its answer only
        with _not_in_store_either(ref, tmp_path / "store"):
            raise RegistryError("GET /v2/ on r: HTTP 500")


def test_an_address_that_never_answered_fails_at_once_a_registry_that_did_is_retried(
        dead_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listening before the registry ever answered: reported after one retry, not the
    whole backoff (15 s with the defaults); after an answer (a restart mid-transfer) every retry."""
    from gpusnap.errors import RegistryError
    from gpusnap.packaging import registry

    slept: list[float] = []
    monkeypatch.setattr(registry.time, "sleep", slept.append)
    client = registry.RegistryClient(f"127.0.0.1:{dead_port}", insecure=True)  # the defaults: 6 tries
    with pytest.raises(RegistryError, match="Connection refused"):
        client.get_manifest("r/x", "1")
    assert slept == [client.backoff_s]
    slept.clear()
    client.reached = True
    with pytest.raises(RegistryError, match="Connection refused"):
        client.get_manifest("r/x", "1")
    assert len(slept) == client.retries - 1


def test_empty_listings_say_so_and_how_to_fill_them(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A table header over no rows read as a broken listing; --json stays an empty list."""
    code, out, _ = run(capsys, "ls", "--store", str(tmp_path / "s"))
    assert code == 0
    assert out == f"no checkpoints in {tmp_path / 's'}; `gpusnap checkpoint CONTAINER` stores one, `gpusnap pull REF` fetches one\n"
    code, out, _ = run(capsys, "ls", "--store", str(tmp_path / "s"), "--json")
    assert code == 0 and out.strip() == "[]"
    code, out, _ = run(capsys, "ps")
    assert code == 0 and out == "no runc-direct containers; `gpusnap run NAME -- COMMAND` starts one\n"


def test_a_plain_http_registry_asked_for_tls_says_so_at_once() -> None:
    """HTTPS to a server that speaks plain HTTP: one line naming TLS and --insecure, after one
    retry at most (a registry that speaks no TLS will not start to)."""
    import http.server
    import threading
    import time

    from gpusnap.errors import RegistryError
    from gpusnap.packaging.registry import RegistryClient, unreachable_cause

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = RegistryClient(f"127.0.0.1:{server.server_address[1]}")  # the defaults: 6 tries, 15 s of backoff
        t0 = time.monotonic()
        with pytest.raises(RegistryError) as exc:
            client.get_manifest("r/x", "1")
        assert time.monotonic() - t0 < 3
        assert str(exc.value) == (f"cannot reach registry 127.0.0.1:{server.server_address[1]} (TLS: wrong version number); "
                                  "check the address and that it is up, or use --insecure for a plain-HTTP registry")
    finally:
        server.shutdown()
        server.server_close()
    # A certificate this host does not trust: how to trust it.
    text = ("HTTPSConnectionPool(host='r', port=443): Max retries exceeded with url: /v2/ (Caused by SSLError("
            "SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate (_ssl.c:1006)')))")
    assert unreachable_cause(OSError(text)) == ("TLS: certificate verify failed: self-signed certificate; "
                                                "to trust the registry's CA: REQUESTS_CA_BUNDLE=CA.pem")
