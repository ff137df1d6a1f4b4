"""The checkpoint history in S3: which runs and steps exist, where each copy lives, and which of
them S3 keeps ("检查点目录按任务与版本组织" and the backup / restore drill of the seeds).

FSx holds each run's newest `training.keepCheckpoints` (the trainer prunes the rest). The data
repository association exports new and changed files to S3 and never a deletion
(components/aws/storage.py), so a prune on FSx leaves S3 alone: S3 holds every checkpoint the
trainer committed until the retention below lets it go. Retention is a tag on every object of a
step, which the bucket's lifecycle rules act on (nothing here deletes):

- `milestone`: every `storage.lifecycle.checkpointMilestoneEvery`-th checkpoint of a run (by step)
  and the run's newest: tiered to Glacier IR, never expired;
- `window`: the others: tiered, then expired after `checkpointExpireDays`;
- untagged: not judged yet (exported since the last `--retain`): kept, whatever its age.

A run is named by its identity (supernode.core.runs): the trainer writes OUT/runs/<run id>/ with
its run.json (stack, run id, model fingerprint, parent) and checkpoints/step_N/, which the
association exports to `<prefix>runs/<run id>/`; such a run is listed by its id, with the stack,
fingerprint and parent its run.json says. Any other directory holding `step_N/` directories (OUT/
checkpoints of a run from before run identities exports as `checkpoints`) is a run named by that
directory, relative to the prefix, with no identity. A step's objects are tagged before its
COMPLETE marker, so the marker's tag says the whole step carries it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core import runs
from ..core.files import CHECKPOINT_RETENTION_TAG, MILESTONE, WINDOW

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^(?P<run>(?:.*/)?)step_(?P<step>\d{8})/(?P<name>[^/]+)$")
RUN_DIR = re.compile(rf"^{runs.RUNS}/(?P<run>[^/]+)/{runs.CHECKPOINTS}$")


def run_name(directory: str) -> str:
    """A run's name from the directory holding its step_N/ (relative to the checkpoint prefix): the
    run id of `runs/<id>/checkpoints`, else the directory itself (a layout from before run ids)."""
    m = RUN_DIR.fullmatch(directory)
    return m["run"] if m else directory


@dataclass
class StepCopy:
    """One step of one run in S3 (and, when asked, on FSx)."""

    run: str  # the run id, or the directory for a run without one
    step: int
    key_prefix: str
    objects: int
    bytes: int
    check: str  # "complete": marker and every file it lists present; else what is wrong
    retention: str  # the marker's tag: milestone | window | "" (not judged yet)
    fsx: str = ""  # "complete" | "absent" | what is wrong, when an FSx root was given
    directory: str = ""  # the directory holding step_N/, relative to the prefix
    stack: str = ""  # the run's identity (run.json); "" for a run without one
    model_fingerprint: str = ""
    parent: str = ""  # "RUN@STEP" of a branched run

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _objects(s3: Any, bucket: str, prefix: str) -> dict[tuple[str, int], dict[str, int]]:
    """(run, step) -> {file name: size} for every object under `prefix` inside a step_N/ directory."""
    found: dict[tuple[str, int], dict[str, int]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            m = STEP_DIR.fullmatch(obj["Key"][len(prefix) :])
            if m:
                found.setdefault((m["run"].rstrip("/"), int(m["step"])), {})[m["name"]] = obj["Size"]
    return found


def _check(listed: Any, present: set[str]) -> str:
    if not isinstance(listed, dict):
        return "marker records no files"
    missing = sorted(set(listed) - present)
    return "complete" if not missing else f"{len(missing)} of {len(listed)} files missing (e.g. {missing[0]})"


def _fsx_check(root: Path, directory: str, step: int) -> str:
    d = root / directory / f"step_{step:08d}"
    if not d.is_dir():
        return "absent"
    try:
        listed = json.loads((d / COMPLETE).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return "no readable marker"
    return _check(listed, {p.name for p in d.iterdir()})


def inventory(s3: Any, bucket: str, prefix: str, fsx_root: Path | None = None) -> list[StepCopy]:
    """Every run and step under s3://bucket/prefix, oldest first, with its completeness, its
    retention tag and (with `fsx_root`, where FSx is mounted) the state of the FSx copy."""
    steps = []
    identities: dict[str, dict] = {}
    for (directory, step), files in sorted(_objects(s3, bucket, prefix).items()):
        key_prefix = f"{prefix}{directory + '/' if directory else ''}step_{step:08d}/"
        run = run_name(directory)
        if run != directory and directory not in identities:
            identities[directory] = _identity(s3, bucket, f"{prefix}{runs.RUNS}/{run}/{runs.RUN_FILE}")
        who = identities.get(directory, {})
        parent = who.get("parent")
        check, retention = "no COMPLETE marker (uncommitted or partly exported)", ""
        if COMPLETE in files:
            try:
                marker = json.loads(s3.get_object(Bucket=bucket, Key=key_prefix + COMPLETE)["Body"].read())
            except ValueError:
                check = "COMPLETE marker is not JSON"
            else:
                check = _check(marker.get("files") if isinstance(marker, dict) else None, set(files))
            tags = s3.get_object_tagging(Bucket=bucket, Key=key_prefix + COMPLETE)["TagSet"]
            retention = next((t["Value"] for t in tags if t["Key"] == CHECKPOINT_RETENTION_TAG), "")
        steps.append(
            StepCopy(
                run=run,
                step=step,
                key_prefix=key_prefix,
                objects=len(files),
                bytes=sum(files.values()),
                check=check,
                retention=retention,
                fsx=_fsx_check(fsx_root, directory, step) if fsx_root is not None else "",
                directory=directory,
                stack=str(who.get("stack", "")),
                model_fingerprint=str(who.get("model_fingerprint", "")),
                parent=f"{parent['run']}@{parent['step']}" if isinstance(parent, dict) else "",
            )
        )
    return steps


def _identity(s3: Any, bucket: str, key: str) -> dict:
    """A run's run.json in S3, or {} where it is missing or not a run record (the steps are listed all the same)."""
    try:
        rec = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except (s3.exceptions.NoSuchKey, ValueError):
        return {}
    return rec if runs.record_problem(rec) is None else {}


