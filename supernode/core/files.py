"""File digests shared by the checkpointer, the data manifest, the export and the server check."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    """The file's sha256, read in 4 MiB blocks (checkpoint shards and weights are large)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
