"""The out directory's lock: one run per OUT, whichever command starts it (pure: no torch)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK = ".lock"


class OutDirLock:
    """One run per out directory: an exclusive flock on OUT/.lock, held for the run's life and
    released by the kernel however the process ends (no stale locks after a SIGKILL). The file says
    who holds it. Needs a filesystem with working flock (local disks; Lustre mounted with -o flock)."""

    def __init__(self, out: str | Path):
        self.path = Path(out) / LOCK
        self._f = None

    def acquire(self) -> str | None:
        """None when this process now holds the lock, else who holds it ("pid P on host H since T")."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self.path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            text = f.read()
            f.close()
            return self.describe(text)
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
        f.flush()
        self._f = f
        return None

    @staticmethod
    def describe(text: str) -> str:
        try:
            h = json.loads(text)
            return (
                f"pid {h['pid']} on host {h['host']} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(h['since']))}"
            )
        except (ValueError, KeyError, TypeError):
            return "another process (no holder recorded)"

    @staticmethod
    def holder_pid(out: str | Path) -> tuple[int | None, str | None]:
        try:
            h = json.loads((Path(out) / LOCK).read_text(encoding="utf-8"))
            return int(h["pid"]), str(h["host"])
        except (OSError, ValueError, KeyError, TypeError):
            return None, None

    def release(self) -> None:
        if self._f is not None:
            self._f.close()  # closing the descriptor drops the flock
            self._f = None
