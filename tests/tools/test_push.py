"""`supernode data push` and `supernode model push` against a real moto server (fixture `moto_aws`,
conftest.py): multipart uploads with the sha256 in metadata, an interrupted push that resumes, the
manifest last, and a pushed export that the serving pods' own verify script accepts."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import pytest
import yaml

from supernode.cli import main
from supernode.tools.push import base_key, dataset_objects, export_objects
from supernode.tools.push import push as push_objects
from supernode.trainer.data.prepare import DEFAULT_CORPUS, ShardWriter, prepare, write_manifest

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def push(s3, data: Path, bucket: str, prefix: str, name: str, **kw):
    """A dataset push as `supernode data push` runs it."""
    return push_objects(s3, data, dataset_objects(data), bucket, base_key(prefix, name), **kw)


class Dies:
    """An S3 client whose upload_file fails after `ok` uploads (a dropped connection mid-push)."""

    def __init__(self, s3, ok: int):
        self.s3, self.ok, self.keys = s3, ok, []

    def upload_file(self, *args, **kwargs):
        if len(self.keys) == self.ok:
            raise ConnectionError("connection reset mid-push")
        self.keys.append(args[2])
        return self.s3.upload_file(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.s3, name)


def dataset(out: Path, tokens: int, seed: int) -> Path:
    writer = ShardWriter(out, "uint16", 3 * MIB)  # 6 MiB shards: multipart at 5 MiB parts
    out.mkdir(parents=True)
    writer.add(np.random.default_rng(seed).integers(0, 4096, size=tokens, dtype=np.uint16))
    shards = writer.close()
    write_manifest(
        out,
        {
            "tokenizer": {"kind": "synthetic"},
            "vocab": 4096,
            "dtype": "uint16",
            "eos": 0,
            "total_tokens": tokens,
            "max_id": max(s["max_id"] for s in shards),
            "shards": shards,
        },
    )
    return out


def listing(s3, bucket: str, prefix: str) -> dict[str, str]:
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    return {k.removeprefix(prefix): s3.head_object(Bucket=bucket, Key=k)["Metadata"].get("sha256") for k in keys}


def test_interrupted_push_resumes_and_the_manifest_comes_last(moto_aws, tmp_path, capsys):
    s3 = boto3.client("s3", region_name="us-east-1")
    bucket = moto_aws.unique("sn-data")
    s3.create_bucket(Bucket=bucket)
    data = dataset(tmp_path / "web", 7 * MIB, seed=1)  # shards of 6, 6 and 2 MiB
    dying = Dies(s3, ok=1)
    prefix = "datasets/fineweb-sample/"  # the dev stack's datasetPrefix
    with pytest.raises(ConnectionError):
        push(dying, data, bucket, prefix, "web", part_bytes=5 * MIB)
    there = listing(s3, bucket, prefix + "web/")
    assert list(there) == ["shard_00000.bin"]  # no manifest: nobody picks up half a dataset
    assert any("uploadId=" in s for s in moto_aws.seen)  # the 6 MiB shard went up in parts

    moto_aws.seen.clear()
    args = ["data", "push", "--stack", "dev", "--root", str(ROOT), str(data), "--bucket", bucket]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"s3://{bucket}/{prefix}web/: 3 object(s) uploaded" in out and "1 already there" in out
    manifest = json.loads((data / "manifest.json").read_text())
    assert listing(s3, bucket, prefix + "web/") == {
        **{s["file"]: s["sha256"] for s in manifest["shards"]},
        "manifest.json": hashlib.sha256((data / "manifest.json").read_bytes()).hexdigest(),
    }
    puts = [s for s in moto_aws.seen if s.startswith(("PUT", "POST"))]
    assert "manifest.json" in puts[-1]  # the last write is the manifest
    body = s3.get_object(Bucket=bucket, Key=prefix + "web/shard_00001.bin")["Body"].read()
    assert body == (data / "shard_00001.bin").read_bytes()

    assert main(args) == 0  # everything there already: nothing sent
    assert "0 object(s) uploaded (0 bytes), 4 already there" in capsys.readouterr().out


def test_a_changed_dataset_takes_the_old_manifest_down_first(moto_aws, tmp_path):
    s3 = boto3.client("s3", region_name="us-east-1")
    bucket = moto_aws.unique("sn-data")
    s3.create_bucket(Bucket=bucket)
    prepare(DEFAULT_CORPUS, tmp_path / "v1", 100_000)
    push(s3, tmp_path / "v1", bucket, "datasets/", "docs")
    prepare(DEFAULT_CORPUS, tmp_path / "v2", 60_000)
    with pytest.raises(ConnectionError):
        push(Dies(s3, ok=2), tmp_path / "v2", bucket, "datasets/", "docs")
    assert "manifest.json" not in listing(s3, bucket, "datasets/docs/")  # v1's would vouch for v2's shards


def test_push_input_errors_exit_2(moto_aws, tmp_path, capsys):
    base = ["data", "push", "--stack", "dev", "--root", str(ROOT)]
    assert main([*base, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "stack dev has no storage.bucketName" in err and "give --outputs FILE" in err
    assert main([*base, str(tmp_path), "--bucket", "b"]) == 2
    assert f"no manifest.json in {tmp_path}" in capsys.readouterr().err
    prepare(DEFAULT_CORPUS, tmp_path / "d", 100_000)
    (tmp_path / "d" / "shard_00001.bin").write_bytes(b"x" * 100_000)
    assert main([*base, str(tmp_path / "d"), "--bucket", "b"]) == 2  # corrupt data is never pushed
    assert "shard_00001.bin is corrupt: sha256" in capsys.readouterr().err


def test_push_to_a_missing_bucket_says_so_once(moto_aws, tmp_path, capsys):
    prepare(DEFAULT_CORPUS, tmp_path / "d", 100_000)
    assert (
        main(
            [
                "data",
                "push",
                "--stack",
                "dev",
                "--root",
                str(ROOT),
                str(tmp_path / "d"),
                "--bucket",
                moto_aws.unique("absent"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "stopped:" in err and "NoSuchBucket" in err and "Traceback" not in err
    # AWS's own answer, not boto3's wrapper of it taken for a supernode bug
    said = [line for line in err.splitlines() if "stopped:" in line]
    assert len(said) == 1 and "PutObject failed (NoSuchBucket: The specified bucket does not exist)" in said[0]
    assert "it must exist" in said[0] and "internal error" not in err and "report this" not in err


@pytest.mark.parametrize("verb", ["data", "model"])
def test_a_bucket_name_aws_would_refuse_is_bad_input(moto_aws, tmp_path, capsys, verb):
    if verb == "data":
        prepare(DEFAULT_CORPUS, tmp_path / "d", 100_000)
        target = tmp_path / "d"
    else:
        target = export_dir(tmp_path)
    args = [verb, "push", "--stack", "dev", "--root", str(ROOT), str(target), "--bucket", "bad bucket!!"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bucket 'bad bucket!!' (--bucket): not an S3 bucket name (3-63 lowercase letters")
    assert len(err.splitlines()) == 1 and "Parameter validation" not in err
    assert not moto_aws.seen  # nothing sent


# -- supernode model push: an export to inference.weightsPrefix --------------------------------------


def export_dir(tmp: Path) -> Path:
    """A real export (supernode.trainer.hf.export) of a small committed checkpoint, in shards of 7 MiB: the 6 MiB
    embedding and head make two shards above the 5 MiB part size, so they go up in parts."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from supernode.core.checkpoints import COMPLETE
    from supernode.core.config import Model
    from supernode.core.files import sha256_file
    from supernode.trainer.hf.export import export
    from supernode.trainer.model import Transformer

    m = Model(
        layers=2,
        dim=128,
        heads=2,
        kv_heads=1,
        experts=4,
        top_k=2,
        shared_experts=1,
        expert_hidden=64,
        dense_hidden=192,
        first_dense_layers=1,
        vocab=12288,
        seq_len=32,
        router="sigmoid",
    )
    torch.manual_seed(0)
    model = Transformer(m)
    model.init_weights(0)
    step = tmp / "checkpoints" / "step_00000003"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
        (step / COMPLETE).write_text(
            json.dumps(
                {
                    "step": 3,
                    "files": {f.name: sha256_file(f) for f in step.iterdir()},
                    "model": m.model_dump(mode="json"),
                }
            )
        )
        export(step, tmp / "model", dtype="fp32", shard_bytes=7 * MIB, say=lambda s: None)
    return tmp / "model"


