"""The checkpoint format every command reads, pure (no torch): a committed checkpoint of step N is
`ROOT/step_0000000N/` with its COMPLETE marker (the step, the sha256 of every file, the model and
training settings); `checkpoint_problem` says why one cannot be trusted. The trainer writes them
(`supernode.trainer.checkpoint`, DCP); the CLI, the restore drill, the export and the metrics read them here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .files import sha256_file

COMPLETE = "COMPLETE"
PREFIX, TMP_PREFIX, OLD_PREFIX = "step_", ".tmp-step_", ".old-step_"
# A marker without sha256 (a checkpoint from before checksums, or an edited marker) proves nothing about
# its weights: it is refused unless this variable is "1", and then the restore says it used one.
TRUST_UNCHECKED_ENV = "SUPERNODE_TRUST_UNCHECKED_CHECKPOINT"


def step_dir(root: Path, step: int, tmp: bool = False) -> Path:
    return root / f"{TMP_PREFIX if tmp else PREFIX}{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint, oldest first."""
    root = Path(root)
    found = []
    for d in root.glob(PREFIX + "*") if root.is_dir() else []:
        if (d / COMPLETE).is_file() and d.name[len(PREFIX) :].isdigit():
            found.append((int(d.name[len(PREFIX) :]), d))
    return sorted(found)


def read_marker(path: Path) -> dict:
    """The COMPLETE marker of the checkpoint at `path` ({} where it is unreadable or not an object)."""
    try:
        m = json.loads((path / COMPLETE).read_text(encoding="utf-8"))
        return m if isinstance(m, dict) else {}
    except (OSError, ValueError):
        return {}


def marker_unchecked(path: Path) -> bool:
    """The marker is readable but records no sha256 of the files (see TRUST_UNCHECKED_ENV)."""
    m = read_marker(path)
    return bool(m) and not isinstance(m.get("files"), dict)


def checkpoint_problem(path: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (an unreadable marker, one without sha256,
    a file missing, unreadable or not matching its recorded sha256), or None. A marker without
    sha256 is trusted only where TRUST_UNCHECKED_ENV is "1".
    `share` (rank, world): check only the files whose index in name order is rank modulo world,
    so that `world` processes check every file once between them; (0, 1), all: one process."""
    marker = read_marker(path)
    if not marker:
        return f"{path / COMPLETE} is unreadable or not a JSON object"
    files = marker.get("files")
    if not isinstance(files, dict):
        if os.environ.get(TRUST_UNCHECKED_ENV) == "1":
            return None
        return (
            f"{path / COMPLETE} records no sha256 of its files (written before checksums, or edited), "
            f"so nothing proves its weights are the ones saved; set {TRUST_UNCHECKED_ENV}=1 to use it anyway"
        )
    rank, world = share
    for name in sorted(files)[rank::world]:
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        try:
            if sha256_file(f) != files[name]:
                return f"{f} does not match its recorded sha256"
        except OSError as e:  # one rank's read error must not leave the others waiting for its verdict
            return f"{f} cannot be read ({e.strerror or e})"
    return None
