"""File digests and manifest file names, shared by the checkpointer, the data manifest, the export and the
server check."""

from __future__ import annotations

import hashlib
from pathlib import Path

# The S3 object tag that says what S3 keeps a checkpoint as ("milestone" | "window"): set by
# `supernode checkpoints --retain` (supernode/tools/checkpoints.py), filtered on by the bucket's
# lifecycle rules (components/aws/storage.py).
CHECKPOINT_RETENTION_TAG = "supernode-retention"
MILESTONE, WINDOW = "milestone", "window"


def sha256_file(path: str | Path) -> str:
    """The file's sha256, read in 4 MiB blocks (checkpoint shards and weights are large)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def plain_name(name: object) -> str | None:
    """Why `name`, a file a manifest lists, is not a plain file name inside the manifest's folder, or None.
    Manifests list flat folders; a path (`../../etc/hostname`, `/etc/passwd`, `a/b`) would make a
    verifier, a server or an upload read or write outside them."""
    if not isinstance(name, str) or not name:
        return f"a file name is required (got {name!r})"
    if "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        return f"{name!r} is not a plain file name in the manifest's folder (no paths, no '..')"
    return None
