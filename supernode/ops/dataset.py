"""`supernode data push`: a prepared dataset to the stack's bucket, under `datasetPrefix/<name>/`,
from where FSx's data repository association imports it into the trainer's `/datasets` mount.

Each object carries the manifest's sha256 in its metadata (`x-amz-meta-sha256`); an object already
there with the same sha256 is skipped, so an interrupted push run again resumes. Shards
and the tokenizer go first (boto3's transfer manager: multipart above `part_bytes`), the manifest
last: a reader never finds a manifest whose shards are not all there. A remote manifest that
differs from ours is deleted before anything is uploaded, for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from trainer.manifest import MANIFEST, ensure_verified

from ..core.files import sha256_file

PART_BYTES = 64 << 20


@dataclass
class PushResult:
    uri: str
    uploaded: list[str]
    skipped: list[str]
    bytes_uploaded: int


def objects(data_dir: Path, manifest: dict) -> list[tuple[str, str]]:
    """(file, sha256) in upload order: shards, the tokenizer, the manifest last."""
    files = [(s["file"], s["sha256"]) for s in manifest["shards"]]
    tok = manifest.get("tokenizer")
    if isinstance(tok, dict) and tok.get("file"):
        files.append((tok["file"], tok["sha256"]))
    return files + [(MANIFEST, sha256_file(data_dir / MANIFEST))]


def _remote(s3: Any, bucket: str, key: str) -> Optional[str]:
    """The sha256 metadata of an object ("" without), or None where there is none. S3 writes an
    object whole or not at all, so the checksum it was written with identifies its content."""
    try:
        head = s3.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise
    return head.get("Metadata", {}).get("sha256", "")


def push(s3: Any, data_dir: Path, bucket: str, prefix: str, name: str, part_bytes: int = PART_BYTES,
         on_bytes: Callable[[int], None] = lambda n: None, on_file: Callable[[str, bool], None] = lambda f, up: None,
         ) -> PushResult:
    """Upload `data_dir` (verified first: corrupt shards are not pushed) to s3://bucket/prefix/name/."""
    manifest = ensure_verified(data_dir)
    base = f"{prefix.rstrip('/')}/{name}/" if prefix.strip("/") else f"{name}/"
    todo = objects(data_dir, manifest)
    config = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes)
    result = PushResult(f"s3://{bucket}/{base}", [], [], 0)
    mine = todo[-1][1]
    there = _remote(s3, bucket, base + MANIFEST)
    if there is not None and there != mine:  # another version's manifest must not vouch for new shards
        s3.delete_object(Bucket=bucket, Key=base + MANIFEST)
    for file, sha in todo:
        path = data_dir / file
        size = path.stat().st_size
        if _remote(s3, bucket, base + file) == sha:
            result.skipped.append(file)
            on_bytes(size)
            on_file(file, False)
            continue
        s3.upload_file(str(path), bucket, base + file, ExtraArgs={"Metadata": {"sha256": sha}}, Config=config,
                       Callback=on_bytes)
        result.uploaded.append(file)
        result.bytes_uploaded += size
        on_file(file, True)
    return result


def push_bytes(data_dir: Path) -> int:
    """Bytes a push reads (for a progress bar's total)."""
    manifest = ensure_verified(data_dir)
    return sum((data_dir / f).stat().st_size for f, _ in objects(data_dir, manifest))
