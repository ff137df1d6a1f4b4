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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoints import COMPLETE, PREFIX, complete_checkpoints, read_marker
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


# -- which run a start trains into ---------------------------------------------------------------


@dataclass
class RunChoice:
    """The run a start trains into (supernode.core.runs): its directory and run.json, and, for a
    branch that has no checkpoint of its own yet, the parent's step it starts from."""

    run: str
    dir: Path
    record: dict
    how: str  # "new" | "resumed" | "branched"
    parent_step: Path | None = None

    @property
    def checkpoints(self) -> Path:
        return self.dir / CHECKPOINTS

    def line(self) -> str:
        return f"{self.how} {describe(self.record)} in {self.dir}"


def _mismatch(who: str, rec: dict, model: dict, fix: str) -> BadInput:
    theirs = rec.get("model") if isinstance(rec.get("model"), dict) else {}
    diff = model_differences(theirs, model) or "settings not recorded"
    return BadInput(
        f"{who} was written for another model ({diff}), model fingerprint {rec.get('model_fingerprint')} -> "
        f"{model_fingerprint(model)}; {fix}"
    )


def _migrate_legacy(out: Path, stack: str, model: dict, target: str, say: Callable[[str], None]) -> None:
    """OUT/checkpoints (before run identities) becomes the run `target`: one rename on the same file
    system, then its run.json with the model of its newest marker. Its S3 copy stays where it was
    exported (run `checkpoints` in `supernode checkpoints`); the renamed files are exported anew."""
    legacy = Path(out) / CHECKPOINTS
    newest = complete_checkpoints(legacy)
    theirs = read_marker(newest[-1][1]).get("model") if newest else None
    d = run_dir(out, target)
    d.mkdir(parents=True, exist_ok=True)
    if read_record(d) is None:
        rec = record(stack, target, theirs if isinstance(theirs, dict) else model, migrated_from=str(legacy))
        write_record(d, rec)  # before the rename: a crash between leaves a run to migrate into again
    os.replace(legacy, d / CHECKPOINTS)
    say(f"{legacy} (written before run identities) is now run {target}: {d / CHECKPOINTS}")


def _has_legacy(out: Path) -> bool:
    legacy = Path(out) / CHECKPOINTS
    return legacy.is_dir() and any(legacy.glob(PREFIX + "*"))


def _check_run_flags(run: str | None, from_run: str | None, step: int | None, run_flag: str) -> None:
    """The flags alone: --step and --from-run together, a step of at least 1, run names well formed."""
    if step is not None and from_run is None:
        raise BadInput(f"--step {step} goes with --from-run (the run whose step a new run starts from)")
    if from_run is not None and step is None:
        raise BadInput(f"--from-run {from_run} needs --step N (the step of {from_run} to start from)")
    if step is not None and step < 1:
        raise BadInput(f"--step {step}: a checkpoint's step is at least 1")
    for flag, value in ((run_flag, run), ("--from-run", from_run)):
        if value is not None:
            check_run_id(flag, value)