def test_model_push_resumes_lands_where_serving_reads_and_passes_its_verify_script(moto_aws, tmp_path, capsys):
    from supernode.components.k8s.serving import VERIFY_SCRIPT
    from supernode.core.config import load_stack

    s3 = boto3.client("s3", region_name="us-east-1")
    bucket = moto_aws.unique("sn-models")
    s3.create_bucket(Bucket=bucket)
    model = export_dir(tmp_path)
    objects = export_objects(model)
    manifest = json.loads((model / "manifest.json").read_text())
    big = [f for f, e in manifest["files"].items() if e["bytes"] > 5 * MIB]
    assert len(big) == 2 and [f for f, _ in objects] == [*sorted(manifest["files"]), "manifest.json"]
    prefix = load_stack("dev", ROOT).inference.weights_prefix  # serving copies FSx's copy of this prefix
    with pytest.raises(ConnectionError):
        push_objects(Dies(s3, ok=3), model, objects, bucket, base_key(prefix), part_bytes=5 * MIB)
    assert "manifest.json" not in listing(s3, bucket, prefix) and len(listing(s3, bucket, prefix)) == 3
    assert any("uploadId=" in s for s in moto_aws.seen)

    moto_aws.seen.clear()
    args = ["model", "push", "--stack", "dev", "--root", str(ROOT), str(model), "--bucket", bucket]
    assert main(args) == 0
    out = capsys.readouterr().out
    pin = hashlib.sha256((model / "manifest.json").read_bytes()).hexdigest()
    assert f"s3://{bucket}/{prefix}: {len(objects) - 3} object(s) uploaded" in out and "3 already there" in out
    assert f"inference.manifestSha256: {pin}" in out
    assert listing(s3, bucket, prefix) == {
        **{f: e["sha256"] for f, e in manifest["files"].items()},
        "manifest.json": pin,
    }
    puts = [s for s in moto_aws.seen if s.startswith(("PUT", "POST"))]
    assert "manifest.json" in puts[-1]  # the last write is the manifest

    # What FSx imports from the prefix, the serving init container copies and verifies against the pin.
    fsx, local = tmp_path / "fsx" / prefix.strip("/"), tmp_path / "models"
    fsx.mkdir(parents=True)
    for key in listing(s3, bucket, prefix):
        s3.download_file(bucket, prefix + key, str(fsx / key))
    run = subprocess.run(
        [sys.executable, "-c", VERIFY_SCRIPT, str(fsx), str(local), pin], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert f"weights: {len(manifest['files'])} files verified" in run.stdout

    assert main(args) == 0  # everything there already: nothing sent
    assert f"0 object(s) uploaded (0 bytes), {len(objects)} already there" in capsys.readouterr().out


def test_model_push_refuses_what_serving_would_refuse(moto_aws, tmp_path, capsys):
    model = export_dir(tmp_path)
    base = ["model", "push", "--stack", "dev", "--root", str(ROOT), "--bucket", moto_aws.unique("never")]
    (model / "model-00001.safetensors").write_bytes(b"changed")
    assert main([*base, str(model)]) == 2  # a changed weight file is never pushed
    err = capsys.readouterr().err
    assert "model-00001.safetensors: sha256" in err and "does not match manifest.json" in err and "Traceback" not in err
    assert main([*base, str(tmp_path / "checkpoints")]) == 2
    assert f"DIR {tmp_path / 'checkpoints'}: no manifest.json" in capsys.readouterr().err
    no_serving = tmp_path / "Pulumi.noserve.yaml"
    stack = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())
    stack["config"].pop("supernode:inference")
    no_serving.write_text(yaml.safe_dump(stack))
    assert main(["model", "push", "--config", str(no_serving), str(model), "--bucket", "b"]) == 2
    assert "stack noserve has no inference section" in capsys.readouterr().err
