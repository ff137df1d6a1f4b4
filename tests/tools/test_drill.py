"""`supernode drill restore` end to end against a real moto server (fixture `moto_aws`): a real
checkpoint written by the local trainer is uploaded where the FSx association exports checkpoints,
restored into a fresh directory, verified with the trainer's own checksums and loaded into the plan's
model on CPU. Failures are injected in S3: a corrupted shard, a missing marker, a missing bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from test_verify import OUTPUTS

from supernode.cli import main
from supernode.core.config import from_mapping, load_stack
from supernode.core.plan import build_local_plan
from supernode.core.runs import checkpoints_of

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # the fixture trains for real (two gloo ranks)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The local trainer's committed checkpoint of step 2 (the dev stack's local plan, 2 ranks)."""
    from supernode.core.checkpoints import complete_checkpoints
    from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

    tmp = tmp_path_factory.mktemp("train")
    data = load_stack("dev", ROOT).to_mapping()
    data["local"]["training"].update({"warmupSteps": 1, "steps": 2, "checkpointInterval": 2})
    plan = build_local_plan("dev", from_mapping(data), 2)
    (tmp / "plan.json").write_text(plan.to_json(), encoding="utf-8")
    prepare(DEFAULT_CORPUS, tmp / "data", shard_tokens=1 << 16)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "supernode.trainer.train",
        "--plan",
        str(tmp / "plan.json"),
        "--data",
        str(tmp / "data"),
        "--out",
        str(tmp / "out"),
        "--steps",
        "2",
    ]
    run = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ((step, path),) = complete_checkpoints(checkpoints_of(tmp / "out"))[-1:]
    assert step == 2
    return path


def upload(stub, checkpoint: Path, tmp_path: Path, *, corrupt: str = "", skip: str = "") -> tuple[Path, str]:
    """The checkpoint in a fresh bucket under the dev stack's checkpoint prefix, as FSx exports it
    (`<prefix>checkpoints/step_N/...`), plus an older incomplete step; returns the outputs file."""
    bucket, prefix = stub.unique("sn-drill"), "checkpoints/dev/"
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    for f in sorted(checkpoint.iterdir()):
        if f.name == skip:
            continue
        body = f.read_bytes()
        if f.name == corrupt:
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        s3.put_object(Bucket=bucket, Key=f"{prefix}checkpoints/{checkpoint.name}/{f.name}", Body=body)
    s3.put_object(Bucket=bucket, Key=f"{prefix}checkpoints/step_00000009/.metadata", Body=b"uncommitted")
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({**OUTPUTS, "bucket_name": bucket, "checkpoint_prefix": prefix}), encoding="utf-8")
    return outputs, bucket


def drill(outputs: Path, tmp_path: Path, capsys, *flags: str) -> tuple[int, dict]:
    code = main(
        [
            "drill",
            "restore",
            "--stack",
            "dev",
            "--root",
            str(ROOT),
            "--local",
            "--outputs",
            str(outputs),
            "--dest",
            str(tmp_path / "restore"),
            "--json",
            *flags,
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1])


def test_restores_verifies_and_loads_the_newest_complete_checkpoint(moto_aws, checkpoint, tmp_path, capsys):
    outputs, bucket = upload(moto_aws, checkpoint, tmp_path)
    code, r = drill(outputs, tmp_path, capsys, "--keep")
    assert code == 0 and r["restore_drill"] == "passed", r
    assert r["step"] == 2 and r["source"] == f"s3://{bucket}/checkpoints/dev/checkpoints/step_00000002/"  # not step 9
    files = sorted(p.name for p in checkpoint.iterdir())
    restored = Path(r["restored_to"])
    assert sorted(p.name for p in restored.iterdir()) == files and r["files"] == len(files)
    assert r["bytes"] == sum(p.stat().st_size for p in checkpoint.iterdir()) and r["mb_per_s"] > 0
    assert r["loaded_tensors"] > 0 and r["load_s"] is not None and r["cluster_command"] == []
    assert restored.is_relative_to(tmp_path / "restore")


