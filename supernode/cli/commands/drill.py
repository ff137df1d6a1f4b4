"""`supernode drill restore`: the checkpoint restore drill (supernode/tools/drill.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ...core.errors import EXIT_FAILED, EXIT_OK, BadInput
from ...core.plan import build_local_plan, build_plan
from ...tools.verify import OutputsError, load_outputs
from ..args import add_stack_args, stack_from_args
from .verify import outputs_from_pulumi


def register(sub) -> None:
    p = sub.add_parser("drill", help="operations drills")
    drills = p.add_subparsers(dest="drill", required=True, metavar="DRILL")
    r = drills.add_parser(
        "restore",
        help="restore the newest complete checkpoint from S3 into a fresh directory, "
        "verify its checksums, load it with the plan's model; time it",
    )
    add_stack_args(r)
    add_bucket_args(r)
    r.add_argument(
        "--local",
        action="store_true",
        help="load with the stack's local (CPU-scale) plan: what `supernode train --local` writes",
    )
    r.add_argument("--dest", type=Path, default=None, help="where to restore (default: a temporary directory)")
    r.add_argument("--keep", action="store_true", help="keep the restored copy (default: removed after the drill)")
    r.add_argument("--no-load", action="store_true", help="restore and verify only")
    r.add_argument(
        "--step", type=int, default=None, help="restore this step (one `supernode checkpoints` lists), not the newest"
    )
    r.add_argument("--run", default=None, help="the run of --step, when several runs have that step")
    r.add_argument("--json", action="store_true", help="one JSON line (the cluster CronJob's output)")
    r.set_defaults(func=run)


def add_bucket_args(p) -> None:
    """Where the stack's checkpoints are in S3: its outputs, or its bucket with the config's prefix."""
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--outputs",
        type=Path,
        help="JSON of `pulumi stack output --json --show-secrets` (bucket and "
        "checkpoint prefix; default: ask the pulumi CLI)",
    )
    src.add_argument(
        "--bucket",
        help="the stack's bucket, with the config's checkpoint prefix, instead of the "
        "outputs (the cluster CronJob, which has no pulumi CLI)",
    )


def checkpoint_location(args, stack: str, cfg) -> tuple[str, str]:
    """(bucket, checkpoint prefix) from --bucket or the stack's outputs."""
    if args.bucket is not None:
        return args.bucket, cfg.storage.checkpoint_prefix
    try:
        outs = load_outputs(args.outputs) if args.outputs else outputs_from_pulumi(stack, args.root)
    except OutputsError as e:
        raise BadInput(str(e)) from None
    return outs.bucket_name, outs.checkpoint_prefix


def run(args) -> int:
    from ...tools.awscheck import Aws
    from ...tools.drill import cleanup, restore_drill

    stack, cfg = stack_from_args(args)
    bucket, prefix = checkpoint_location(args, stack, cfg)
    if args.dest is not None and args.dest.exists() and not args.dest.is_dir():
        raise BadInput(f"--dest {args.dest} is an existing file, not a directory")
    if args.dest is not None:
        args.dest.mkdir(parents=True, exist_ok=True)
    plan = build_local_plan(stack, cfg) if args.local else build_plan(stack, cfg)
    if args.step is not None and args.step < 0:
        raise BadInput(f"--step {args.step}: a step is a number >= 0")
    if args.run is not None and args.step is None:
        raise BadInput("--run names the run of --step: give --step too")
    result = restore_drill(
        Aws(cfg.region, read_timeout=60),
        bucket,
        prefix,
        plan,
        args.dest,
        load=not args.no_load,
        step=args.step,
        run=args.run,
    )
    if not args.keep:
        cleanup(result)
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    else:
        print(f"restore drill {result.result}: {result.detail}")
        if result.step is not None:
            print(
                f"  {result.source} -> {result.restored_to}{'' if args.keep else ' (removed)'}: {result.files} files, "
                f"{result.bytes / 1e6:,.1f} MB in {result.download_s:.2f} s ({result.mb_per_s:,.1f} MB/s); "
                f"verify {result.verify_s:.2f} s"
                + (f"; load {result.load_s:.2f} s" if result.load_s is not None else "")
            )
        if result.cluster_command:
            print(f"  load on the GPU nodes: {' '.join(result.cluster_command)}")
    return EXIT_OK if result.ok else EXIT_FAILED
