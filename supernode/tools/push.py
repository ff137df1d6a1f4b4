"""Pushing a checksummed directory to the stack's bucket, from where FSx's data repository
associations import it: a prepared dataset (`supernode data push`, under `datasetPrefix/<name>/`,
the trainer's `/datasets`) and a model export (`supernode model push`, under `inference.weightsPrefix`,
what the serving pods' init container copies and verifies).

Both directories carry a manifest.json listing every other file's sha256, so one routine serves
both. Each object carries its sha256 in its metadata (`x-amz-meta-sha256`); an object already there
with the same sha256 is skipped, so an interrupted push run again resumes. The files go first
(boto3's transfer manager: multipart above `part_bytes`), the manifest last: a reader never finds a
manifest whose files are not all there. A remote manifest that differs from ours is deleted before
anything is uploaded, for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from supernode.trainer.data.manifest import MANIFEST as DATA_MANIFEST
from supernode.trainer.data.manifest import ensure_verified

from ..core.files import sha256_file
from .serve import MANIFEST as EXPORT_MANIFEST
from .serve import verify_export

PART_BYTES = 64 << 20

Objects = list[tuple[str, str]]  # (file relative to the directory, sha256) in upload order, the manifest last


@dataclass
class PushResult:
    uri: str
    uploaded: list[str]
    skipped: list[str]
    bytes_uploaded: int


def dataset_objects(data_dir: Path) -> Objects:
    """A prepared dataset, verified first (corrupt shards are not pushed): shards, the tokenizer, the manifest."""
    manifest = ensure_verified(data_dir)
    files = [(s["file"], s["sha256"]) for s in manifest["shards"]]
    tok = manifest.get("tokenizer")
    if isinstance(tok, dict) and tok.get("file"):
        files.append((tok["file"], tok["sha256"]))
    return files + [(DATA_MANIFEST, sha256_file(data_dir / DATA_MANIFEST))]


def export_objects(model_dir: Path) -> Objects:
    """A model export, every file verified against its manifest first (what the cluster would refuse
    to serve is not pushed): the weights, config and tokenizer, the manifest."""
    manifest = verify_export(model_dir)
    return [(f, entry["sha256"]) for f, entry in sorted(manifest["files"].items())] + [
        (EXPORT_MANIFEST, sha256_file(model_dir / EXPORT_MANIFEST))
    ]


def base_key(prefix: str, name: str | None = None) -> str:
    """The key prefix of a push: `prefix/name/`, or `prefix/` itself without a name."""
    parts = [p for p in (prefix.strip("/"), name) if p]
    return "".join(p + "/" for p in parts)


def _remote(s3: Any, bucket: str, key: str) -> str | None:
    """The sha256 metadata of an object ("" without), or None where there is none. S3 writes an
    object whole or not at all, so the checksum it was written with identifies its content."""
    try:
        head = s3.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise
    return head.get("Metadata", {}).get("sha256", "")


def push(
    s3: Any,
    directory: Path,
    objects: Objects,
    bucket: str,
    base: str,
    part_bytes: int = PART_BYTES,
    on_bytes: Callable[[int], None] = lambda n: None,
    on_file: Callable[[str, bool], None] = lambda f, up: None,
) -> PushResult:
    """Upload `objects` of `directory` to s3://bucket/base (`base` ends in "/"), the last one (the
    manifest) last; `on_bytes` and `on_file(file, uploaded)` report progress."""
    config = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes)
    result = PushResult(f"s3://{bucket}/{base}", [], [], 0)
    manifest, mine = objects[-1]
    there = _remote(s3, bucket, base + manifest)
    if there is not None and there != mine:  # another version's manifest must not vouch for new files
        s3.delete_object(Bucket=bucket, Key=base + manifest)
    for file, sha in objects:
        path = directory / file
        size = path.stat().st_size
        if _remote(s3, bucket, base + file) == sha:
            result.skipped.append(file)
            on_bytes(size)
            on_file(file, False)
            continue
        try:
            s3.upload_file(
                str(path),
                bucket,
                base + file,
                ExtraArgs={"Metadata": {"sha256": sha}},
                Config=config,
                Callback=on_bytes,
            )
        except S3UploadFailedError as e:
            # boto3's transfer manager wraps AWS's answer (NoSuchBucket, AccessDenied) in a message of its
            # own; the ClientError it wraps is what says why, and what callers know how to describe.
            raise (e.__cause__ or e.__context__ or e) from None
        result.uploaded.append(file)
        result.bytes_uploaded += size
        on_file(file, True)
    return result


def push_bytes(directory: Path, objects: Objects) -> int:
    """Bytes a push reads (a progress bar's total)."""
    return sum((directory / f).stat().st_size for f, _ in objects)
