"""Rank 0's lines: the trainer's one logger. Code logs without asking which rank it runs on; `setup` (each
worker, at start) prints rank 0's lines to stdout exactly as written (the log alarms match them, see
core.observability.TrainerLine) and silences the other ranks. Unconfigured (a test in-process), records
propagate to the root logger as any library's do."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

LOG = logging.getLogger("supernode.trainer")


class _Lines(logging.Handler):
    """Each record's message as one line, flushed at once (a killed worker loses none)."""

    def __init__(self) -> None:
        super().__init__()
        self.write: Callable[[str], None] = _print

    def emit(self, record: logging.LogRecord) -> None:
        self.write(record.getMessage())


def _print(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


_HANDLER = _Lines()


def setup(rank: int) -> None:
    LOG.handlers[:] = [_HANDLER]
    LOG.propagate = False
    LOG.setLevel(logging.INFO if rank == 0 else logging.CRITICAL + 1)


def write_through(write: Callable[[str], None] | None) -> None:
    """Print rank 0's lines with `write` (the progress bar's console, above the bar); None: stdout again."""
    _HANDLER.write = write or _print
