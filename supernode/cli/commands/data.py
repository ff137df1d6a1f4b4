"""`supernode data prepare | verify | push`: a text corpus -> token shards + checksummed manifest,
their verification, and their upload to the stack's bucket (FSx imports it for the trainer)."""

from __future__ import annotations

import re
from pathlib import Path

from ...core.config import stack_key
from ...core.errors import EXIT_FAILED, BadInput
from ..args import add_stack_args, err, stack_from_args

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def register(sub) -> None:
    p = sub.add_parser("data", help="training data: tokenize a corpus into checksummed shards, verify, push to S3")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    prep = verbs.add_parser(
        "prepare",
        help="tokenize text files (.txt: one document each; .jsonl: one per line, "
        'its "text") into fixed-size shards plus manifest.json',
    )
    prep.add_argument(
        "--corpus",
        type=Path,
        nargs="+",
        default=None,
        help="UTF-8 .txt / .jsonl files (default: the corpus shipped in trainer/data/corpus)",
    )
    prep.add_argument("--out", type=Path, required=True, help="directory for the shards and manifest.json")
    tok = prep.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", type=Path, metavar="FILE", help="a Hugging Face tokenizer.json (default: bytes)")
    tok.add_argument(
        "--train-bpe", type=int, metavar="VOCAB", help="train a byte-level BPE of VOCAB tokens on the corpus"
    )
    prep.add_argument("--eos", metavar="TOKEN", help="the tokenizer's end-of-document token (default: looked up)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard (default 128Mi)")
    prep.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: the CPU count)")
    prep.set_defaults(func=run_prepare)
    ver = verbs.add_parser("verify", help="check every shard against the manifest (sha256) and mark it verified")
    ver.add_argument("dir", type=Path, help="a prepared dataset")
    ver.set_defaults(func=run_verify)
    push = verbs.add_parser(
        "push",
        help="upload a prepared dataset to the stack's bucket under datasetPrefix/NAME/ (resumable; manifest last)",
    )
    add_stack_args(push)
    push.add_argument("dir", type=Path, help="a prepared dataset")
    push.add_argument("--name", help="dataset name under datasetPrefix (default: DIR's name)")
    add_bucket_args(push)
    push.set_defaults(func=run_push)


def add_bucket_args(p) -> None:
    """Where a push goes: the stack's bucket, named in the config or in the stack outputs."""
    p.add_argument("--bucket", help="bucket (default: storage.bucketName, else --outputs' bucket_name)")
    p.add_argument("--outputs", type=Path, help="JSON of `pulumi stack output --json` (for a generated bucket name)")


def _positive(flag: str, value) -> None:
    if value is not None and value < 1:
        raise BadInput(f"{flag} must be a positive number (got {value})")


def run_prepare(args) -> int:
    from supernode.trainer.data.manifest import DataError
    from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

    _positive("--shard-tokens", args.shard_tokens)
    _positive("--workers", args.workers)
    try:
        m = prepare(
            args.corpus or DEFAULT_CORPUS,
            args.out,
            args.shard_tokens,
            tokenizer=args.tokenizer,
            train_bpe_vocab=args.train_bpe,
            eos=args.eos,
            workers=args.workers,
            progress=True,
        )
    except DataError as e:
        raise BadInput(str(e)) from None
    tok = m["tokenizer"]
    print(
        f"{m['total_tokens']:,} tokens of {m['documents']:,} document(s) in {len(m['shards'])} shard(s) -> "
        f"{args.out}/manifest.json; tokenizer {tok['kind']}, vocab {m['vocab']:,}, {m['dtype']}, EOS id {m['eos']}"
    )
    return 0


def run_verify(args) -> int:
    from supernode.trainer.data.manifest import DataError, verify

    try:
        m = verify(args.dir)
    except DataError as e:
        raise BadInput(str(e)) from None
    print(f"{args.dir}: {len(m['shards'])} shard(s), {m['total_tokens']:,} tokens verified against the manifest")
    return 0


