"""Issue 28's checkpoint history end to end, against a real moto server (fixture `moto_aws`): the
local trainer runs for real in three invocations, pruning its OUT (the FSx stand-in) to
`keepCheckpoints` 3; after each, OUT is exported to S3 the way the FSx data repository association
exports it (new and changed files, never a deletion). In the end FSx holds the newest 3 steps, S3
holds every step, `supernode checkpoints --retain` tags the milestones, and `supernode drill
restore` brings back a milestone no longer on FSx, verified against its checksums, and loads it.

A second bucket, exported as the association did before issue 28 (deletions too), is the control:
the same run there has lost its milestone, so the assertions on the first bucket can fail."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import boto3
import pytest
import yaml
from test_checkpoints import tag_of
from test_verify import OUTPUTS

from supernode.cli import main
from supernode.core import runs
from supernode.core.config import load_file

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "checkpoints/dev/"  # the dev stack's storage.checkpointPrefix, where the association exports OUT
KEEP, EVERY = 3, 2  # local.training.keepCheckpoints; storage.lifecycle.checkpointMilestoneEvery
INVOCATIONS = (2, 4, 5)  # --steps of each `supernode train` (each resumes the run the last one left)
pytestmark = pytest.mark.slow  # three real training runs (two gloo ranks each)


def stack_file(tmp_path: Path) -> Path:
    """The dev stack with a checkpoint every step, 3 kept on FSx, every 2nd a milestone in S3."""
    doc = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text(encoding="utf-8"))
    config = doc["config"]
    config["supernode:local"]["training"].update({"checkpointInterval": 1, "keepCheckpoints": KEEP, "warmupSteps": 1})
    config["supernode:storage"]["lifecycle"] = {"checkpointMilestoneEvery": EVERY}
    path = tmp_path / "stack" / "Pulumi.dev.yaml"  # named so the stack is still `dev`
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def export(s3, bucket: str, out: Path, *, deletes: bool = False) -> list[str]:
    """The FSx data repository association's automatic export of OUT/runs (the trainer's runs) to
    `<bucket>/<prefix>`: NEW and CHANGED files only (components/aws/storage.py CHECKPOINT_EVENTS),
    never a deletion, so a checkpoint the trainer prunes stays in S3. `deletes=True` adds the
    DELETED event (the mirror issue 28 replaced). Returns the keys written."""
    local = {f"{PREFIX}{p.relative_to(out).as_posix()}": p for p in sorted((out / runs.RUNS).rglob("*")) if p.is_file()}
    remote = {
        o["Key"]: o["ETag"].strip('"')
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=PREFIX)
        for o in page.get("Contents", [])
    }
    written = []
    for key, path in local.items():
        body = path.read_bytes()
        if remote.get(key) != hashlib.md5(body).hexdigest():  # a single-part upload's ETag is its MD5
            s3.put_object(Bucket=bucket, Key=key, Body=body)
            written.append(key)
    for key in sorted(set(remote) - set(local)) if deletes else []:
        s3.delete_object(Bucket=bucket, Key=key)
    return written


def steps_in(keys, run_id: str) -> set[int]:
    marker = f"{PREFIX}{runs.RUNS}/{run_id}/{runs.CHECKPOINTS}/step_"
    return {int(k[len(marker) :].split("/")[0]) for k in keys if k.startswith(marker) and k.endswith("/COMPLETE")}


def keys_of(s3, bucket: str) -> list[str]:
    return [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=PREFIX)
        for o in page.get("Contents", [])
    ]


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_a_run_pruned_on_fsx_keeps_its_milestones_in_s3_and_the_drill_restores_one(moto_aws, tmp_path, capsys):
    config, out = stack_file(tmp_path), tmp_path / "fsx"
    assert load_file(config).storage.lifecycle.checkpoint_milestone_every == EVERY  # what the commands read
    s3 = boto3.client("s3", region_name="us-east-1")
    # The export writes to moto itself, not through the stub: the stub answers HTTP/1.0 and never
    # sends `100 Continue`, so each PutObject through it waits out botocore's 1 s Expect timeout.
    fsx_export = boto3.client("s3", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{moto_aws.moto_port}")
    bucket, mirror = moto_aws.unique("sn-history"), moto_aws.unique("sn-mirror")
    for b in (bucket, mirror):
        s3.create_bucket(Bucket=b)

    exported: list[list[str]] = []
    on_fsx: list[set[int]] = []
    step2: dict[str, str] = {}
    for steps in INVOCATIONS:
        code = main(
            ["train", "--config", str(config), "--local", "--nproc", "2", "--steps", str(steps), "--out", str(out)]
        )
        capsys.readouterr()
        assert code == 0, f"supernode train --steps {steps} exited {code}"
        found = runs.runs(out)
        assert len(found) == 1, f"--steps {steps} started another run: {sorted(found)}"  # each resumes the run
        ((run_id, record),) = found.items()
        ckpts = runs.checkpoints_of(out, run_id)
        on_fsx.append({int(d.name.removeprefix("step_")) for d in ckpts.iterdir() if (d / "COMPLETE").is_file()})
        if not step2 and (ckpts / "step_00000002").is_dir():
            step2 = digests(ckpts / "step_00000002")  # what the trainer wrote, while FSx has it
        exported.append(export(fsx_export, bucket, out))
        export(fsx_export, mirror, out, deletes=True)

    # FSx: the trainer pruned to the newest KEEP after each invocation
    assert on_fsx == [{1, 2}, {2, 3, 4}, {3, 4, 5}]
    assert not (ckpts / "step_00000002").exists() and step2  # the milestone is gone from FSx ...
    # ... and S3 has every step, under the run's identity as run.json says it
    assert record["run"] == run_id and record["stack"] == "dev"
    keys = keys_of(s3, bucket)
    assert f"{PREFIX}{runs.RUNS}/{run_id}/{runs.RUN_FILE}" in keys
    assert {k.split("/")[3] for k in keys if k.startswith(f"{PREFIX}{runs.RUNS}/")} == {run_id}
    assert steps_in(keys, run_id) == {1, 2, 3, 4, 5}
    # the export wrote only what was new or changed: a resumed run never rewrites an old checkpoint
    assert [steps_in(written, run_id) for written in exported] == [{1, 2}, {3, 4}, {5}]
    assert not [k for k in exported[1] + exported[2] if "/step_00000001/" in k or "/step_00000002/" in k]
    # the control: an export that deletes has lost steps 1 and 2 with FSx
    assert steps_in(keys_of(s3, mirror), run_id) == {3, 4, 5}

    base = ["checkpoints", "--config", str(config), "--local", "--bucket", bucket, "--json"]
    assert main([*base, "--fsx", str(out)]) == 0
    listed = {s["step"]: s for s in map(json.loads, capsys.readouterr().out.splitlines())}
    assert sorted(listed) == [1, 2, 3, 4, 5]
    for step, s in listed.items():
        assert (s["run"], s["directory"]) == (run_id, f"{runs.RUNS}/{run_id}/{runs.CHECKPOINTS}")
        assert (s["stack"], s["model_fingerprint"]) == ("dev", record["model_fingerprint"])
        assert s["check"] == "complete" and s["fsx"] == ("complete" if step in on_fsx[-1] else "absent"), s

    assert main([*base, "--retain"]) == 0
    changes = {c["step"]: c["to"] for c in json.loads(capsys.readouterr().out.splitlines()[-1])["retention_changes"]}
    # every EVERY-th step (interval 1) and the run's newest are milestones; the rest the expiring window
    assert changes == {1: "window", 2: "milestone", 3: "window", 4: "milestone", 5: "milestone"}
    step_prefix = f"{PREFIX}{runs.RUNS}/{run_id}/{runs.CHECKPOINTS}/step_00000002/"
    assert {tag_of(bucket, step_prefix + name) for name in step2} == {"milestone"}

    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({**OUTPUTS, "bucket_name": bucket, "checkpoint_prefix": PREFIX}), encoding="utf-8")
    drill = ["drill", "restore", "--config", str(config), "--local", "--outputs", str(outputs), "--json"]
    code = main([*drill, "--step", "2", "--run", run_id, "--dest", str(tmp_path / "restore"), "--keep"])
    r = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 0 and r["restore_drill"] == "passed", r
    assert r["step"] == 2 and r["source"] == f"s3://{bucket}/{step_prefix}"
    assert digests(Path(r["restored_to"])) == step2  # byte for byte what the trainer committed at step 2
    assert r["files"] == len(step2) and r["loaded_tensors"] > 0  # verified (sha256), then loaded

    # the control again: from the deleting mirror the same drill finds nothing to restore
    mirror_outputs = tmp_path / "mirror.json"
    mirror_outputs.write_text(
        json.dumps({**OUTPUTS, "bucket_name": mirror, "checkpoint_prefix": PREFIX}), encoding="utf-8"
    )
    drill[drill.index(str(outputs))] = str(mirror_outputs)
    code = main([*drill, "--step", "2", "--run", run_id, "--no-load"])
    r = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 1 and f"no complete checkpoint of step 2 in run {run_id}" in r["detail"]