def test_restored_copy_is_removed_unless_kept(moto_aws, checkpoint, tmp_path, capsys):
    outputs, _ = upload(moto_aws, checkpoint, tmp_path)
    code, r = drill(outputs, tmp_path, capsys, "--no-load")
    assert code == 0 and r["loaded_tensors"] is None and not Path(r["restored_to"]).exists()


def test_a_corrupted_shard_fails_the_drill_naming_the_file(moto_aws, checkpoint, tmp_path, capsys):
    shard = next(p.name for p in sorted(checkpoint.iterdir()) if p.name.endswith(".distcp"))
    outputs, _ = upload(moto_aws, checkpoint, tmp_path, corrupt=shard)
    code, r = drill(outputs, tmp_path, capsys)
    assert code == 1 and r["restore_drill"] == "failed"
    assert shard in r["detail"] and "sha256" in r["detail"]


def test_no_complete_checkpoint_fails_the_drill(moto_aws, checkpoint, tmp_path, capsys):
    outputs, bucket = upload(moto_aws, checkpoint, tmp_path, skip="COMPLETE")
    code, r = drill(outputs, tmp_path, capsys)
    assert code == 1 and "no complete checkpoint" in r["detail"] and bucket in r["detail"]


def test_a_missing_bucket_is_a_failed_drill_in_one_line(moto_aws, checkpoint, tmp_path, capsys):
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({**OUTPUTS, "bucket_name": moto_aws.unique("absent")}), encoding="utf-8")
    code, r = drill(outputs, tmp_path, capsys)
    assert code == 1 and "NoSuchBucket" in r["detail"] and "Traceback" not in r["detail"]


def test_a_bad_outputs_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "outputs.json"
    bad.write_text("{", encoding="utf-8")
    assert main(["drill", "restore", "--stack", "dev", "--root", str(ROOT), "--outputs", str(bad)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_listed_older_step_is_restored_by_step_and_run(moto_aws, checkpoint, tmp_path, capsys):
    """The history's point: a milestone that is not the newest (here step 2, with step 4 newer in
    the same run and step 2 also in another run) is restored by --step and --run, and verifies."""
    outputs, bucket = upload(moto_aws, checkpoint, tmp_path)
    s3 = boto3.client("s3", region_name="us-east-1")
    for f in sorted(checkpoint.iterdir()):
        for key in ("checkpoints/step_00000004", "branch/checkpoints/step_00000002"):
            s3.put_object(Bucket=bucket, Key=f"checkpoints/dev/{key}/{f.name}", Body=f.read_bytes())
    code, r = drill(outputs, tmp_path, capsys, "--no-load")
    assert code == 0 and r["step"] == 4  # without --step: the newest

    code = main(["drill", "restore", "--stack", "dev", "--root", str(ROOT), "--outputs", str(outputs), "--step", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--step 2: several runs have it (branch/checkpoints, checkpoints)" in err

    code, r = drill(outputs, tmp_path, capsys, "--step", "2", "--run", "checkpoints")
    assert code == 0 and r["restore_drill"] == "passed" and r["loaded_tensors"] > 0
    assert r["step"] == 2 and r["source"] == f"s3://{bucket}/checkpoints/dev/checkpoints/step_00000002/"

    code, r = drill(outputs, tmp_path, capsys, "--step", "3", "--no-load")
    assert code == 1 and "no complete checkpoint of step 3" in r["detail"]


@pytest.mark.parametrize(
    "flags, message",
    [(["--run", "checkpoints"], "--run names the run of --step"), (["--step", "-1"], "--step -1: a step is a number")],
)
def test_bad_step_flags_exit_2(tmp_path, capsys, flags, message):
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps(OUTPUTS), encoding="utf-8")
    code = main(["drill", "restore", "--stack", "dev", "--root", str(ROOT), "--outputs", str(outputs), *flags])
    assert code == 2 and message in capsys.readouterr().err