def run_push(args) -> int:
    from supernode.trainer.data.manifest import DataError

    from ...tools.push import base_key, dataset_objects

    stack, cfg = stack_from_args(args)
    name = args.name or args.dir.resolve().name
    if not NAME_RE.fullmatch(name):
        raise BadInput(f"--name {name!r}: a dataset name is letters, digits, '.', '_' and '-'")
    bucket, outs = bucket_from_args(args, stack, cfg)
    prefix = outs.dataset_prefix if outs is not None else cfg.storage.dataset_prefix
    try:
        objects = dataset_objects(args.dir)
    except DataError as e:
        raise BadInput(str(e)) from None
    result = push_with_progress(cfg.region, args.dir, objects, bucket, base_key(prefix, name))
    if result is None:
        return EXIT_FAILED
    print(
        f"{result.uri}: {len(result.uploaded)} object(s) uploaded ({result.bytes_uploaded:,} bytes), "
        f"{len(result.skipped)} already there; manifest last. FSx imports it as /datasets/{name}; the trainer reads it with "  # noqa: E501
        f"training.data: [{{path: {name}}}] (its --data is the FSx /datasets mount)"
    )
    return 0


def bucket_from_args(args, stack: str, cfg):
    """(bucket, the stack outputs when they named it, else None): --bucket, storage.bucketName, or --outputs."""
    from ...tools.verify import OutputsError, load_outputs

    bucket = args.bucket or cfg.storage.bucket_name
    if bucket is not None:
        return bucket, None
    if args.outputs is None:
        raise BadInput(
            f"stack {stack} has no storage.bucketName (the name is generated at deploy): give "
            "--outputs FILE (`pulumi stack output --json > FILE`) or --bucket NAME"
        )
    try:
        outs = load_outputs(args.outputs)
    except OutputsError as e:
        raise BadInput(str(e)) from None
    return outs.bucket_name, outs


def push_with_progress(region: str, directory: Path, objects, bucket: str, base: str):
    """`ops.push.push` behind a progress bar on stderr; None (said in one line) when AWS stops it."""
    from botocore.exceptions import BotoCoreError, ClientError
    from pydantic import ValidationError
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from ...core.config.schema import StorageConfig
    from ...tools.awscheck import Aws, describe_error, error_code
    from ...tools.push import push, push_bytes

    try:  # storage.bucketName's rule, for --bucket too: a name AWS would refuse is bad input, not an AWS error
        StorageConfig(bucket_name=bucket)
    except ValidationError:
        raise BadInput(
            f"bucket {bucket!r} (--bucket): not an S3 bucket name (3-63 lowercase letters, digits, '.' and '-', "
            "beginning and ending with a letter or digit)"
        ) from None
    s3 = Aws(region, read_timeout=120).client("s3")
    bar = Progress(
        TextColumn("pushing"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[file]}"),
        console=err,
    )
    task = bar.add_task("push", total=push_bytes(directory, objects), file="")
    try:
        with bar:
            return push(
                s3,
                directory,
                objects,
                bucket,
                base,
                on_bytes=lambda n: bar.advance(task, n),
                on_file=lambda f, up: bar.update(task, file=f),
            )
    except (BotoCoreError, ClientError) as e:  # said in one line; the objects already sent stay (a rerun skips them)
        detail, fix = describe_error(e)
        if isinstance(e, ClientError) and error_code(e) == "NoSuchBucket":
            fix = (
                f"check the bucket's name (--bucket, storage.bucketName or --outputs' bucket_name) and region "
                f"({region}): it must exist (a new stack's does once `pulumi up` has run)"
            )
        err.print(
            f"push to s3://{bucket}/{base} stopped: {detail}; {fix}, then run the push again "
            "(objects already uploaded are skipped)",
            markup=False,
        )
        return None


def add_data_arg(p) -> None:
    """`--data DIR` on plan and preview: the prepared data the plan will train on."""
    p.add_argument(
        "--data",
        type=Path,
        metavar="DIR",
        help="prepared data (a dataset, or with training.data the "
        "directory of its datasets): exit 2 if model.vocab does not cover its vocabulary",
    )


def check_plan_data(plan, data_dir) -> None:
    """Exit 2 (BadInput) when the data's vocabulary does not fit the plan's model.vocab, or
    training.documentMasking is on and the data records no document separator."""
    from supernode.trainer.data.manifest import DataError, check_data

    if data_dir is not None:
        try:
            check_data(
                data_dir,
                plan.model.vocab,
                plan.training.data,
                plan.training.document_masking,
                vocab_key=stack_key("model.vocab", plan.local),
            )
        except DataError as e:
            raise BadInput(str(e)) from None
