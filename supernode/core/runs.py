"""Run identities: which run a checkpoint belongs to, said the same way on FSx, in S3 and by every
command (the trainer, `supernode train`, `supernode checkpoints`, the restore drill). Pure: no torch.

A run lives in OUT/runs/<run id>/: its checkpoints in `checkpoints/step_N/` and its identity in
`run.json`, written once (atomically, never rewritten): the stack, the run id, the model's
fingerprint and settings, when it was created, and the run and step it branched from, if any. The
fingerprint is the sha256 of the model settings every checkpoint marker already records (its
`model`), so a run and its checkpoints are judged by the same facts.

A run id is a name the user gives or `new_run_id()`'s (UTC time + a short random suffix); "new" is
the word that asks for one, never an id.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from .errors import BadInput

RUNS, RUN_FILE, CHECKPOINTS = "runs", "run.json", "checkpoints"
NEW = "new"  # `--run new`: a fresh run with a generated id
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RUN_ID_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64"


def model_fingerprint(model: dict[str, Any]) -> str:
    """The model settings a checkpoint marker records (`model`), hashed: 16 hex digits of their sha256."""
    canonical = json.dumps(model, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def model_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """`model.k theirs -> ours` for every setting that differs (the checkpoint mismatch's wording)."""
    return ", ".join(
        f"model.{k} {theirs.get(k)!r} -> {ours.get(k)!r}"
        for k in sorted(set(theirs) | set(ours))
        if theirs.get(k) != ours.get(k)
    )


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def check_run_id(flag: str, value: str) -> str:
    if value == NEW or not RUN_ID.fullmatch(value):
        raise BadInput(
            f"{flag} {value!r}: not a run name ({RUN_ID_RULE}; '{NEW}' asks supernode train for a fresh one)"
        )
    return value


def run_dir(out: Path, run: str) -> Path:
    return Path(out) / RUNS / run


# The fields every command reads from a run.json, and their types (`record` writes them all).
RECORD_FIELDS = {"stack": str, "run": str, "model_fingerprint": str, "model": dict, "created_ns": int}


def record_problem(rec: Any) -> str | None:
    """What makes `rec` not a run record, None where it is one: a hand-edited or foreign run.json
    must not reach the code that sorts by its creation time or follows its parent to a directory."""
    if not isinstance(rec, dict):
        return f"not a JSON object but {type(rec).__name__}"
    for key, kind in RECORD_FIELDS.items():
        if key not in rec:
            return f"no {key}"
        if not isinstance(rec[key], kind) or isinstance(rec[key], bool):
            return f"{key} {rec[key]!r}: expected {kind.__name__}"
    parent = rec.get("parent")
    if parent is not None and not (
        isinstance(parent, dict)
        and isinstance(parent.get("run"), str)
        and RUN_ID.fullmatch(parent["run"])
        and type(parent.get("step")) is int
        and parent["step"] >= 1
    ):
        return f"parent {parent!r} is not {{'run': a run name, 'step': a step >= 1}}"
    return None


def read_record(directory: Path) -> dict[str, Any] | None:
    """A run's run.json, None where there is none; one that is not a run record is BadInput naming it."""
    path = Path(directory) / RUN_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: unreadable ({e}); repair or remove it") from None
    try:
        rec = json.loads(text)
    except ValueError as e:
        problem = f"not JSON ({e})"
    else:
        problem = record_problem(rec)
    if problem is not None:
        raise BadInput(
            f"{path}: not a run record ({problem}); repair it (the run's S3 copy is "
            f"{RUNS}/{Path(directory).name}/{RUN_FILE} under the checkpoint prefix) "
            f"or move the run out of {path.parent.parent}"
        )
    return rec


def record(
    stack: str, run: str, model: dict[str, Any], parent: tuple[str, int] | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "stack": stack,
        "run": run,
        "model_fingerprint": model_fingerprint(model),
        "model": model,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "created_ns": time.time_ns(),  # orders runs created within the same second
        "parent": None if parent is None else {"run": parent[0], "step": parent[1]},
        **extra,
    }


def write_record(directory: Path, rec: dict[str, Any]) -> None:
    """Write run.json once: a temporary file, fsynced, linked into place; an existing run.json is
    never replaced (FileExistsError)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{RUN_FILE}.{os.getpid()}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, directory / RUN_FILE)  # fails where run.json exists: written once
    finally:
        tmp.unlink()


def runs(out: Path) -> dict[str, dict[str, Any]]:
    """Every run in OUT/runs with a readable run.json, by run id."""
    root = Path(out) / RUNS
    found = {}
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        rec = read_record(d) if d.is_dir() else None
        if rec is not None:
            found[d.name] = rec
    return found


def latest_run(found: dict[str, dict[str, Any]]) -> str | None:
    """The run created last (run.json's created_ns, then its name)."""
    order = sorted(found, key=lambda r: (found[r].get("created_ns") or 0, r))
    return order[-1] if order else None


def describe(rec: dict[str, Any]) -> str:
    parent = rec.get("parent")
    origin = f", branched from run {parent['run']} step {parent['step']}" if isinstance(parent, dict) else ""
    return f"run {rec.get('run')} (stack {rec.get('stack')}, model {rec.get('model_fingerprint')}{origin})"


def run_of(out: Path, run: str | None = None) -> Path:
    """The directory of run `run` (default: the latest) of OUT: its metrics, plots and checkpoints;
    OUT itself where OUT holds no run (laid out as before run identities, or not trained yet)."""
    run = run or latest_run(runs(out))
    return run_dir(out, run) if run else Path(out)


def checkpoints_of(out: Path, run: str | None = None) -> Path:
    """Where run `run` (default: the latest) of OUT keeps its checkpoints (OUT/checkpoints before runs)."""
    return run_of(out, run) / CHECKPOINTS
