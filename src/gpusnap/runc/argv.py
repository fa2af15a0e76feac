"""runc's command line, parsed just enough to know what to intercept.

runc parses its flags with Go's ``flag`` package (through urfave/cli): ``-flag`` and ``--flag``
are the same, values come as ``--flag value`` or ``--flag=value``, booleans may be written
``--flag=true``, ``--`` ends the flags, and for the subcommands we intercept flags may also
follow the container id. No stdlib parser (argparse) reproduces those rules, and argparse alone
costs milliseconds of import on every passthrough call, hence this small hand-written scanner.

Only the standard library is used here: this runs on every call of the shim.
"""

from __future__ import annotations

_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_+-.")


def valid_container_id(cid: str | None) -> bool:
    """runc's own rule for ids (``^[\\w+-\\.]+$``, ASCII), checked before an id names any file of
    gpusnap's (the shim's CRIU config, the hook's state); at most 1024 characters.

    By hand because ``re`` alone would add milliseconds to every call of the shim.
    """
    return bool(cid) and len(cid) <= 1024 and cid not in (".", "..") and all(c in _ID_CHARS for c in cid)  # type: ignore[arg-type]


# Global flags of runc 1.1: those that take a value and those that do not.
GLOBAL_VALUE_FLAGS = frozenset({"root", "log", "log-format", "criu", "rootless"})
GLOBAL_BOOL_FLAGS = frozenset({"debug", "systemd-cgroup", "help", "h", "version", "v"})

# Flags of the subcommands the shim intercepts. Aliases map onto their long name.
_ALIASES = {"b": "bundle", "d": "detach", "h": "help"}
COMMAND_VALUE_FLAGS: dict[str, frozenset[str]] = {
    "create": frozenset({"bundle", "console-socket", "pid-file", "preserve-fds"}),
    "run": frozenset({"bundle", "console-socket", "pid-file", "preserve-fds"}),
    "checkpoint": frozenset(
        {"image-path", "work-path", "parent-path", "status-fd", "page-server", "manage-cgroups-mode", "empty-ns"}
    ),
    "restore": frozenset(
        {
            "console-socket", "image-path", "work-path", "manage-cgroups-mode", "bundle", "pid-file",
            "empty-ns", "lsm-profile", "lsm-mount-context",
        }
    ),
}
COMMAND_BOOL_FLAGS: dict[str, frozenset[str]] = {
    "create": frozenset({"no-pivot", "no-new-keyring", "help"}),
    "run": frozenset({"detach", "keep", "no-subreaper", "no-pivot", "no-new-keyring", "help"}),
    "checkpoint": frozenset(
        {
            "leave-running", "tcp-established", "ext-unix-sk", "shell-job", "lazy-pages", "file-locks",
            "pre-dump", "auto-dedup", "help",
        }
    ),
    "restore": frozenset(
        {
            "tcp-established", "ext-unix-sk", "shell-job", "file-locks", "detach", "no-subreaper", "no-pivot",
            "auto-dedup", "lazy-pages", "help",
        }
    ),
}
INTERCEPTED = frozenset(COMMAND_VALUE_FLAGS) | {"features"}

_TRUE = {"1", "t", "T", "true", "TRUE", "True"}


def _split_flag(arg: str) -> tuple[str, str | None] | None:
    """``--name=value`` -> (name, value); ``-name`` -> (name, None); not a flag -> None."""
    if len(arg) < 2 or arg[0] != "-" or arg == "--":
        return None
    body = arg[2:] if arg.startswith("--") else arg[1:]
    if not body or body[0] == "-":
        return None
    name, eq, value = body.partition("=")
    return name, (value if eq else None)


class Invocation:
    """One parsed runc command line.

    A plain ``__slots__`` class rather than a dataclass: importing ``dataclasses`` costs several
    milliseconds, paid on every passthrough call (bench/shim_latency.py measures it).

    ``command`` is None when runc would fail to parse the global flags itself (for instance an
    unknown global flag): the shim then hands the whole line to runc unchanged.
    ``known`` is False when an intercepted command carries a flag this table does not know
    (a newer runc's flag, or a typo): the line then goes to runc untouched as well.
    """

    __slots__ = ("argv", "global_opts", "command", "command_index", "opts", "positionals", "known")

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv  # argv[1:] as given, never modified
        self.global_opts: dict[str, str | bool] = {}
        self.command: str | None = None
        self.command_index = -1
        self.opts: dict[str, str | bool] = {}
        self.positionals: list[str] = []
        self.known = True

    @property
    def container_id(self) -> str | None:
        return self.positionals[0] if self.positionals else None

    def flag(self, name: str) -> bool:
        value = self.opts.get(name, False)
        return value is True or (isinstance(value, str) and value in _TRUE)

    def value(self, name: str) -> str | None:
        value = self.opts.get(name)
        return value if isinstance(value, str) else None

    def global_args(self) -> list[str]:
        """The global flags exactly as given (everything before the command)."""
        return self.argv[: self.command_index] if self.command_index >= 0 else list(self.argv)

    def __repr__(self) -> str:
        return f"Invocation(command={self.command!r}, global_opts={self.global_opts!r}, opts={self.opts!r}, positionals={self.positionals!r}, known={self.known})"


def parse(argv: list[str]) -> Invocation:
    """Parse ``argv`` (without the program name) the way runc would."""
    inv = Invocation(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        split = _split_flag(arg)
        if arg == "--":
            i += 1
            break
        if split is None:
            break
        name, value = split
        if name in GLOBAL_VALUE_FLAGS:
            if value is None:
                if i + 1 >= len(argv):
                    return inv  # runc reports the missing value itself
                value = argv[i + 1]
                i += 1
            inv.global_opts[name] = value
        elif name in GLOBAL_BOOL_FLAGS:
            inv.global_opts[name] = True if value is None else value in _TRUE
        else:
            return inv  # unknown global flag: runc's own error, untouched
        i += 1
    if i >= len(argv):
        return inv
    inv.command = argv[i]
    inv.command_index = i
    if inv.command in COMMAND_VALUE_FLAGS:
        _parse_command(inv, argv[i + 1 :])
    else:
        inv.positionals = argv[i + 1 :]
    return inv


def _parse_command(inv: Invocation, args: list[str]) -> None:
    assert inv.command is not None
    value_flags = COMMAND_VALUE_FLAGS[inv.command]
    bool_flags = COMMAND_BOOL_FLAGS[inv.command]
    j = 0
    while j < len(args):
        arg = args[j]
        if arg == "--":
            inv.positionals.extend(args[j + 1 :])
            return
        split = _split_flag(arg)
        if split is None:
            inv.positionals.append(arg)
            j += 1
            continue
        name, value = split
        name = _ALIASES.get(name, name)
        if name in value_flags:
            if value is None:
                if j + 1 >= len(args):
                    inv.known = False
                    return
                value = args[j + 1]
                j += 1
            inv.opts[name] = value
        elif name in bool_flags:
            inv.opts[name] = True if value is None else (value in _TRUE)
        else:
            inv.known = False
            return
        j += 1


def with_global_flag(argv: list[str], inv: Invocation, name: str, value: str) -> list[str]:
    """``argv`` with ``--name value`` added among the global flags, unless already given."""
    if name in inv.global_opts:
        return list(argv)
    return [f"--{name}", value, *argv]
