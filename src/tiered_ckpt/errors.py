"""User-facing errors: one clear message, a meaningful exit code, never a traceback."""
from __future__ import annotations

# Exit codes shared by every command (documented in the README).
EXIT_OK = 0
EXIT_FAILED = 1          # the operation ran and found a problem (verify failed, gate refused)
EXIT_USAGE = 2           # bad flags, bad config, bad path: the user's input
EXIT_UNAVAILABLE = 3     # a dependency (archive, ARM, lfs) could not be reached after retries
EXIT_CONFLICT = 4        # refused to overwrite / another actor holds the lock
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """An error the user can fix. `str(err)` is the whole message shown to them."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(UserError):
    """A setting in the node config file or a flag is invalid."""


class ConflictError(UserError):
    exit_code = EXIT_CONFLICT


class UnavailableError(UserError):
    """The archive, ARM or the lfs binary could not be reached after retries."""

    exit_code = EXIT_UNAVAILABLE


class IntegrityError(UserError):
    """A checkpoint is incomplete or a file does not match its manifest."""

    exit_code = EXIT_FAILED
