"""Errors a user can fix, and the exit codes: one module for the CLI and the trainer alike.

Exit codes (docs/architecture.md §7): 0 ok; 1 a check, policy or run failed; 2 bad input; 130 interrupted.
Bad input is every problem printed with its path and value, never a traceback: `bad_input_lines`
is the one mapping from the known error types to those lines.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


# Errors about a path itself (not the disk or the device): what a user fixes by giving another path.
PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)


class BadInput(Exception):
    """A flag, file or value the user gave is unusable: printed as one message, exit 2."""


class Issue(BaseModel):
    path: str
    value: Any = None
    message: str
    missing: bool = False  # no value was given at all

    def __str__(self) -> str:
        got = "" if self.missing else f" (got {self.value!r})"
        return f"{self.path}: {self.message}{got}"


class ConfigError(Exception):
    """Every problem in a stack file (or a plan against a job) at once; exit 2."""

    def __init__(self, issues: list[Issue], source: str = ""):
        self.issues = issues
        self.source = source
        super().__init__("\n".join(str(i) for i in issues))


def bad_input_lines(exc: BaseException) -> list[str] | None:
    """The lines to print for a known bad-input error (exit 2), or None when `exc` is not one."""
    if isinstance(exc, ConfigError):
        head = f"invalid configuration{' ' + exc.source if exc.source else ''}: {len(exc.issues)} problem(s)"
        return [head, *(f"  {issue}" for issue in exc.issues)]
    if isinstance(exc, BadInput):
        return [f"error: {exc}"]
    if isinstance(exc, PATH_ERRORS) and exc.filename:  # a path the user gave cannot be used as given
        return [f"error: {exc.filename}: {exc.strerror}"]
    return None
