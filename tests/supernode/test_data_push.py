"""`supernode data push` against a real moto server (fixture `moto_aws`, conftest.py): multipart
uploads with the sha256 in metadata, an interrupted push that resumes, and the manifest last."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import boto3
import numpy as np
import pytest

from supernode.cli import main
from supernode.ops.dataset import push
from trainer.prepare import DEFAULT_CORPUS, ShardWriter, prepare, write_manifest

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


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
    write_manifest(out, {"tokenizer": {"kind": "synthetic"}, "vocab": 4096, "dtype": "uint16", "eos": 0,
                         "total_tokens": tokens, "max_id": max(s["max_id"] for s in shards), "shards": shards})
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
        "manifest.json": hashlib.sha256((data / "manifest.json").read_bytes()).hexdigest()}
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
    assert main(["data", "push", "--stack", "dev", "--root", str(ROOT), str(tmp_path / "d"),
                 "--bucket", moto_aws.unique("absent")]) == 1
    err = capsys.readouterr().err
    assert "stopped:" in err and "NoSuchBucket" in err and "Traceback" not in err