def _migrated_runs(
    out: Path,
    stack: str,
    model: dict,
    run: str | None,
    from_run: str | None,
    found: dict[str, dict[str, Any]],
    say: Callable[[str], None],
) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The runs and the run asked for, once OUT/checkpoints (before run identities) is a run: the one
    a migration interrupted, else the named new run, else a fresh id; a start that names no run
    trains into the migrated one."""
    if not _has_legacy(out):
        return found, run
    pending = [
        r for r, rec in found.items() if rec.get("migrated_from") and not (out / RUNS / r / CHECKPOINTS).exists()
    ]
    target = pending[0] if pending else run if run and run not in found and from_run is None else new_run_id()
    _migrate_legacy(out, stack, model, target, say)
    found = runs(out)
    if run is None and from_run is None:
        run = target
    return found, run


def _branch_parent(
    out: Path,
    found: dict[str, dict[str, Any]],
    model: dict,
    run: str | None,
    from_run: str,
    step: int,
    run_flag: str,
) -> tuple[str, int]:
    """The parent (run, step) of a branch, checked: a run of this model with that complete step, and
    a new run name (or the branch's own, to resume it)."""
    if from_run not in found:
        raise BadInput(f"--from-run {from_run}: no such run in {out / RUNS} (runs: {', '.join(found) or 'none'})")
    if found[from_run].get("model_fingerprint") != model_fingerprint(model):
        raise _mismatch(
            f"--from-run {from_run}: run {from_run}",
            found[from_run],
            model,
            "branch from a run of this model, or train this plan as a fresh run (--run new)",
        )
    have = [s for s, _ in complete_checkpoints(run_dir(out, from_run) / CHECKPOINTS)]
    if step not in have:
        raise BadInput(
            f"--step {step}: run {from_run} has no complete checkpoint of step {step} on this file system "
            f"(it has {', '.join(map(str, have)) or 'none'}; `supernode checkpoints` lists the steps S3 keeps)"
        )
    if run is None:
        raise BadInput(f"--from-run {from_run} needs {run_flag} NAME: the new run's name (`supernode train` gives one)")
    if run in found and found[run].get("parent") != {"run": from_run, "step": step}:
        rec = found[run]
        raise BadInput(
            f"{run_flag} {run}: {describe(rec)} exists; give a new name to branch from "
            f"{from_run} step {step}, or drop --from-run and --step to resume it"
        )
    return from_run, step


def _open_run(
    out: Path,
    stack: str,
    model: dict,
    run: str | None,
    found: dict[str, dict[str, Any]],
    parent: tuple[str, int] | None,
    run_flag: str,
) -> RunChoice:
    """The run resumed (of this model), or created with its run.json; no `run`: the latest run, or a
    fresh one where OUT has none."""
    who = f"{run_flag} {run}: run {run}"
    if run is None:
        run = latest_run(found) or new_run_id()
        who = f"run {run} (the latest in {out / RUNS})"
    d = run_dir(out, run)
    if run in found:
        rec, how = found[run], "resumed"
        if rec.get("model_fingerprint") != model_fingerprint(model):
            raise _mismatch(
                who,
                rec,
                model,
                "resume it with the plan that wrote it, or start a fresh run (--run new)",
            )
    else:
        rec, how = record(stack, run, model, parent), "branched" if parent else "new"
        try:
            write_record(d, rec)
        except FileExistsError:  # written since we listed: it is the run's own record
            rec = read_record(d) or rec
    return RunChoice(run, d, rec, how)


def _starting_point(out: Path, choice: RunChoice, run_flag: str) -> RunChoice:
    """A run with no checkpoint of its own yet starts now: new, or branched from its parent's step,
    which must still be complete."""
    origin = choice.record.get("parent")
    if not complete_checkpoints(choice.checkpoints):  # nothing of its own yet: it starts now
        choice.how = "branched" if isinstance(origin, dict) else "new"
    if isinstance(origin, dict) and not complete_checkpoints(choice.checkpoints):
        step_dir = run_dir(out, str(origin["run"])) / CHECKPOINTS / f"{PREFIX}{int(origin['step']):08d}"
        if not (step_dir / COMPLETE).is_file():
            raise BadInput(
                f"{run_flag} {choice.run}: it starts from run {origin['run']} step {origin['step']}, and {step_dir} is "
                "not a complete checkpoint any more; restore it (supernode drill restore --keep) or start a fresh run"
            )
        choice.parent_step = step_dir
    return choice


def prepare_run(
    out: Path,
    stack: str,
    model: dict,
    run: str | None = None,
    from_run: str | None = None,
    step: int | None = None,
    say: Callable[[str], None] = print,
    run_flag: str = "--run",
) -> RunChoice:
    """The run this start trains into, created (run.json) where new. The caller holds OUT's lock.

    - no `run`: the latest run (newest run.json), or a fresh one where OUT has none;
    - `run` NAME: that run resumed, or a fresh one of that name;
    - `from_run` R, `step` N (with `run`, a name not in use): a fresh run starting from R's step N,
      recording R and N as its parent; the same three again resume it (a restart).
    `run_flag`: how the caller spells `run` in its messages. Every refusal (a name not a run name,
    an unknown run, a step the run does not have, a run of another model) is BadInput naming the flag
    and its value."""
    out = Path(out)
    _check_run_flags(run, from_run, step, run_flag)
    found, run = _migrated_runs(out, stack, model, run, from_run, runs(out), say)
    parent: tuple[str, int] | None = None
    if from_run is not None and step is not None:
        parent = _branch_parent(out, found, model, run, from_run, step, run_flag)
    return _starting_point(out, _open_run(out, stack, model, run, found, parent, run_flag), run_flag)
