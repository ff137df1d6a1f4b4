"""`supernode checkpoints` against a real moto server: the history of runs and steps in S3, the
retention tags the bucket's lifecycle rules act on, and the FSx copy beside it. The objects are laid
out as the FSx association exports the trainer's checkpoints (`<prefix><run dir>/step_N/...`, a
COMPLETE marker listing every file's sha256); the drill's own test restores a real one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import boto3
import pytest

from supernode.cli import main
from supernode.core.config import load_stack
from supernode.core.errors import BadInput
from supernode.core.files import CHECKPOINT_RETENTION_TAG
from supernode.core.plan import build_local_plan

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "checkpoints/dev/"
FILES = {"__0_0.distcp": b"rank 0 shard", "__1_0.distcp": b"rank 1 shard", ".metadata": b"dcp metadata"}


def write_step(s3, bucket: str, run: str, step: int, *, drop: str = "", marker: bool = True) -> None:
    key = f"{PREFIX}{run}/step_{step:08d}/"
    for name, body in FILES.items():
        if name != drop:
            s3.put_object(Bucket=bucket, Key=key + name, Body=body + str(step).encode())
    if marker:
        digests = {n: hashlib.sha256(b + str(step).encode()).hexdigest() for n, b in FILES.items()}
        s3.put_object(Bucket=bucket, Key=key + "COMPLETE", Body=json.dumps({"step": step, "files": digests}).encode())


def write_fsx_step(root: Path, run: str, step: int) -> None:
    d = root / run / f"step_{step:08d}"
    d.mkdir(parents=True)
    for name, body in FILES.items():
        (d / name).write_bytes(body + str(step).encode())
    digests = {n: hashlib.sha256(b + str(step).encode()).hexdigest() for n, b in FILES.items()}
    (d / "COMPLETE").write_text(json.dumps({"step": step, "files": digests}), encoding="utf-8")


@pytest.fixture
def history(moto_aws, tmp_path) -> tuple[str, Path, int]:
    """Run `checkpoints` committed every `interval` steps up to 12 intervals, pruned on FSx to the
    newest 3 (keepCheckpoints) while S3 kept all; step 13's export is partial (no marker); a second
    run `branch` has two steps, one missing a shard."""
    interval = build_local_plan("dev", load_stack("dev", ROOT)).training.checkpoint_interval
    bucket = moto_aws.unique("sn-ckpt")
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    fsx = tmp_path / "fsx"
    for i in range(1, 13):
        write_step(s3, bucket, "checkpoints", i * interval)
    for i in (10, 11, 12):
        write_fsx_step(fsx, "checkpoints", i * interval)
    write_step(s3, bucket, "checkpoints", 13 * interval, marker=False)
    write_step(s3, bucket, "branch/checkpoints", interval)
    write_step(s3, bucket, "branch/checkpoints", 2 * interval, drop="__1_0.distcp")
    return bucket, fsx, interval


def checkpoints(capsys, bucket: str, *flags: str) -> tuple[int, list[dict]]:
    code = main(["checkpoints", "--stack", "dev", "--root", str(ROOT), "--local", "--bucket", bucket, "--json", *flags])
    return code, [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def tag_of(bucket: str, key: str) -> str:
    tags = boto3.client("s3", region_name="us-east-1").get_object_tagging(Bucket=bucket, Key=key)["TagSet"]
    return next((t["Value"] for t in tags if t["Key"] == CHECKPOINT_RETENTION_TAG), "")


def test_lists_every_run_and_step_with_its_state_and_the_fsx_copy(history, capsys):
    bucket, fsx, interval = history
    code, lines = checkpoints(capsys, bucket, "--fsx", str(fsx))
    assert code == 0
    by = {(s["run"], s["step"]): s for s in lines}
    assert sorted(by) == sorted(
        [("checkpoints", i * interval) for i in range(1, 14)] + [("branch/checkpoints", interval * k) for k in (1, 2)]
    )
    assert all(by[("checkpoints", i * interval)]["check"] == "complete" for i in range(1, 13))
    assert "no COMPLETE marker" in by[("checkpoints", 13 * interval)]["check"]
    assert by[("branch/checkpoints", 2 * interval)]["check"].startswith("1 of 3 files missing (e.g. __1_0.distcp)")
    # FSx holds the newest three (the trainer pruned the rest); S3 holds them all
    assert [s["step"] // interval for s in lines if s["run"] == "checkpoints" and s["fsx"] == "complete"] == [
        10,
        11,
        12,
    ]
    assert by[("checkpoints", interval)]["fsx"] == "absent"
    assert by[("checkpoints", interval)]["objects"] == 4 and by[("checkpoints", interval)]["retention"] == ""


def test_retain_tags_milestones_and_the_newest_and_leaves_incomplete_steps_untagged(history, capsys):
    bucket, _, interval = history
    every = load_stack("dev", ROOT).storage.lifecycle.checkpoint_milestone_every
    code, lines = checkpoints(capsys, bucket, "--retain", "--dry-run")
    assert code == 0 and lines[-1]["dry_run"] is True and lines[-1]["retention_changes"]
    assert tag_of(bucket, f"{PREFIX}checkpoints/step_{interval:08d}/COMPLETE") == ""  # a dry run tags nothing

    code, lines = checkpoints(capsys, bucket, "--retain")
    changes = {(c["run"], c["step"]): c["to"] for c in lines[-1]["retention_changes"]}
    milestones = {i * interval for i in range(1, 13) if i % every == 0} | {12 * interval}
    assert {s for (r, s), t in changes.items() if r == "checkpoints" and t == "milestone"} == milestones
    assert {s for (r, s), t in changes.items() if r == "checkpoints" and t == "window"} == {
        i * interval for i in range(1, 13)
    } - milestones
    # the incomplete ones are not judged: kept, never expired by a rule
    assert ("checkpoints", 13 * interval) not in changes and ("branch/checkpoints", 2 * interval) not in changes
    assert changes[("branch/checkpoints", interval)] == "milestone"  # that run's newest complete step
    for name in [*FILES, "COMPLETE"]:  # every object of a step carries its tag, not only the marker
        assert tag_of(bucket, f"{PREFIX}checkpoints/step_{12 * interval:08d}/{name}") == "milestone"
    assert tag_of(bucket, f"{PREFIX}checkpoints/step_{interval:08d}/__0_0.distcp") == "window"

    code, lines = checkpoints(capsys, bucket, "--retain")  # idempotent: nothing left to change
    assert code == 0 and lines[-1]["retention_changes"] == []


def test_a_newer_step_turns_the_old_newest_into_a_window_checkpoint(history, capsys):
    bucket, _, interval = history
    checkpoints(capsys, bucket, "--retain")
    s3 = boto3.client("s3", region_name="us-east-1")
    write_step(s3, bucket, "checkpoints", 14 * interval)  # the run went on
    _, lines = checkpoints(capsys, bucket, "--retain")
    changes = {c["step"]: (c["from"], c["to"]) for c in lines[-1]["retention_changes"]}
    every = load_stack("dev", ROOT).storage.lifecycle.checkpoint_milestone_every
    assert changes[14 * interval] == ("untagged", "milestone")
    if 12 % every:  # step 12 was a milestone only as the newest
        assert changes[12 * interval] == ("milestone", "window")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dry-run"], "--dry-run goes with --retain"),
        (["--fsx", "/nonexistent/fsx"], "--fsx /nonexistent/fsx: not a directory"),
    ],
)
def test_bad_flags_are_exit_2_naming_the_flag(moto_aws, capsys, flags, message):
    code = main(["checkpoints", "--stack", "dev", "--root", str(ROOT), "--bucket", "b", *flags])
    assert code == 2 and message in capsys.readouterr().err


def test_a_missing_bucket_is_one_line_and_exit_1(moto_aws, capsys):
    code = main(["checkpoints", "--stack", "dev", "--root", str(ROOT), "--bucket", "sn-no-such-bucket"])
    err = capsys.readouterr().err
    assert code == 1 and "sn-no-such-bucket" in err and "Traceback" not in err


def test_runs_are_listed_by_their_identity_and_the_drill_finds_a_step_by_run_id(moto_aws, capsys):
    """OUT/runs/<id>/ exports as `<prefix>runs/<id>/` with its run.json: a run is listed by its id,
    stack, model fingerprint and parent; a legacy `checkpoints` directory alongside has no identity."""
    from supernode.core import runs
    from supernode.tools.drill import latest_checkpoint

    bucket = moto_aws.unique("sn-runs")
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    model = {"dim": 64, "top_k": 2}
    base = runs.record("dev", "base", model)
    branch = runs.record("dev", "lr-low", model, parent=("base", 2))
    for rec in (base, branch):
        s3.put_object(Bucket=bucket, Key=f"{PREFIX}runs/{rec['run']}/run.json", Body=json.dumps(rec).encode())
    for run, step in (("runs/base/checkpoints", 2), ("runs/base/checkpoints", 4), ("runs/lr-low/checkpoints", 4)):
        write_step(s3, bucket, run, step)
    write_step(s3, bucket, "checkpoints", 4)

    code, lines = checkpoints(capsys, bucket)
    assert code == 0
    got = {(s["run"], s["step"]): (s["directory"], s["stack"], s["model_fingerprint"], s["parent"]) for s in lines}
    fingerprint = runs.model_fingerprint(model)
    assert got == {
        ("base", 2): ("runs/base/checkpoints", "dev", fingerprint, ""),
        ("base", 4): ("runs/base/checkpoints", "dev", fingerprint, ""),
        ("lr-low", 4): ("runs/lr-low/checkpoints", "dev", fingerprint, "base@2"),
        ("checkpoints", 4): ("checkpoints", "", "", ""),
    }
    main(["checkpoints", "--stack", "dev", "--root", str(ROOT), "--local", "--bucket", bucket])
    text = capsys.readouterr().out
    assert f"  run lr-low: stack dev, model {fingerprint}, branched from base step 2\n    step 4: 4 objects" in text
    assert "  run checkpoints: checkpoints/ (no run.json: a run from before run identities)" in text

    # --retain judges each run by its id: each run's newest is its milestone
    code, lines = checkpoints(capsys, bucket, "--retain", "--dry-run")
    changes = {(c["run"], c["step"]): c["to"] for c in lines[-1]["retention_changes"]}
    assert changes[("base", 4)] == changes[("lr-low", 4)] == changes[("checkpoints", 4)] == "milestone"

    assert latest_checkpoint(s3, bucket, PREFIX, 4, "lr-low") == (4, f"{PREFIX}runs/lr-low/checkpoints/step_00000004/")
    assert latest_checkpoint(s3, bucket, PREFIX, 2, "runs/base/checkpoints")[0] == 2  # the directory still works
    with pytest.raises(BadInput, match=r"--step 4: several runs have it \(base, checkpoints, lr-low\)"):
        latest_checkpoint(s3, bucket, PREFIX, 4)


def test_lying_run_records_and_markers_in_s3_are_listed_as_such_not_a_traceback(moto_aws, capsys):
    """Issue 41 (hostile S3): a run.json whose parent points outside the runs and whose creation time
    is text, a COMPLETE marker that is not JSON, a run directory named with a space. Each step is
    listed; the lying identity is none, the garbage marker is not complete."""
    bucket = moto_aws.unique("sn-lies")
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    lie = {"stack": "dev", "run": "liar", "model_fingerprint": "f" * 16, "model": {}, "created_ns": "soon"}
    lie["parent"] = {"run": "../../elsewhere", "step": 1}
    s3.put_object(Bucket=bucket, Key=f"{PREFIX}runs/liar/run.json", Body=json.dumps(lie).encode())
    write_step(s3, bucket, "runs/liar/checkpoints", 2)
    write_step(s3, bucket, "runs/odd name/checkpoints", 2)
    write_step(s3, bucket, "runs/garbled/checkpoints", 2)
    s3.put_object(Bucket=bucket, Key=f"{PREFIX}runs/garbled/checkpoints/step_00000002/COMPLETE", Body=b"\xff{not json")
    code, lines = checkpoints(capsys, bucket)
    assert code == 0
    got = {(s["run"], s["step"]): (s["check"], s["stack"], s["parent"]) for s in lines}
    assert got == {
        ("liar", 2): ("complete", "", ""),
        ("odd name", 2): ("complete", "", ""),
        ("garbled", 2): ("COMPLETE marker is not JSON", "", ""),
    }
