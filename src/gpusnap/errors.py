"""Errors shared by every entry point, each carrying its documented exit code.

Every error message is one line that says what is wrong and what to do about it. Entry points
print ``str(error)`` and exit with ``error.exit_code``; they never print tracebacks unless asked.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Stable exit codes of ``gpusnap``, ``gpusnap-runtime`` (when it acts itself) and ``gpusnap-hook``.

    ``gpusnap-runtime`` passes runc's own exit status through unchanged when runc fails.
    """

    OK = 0
    FAILURE = 1  # unexpected internal error
    USAGE = 2  # bad command line or bad input file
    NOT_FOUND = 3  # container, checkpoint, reference or file does not exist
    INCOMPATIBLE = 4  # host cannot take this checkpoint (GPU, driver, arch, kernel)
    MISSING_DEPENDENCY = 5  # runc, CRIU, an engine or the GPU driver is missing or too old
    CHECKPOINT_FAILED = 6  # checkpoint failed and was rolled back: the container still runs
    RESTORE_FAILED = 7  # restore failed; nothing was left half-restored
    REGISTRY = 8  # registry unreachable, auth refused, network error
    INTEGRITY = 9  # a digest or size did not match, an archive entry was unsafe
    UNSUPPORTED = 10  # the workload uses something that cannot be checkpointed (UVM, MPS, MIG, device files outside CUDA)
    ROLLBACK_FAILED = 11  # a failure could not be fully undone: the message says what is left


EXIT_CODE_HELP = "\n".join(f"  {c.value:>2}  {c.name.lower().replace('_', ' ')}" for c in ExitCode)


class GpusnapError(Exception):
    """Base of all expected failures: a one-line message and an exit code."""

    exit_code: ExitCode = ExitCode.FAILURE

    def __init__(self, message: str, *, exit_code: ExitCode | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        # Keep it on one line whatever the cause text contains.
        return " ".join(super().__str__().split())


class UsageError(GpusnapError):
    exit_code = ExitCode.USAGE


class NotFoundError(GpusnapError):
    exit_code = ExitCode.NOT_FOUND


class IncompatibleHostError(GpusnapError):
    exit_code = ExitCode.INCOMPATIBLE


class MissingDependencyError(GpusnapError):
    exit_code = ExitCode.MISSING_DEPENDENCY


class CheckpointError(GpusnapError):
    exit_code = ExitCode.CHECKPOINT_FAILED


class RestoreError(GpusnapError):
    exit_code = ExitCode.RESTORE_FAILED


class RegistryError(GpusnapError):
    exit_code = ExitCode.REGISTRY


class RegistryUnreachable(RegistryError):
    """No answer from the registry at all (no such host, nothing listening, no TLS where TLS was
    asked for), as opposed to an answer that refused or failed the request."""


class IntegrityError(GpusnapError):
    exit_code = ExitCode.INTEGRITY


class UnsupportedError(GpusnapError):
    exit_code = ExitCode.UNSUPPORTED


class RollbackError(GpusnapError):
    exit_code = ExitCode.ROLLBACK_FAILED
