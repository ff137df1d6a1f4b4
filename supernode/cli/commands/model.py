"""`supernode model push`: an export (`supernode export`) to the stack's bucket at
`inference.weightsPrefix`, from where FSx imports it and the serving pods' init container copies and
verifies it before vLLM starts (components/k8s/serving.py). The same resumable, manifest-last push as
`supernode data push` (supernode/tools/push.py)."""

from __future__ import annotations

from pathlib import Path

from ...core.errors import EXIT_FAILED, BadInput
from ..args import add_stack_args, stack_from_args
from .data import add_bucket_args, bucket_from_args, push_with_progress


def register(sub) -> None:
    p = sub.add_parser("model", help="exported models: push one to the stack's bucket for serving")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    push = verbs.add_parser(
        "push",
        help="upload an export (verified against its manifest first) to the stack's "
        "bucket at inference.weightsPrefix, where serving reads it (resumable; "
        "manifest last)",
    )
    add_stack_args(push)
    push.add_argument("dir", type=Path, help="a model directory written by `supernode export`")
    add_bucket_args(push)
    push.set_defaults(func=run_push)


def run_push(args) -> int:
    from ...tools.push import EXPORT_MANIFEST, base_key, export_objects

    stack, cfg = stack_from_args(args)
    if cfg.inference is None:
        raise BadInput(
            f"stack {stack} has no inference section: inference.weightsPrefix says where the serving "
            "pods read the weights; configure serving first"
        )
    if not (args.dir / EXPORT_MANIFEST).is_file():
        raise BadInput(f"DIR {args.dir}: no {EXPORT_MANIFEST}, not an export; give the --out of `supernode export`")
    objects = export_objects(args.dir)  # BadInput naming the file that does not match the manifest
    bucket, _ = bucket_from_args(args, stack, cfg)
    # The serving init container copies FSx's copy of exactly this prefix (components/k8s/serving.py).
    prefix = cfg.inference.weights_prefix
    result = push_with_progress(cfg.region, args.dir, objects, bucket, base_key(prefix))
    if result is None:
        return EXIT_FAILED
    print(
        f"{result.uri}: {len(result.uploaded)} object(s) uploaded ({result.bytes_uploaded:,} bytes), "
        f"{len(result.skipped)} already there; manifest last. The serving pods copy it from FSx "
        f"/{prefix.strip('/')} and verify every file; pin this export with inference.manifestSha256: {objects[-1][1]}"
    )
    return 0
