"""The cluster job's init container for `training.initFrom`: the weights local and verified before rank 0 starts.

    python -m supernode.trainer.hf.fetch --from SRC --to DIR [--sha256 PIN]

SRC an s3:// prefix: every object directly under it is downloaded into DIR (a pod's emptyDir), then
verified; SRC a directory (the FSx volume, mounted read-only): verified in place, DIR unused. Either
way the manifest is checked against PIN (`training.initFromSha256`) and every file against the
manifest (supernode.core.pretrained). Exit 0 verified; 2 (one line naming the file) otherwise, so
the pod never starts training on weights that do not match.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from supernode.core.errors import EXIT_BAD_INPUT, EXIT_OK, BadInput
from supernode.core.files import plain_name
from supernode.core.pretrained import is_remote, read_manifest, verify_files


def download(source: str, out: Path) -> int:
    """The objects directly under the s3:// prefix `source`, into `out`; -> how many."""
    import boto3

    bucket, _, prefix = source.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    s3 = boto3.client("s3")
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) :]
            if plain_name(name):  # the prefix's own marker object, if any
                continue
            s3.download_file(bucket, obj["Key"], str(out / name))
            count += 1
    if not count:
        raise BadInput(f"training.initFrom {source}: no objects under that prefix")
    return count


def fetch(source: str, out: Path, pin: str | None) -> Path:
    """The verified local directory of `source`."""
    directory = out if is_remote(source) else Path(source)
    if is_remote(source):
        download(source, out)
    elif not directory.is_dir():
        raise BadInput(f"training.initFrom {source}: not a directory (is the FSx path right?)")
    files = read_manifest(directory, pin)
    problem = verify_files(directory, files)
    if problem:
        raise BadInput(f"training.initFrom: {problem}")
    return directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supernode.trainer.hf.fetch", description=__doc__.split("\n")[0])
    p.add_argument("--from", dest="source", required=True, help="training.initFrom: an s3:// prefix or a directory")
    p.add_argument("--to", type=Path, required=True, help="where an s3:// prefix is downloaded")
    p.add_argument("--sha256", default=None, help="training.initFromSha256: the manifest's pinned sha256")
    args = p.parse_args(argv)
    try:
        directory = fetch(args.source, args.to, args.sha256)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"initFrom: {directory} verified against its manifest")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