def retention_class(copy: StepCopy, newest: int, interval: int, every: int) -> str | None:
    """What S3 keeps this step as, or None for a step that is not a complete checkpoint (left
    untagged: kept until a person looks, never expired by a rule)."""
    if copy.check != "complete":
        return None
    if copy.step == newest or (copy.step % interval == 0 and (copy.step // interval) % every == 0):
        return MILESTONE
    return WINDOW


def retain(s3: Any, bucket: str, steps: list[StepCopy], interval: int, every: int, dry_run: bool = False) -> list[dict]:
    """Tag every complete step with its retention class where the tag differs; returns the changes.
    The marker is tagged last, so an interrupted run leaves the step to be tagged again next time."""
    newest: dict[str, int] = {}
    for c in steps:
        if c.check == "complete":
            newest[c.run] = max(newest.get(c.run, 0), c.step)
    changes = []
    for c in steps:
        want = retention_class(c, newest.get(c.run, -1), interval, every)
        if want is None or want == c.retention:
            continue
        changes.append({"run": c.run, "step": c.step, "from": c.retention or "untagged", "to": want})
        if dry_run:
            continue
        keys = [
            obj["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=c.key_prefix)
            for obj in page.get("Contents", [])
        ]
        marker = c.key_prefix + COMPLETE
        for key in sorted(keys, key=lambda k: k == marker):
            s3.put_object_tagging(
                Bucket=bucket, Key=key, Tagging={"TagSet": [{"Key": CHECKPOINT_RETENTION_TAG, "Value": want}]}
            )
        c.retention = want
    return changes
