"""`supernode checkpoints`: every run and step of the stack's checkpoints in S3, where each copy lives
and whether it is complete; `--retain` tags them for the lifecycle rules (supernode/tools/checkpoints.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ...core.errors import EXIT_FAILED, EXIT_OK, BadInput
from ...core.plan import build_local_plan, build_plan
from ..args import add_stack_args, err, stack_from_args
from .drill import add_bucket_args, checkpoint_location


def register(sub) -> None:
    p = sub.add_parser(
        "checkpoints",
        help="list the stack's checkpoints in S3 (runs, steps, completeness, retention, the FSx copy); "
        "--retain tags milestones and the rest for the lifecycle rules",
    )
    add_stack_args(p)
    add_bucket_args(p)
    p.add_argument("--local", action="store_true", help="the stack's local plan (its checkpoint interval)")
    p.add_argument("--fsx", type=Path, default=None, help="where FSx is mounted: also check each step's copy there")
    p.add_argument(
        "--retain",
        action="store_true",
        help="tag every complete step milestone (every storage.lifecycle.checkpointMilestoneEvery-th, and each "
        "run's newest) or window (expired after checkpointExpireDays); untagged steps are kept",
    )
    p.add_argument("--dry-run", action="store_true", help="with --retain: print the changes, tag nothing")
    p.add_argument("--json", action="store_true", help="one JSON line per step, then one for the retention changes")
    p.set_defaults(func=run)


def run(args) -> int:
    from ...tools.awscheck import Aws, describe_error
    from ...tools.checkpoints import inventory, retain

    stack, cfg = stack_from_args(args)
    if args.dry_run and not args.retain:
        raise BadInput("--dry-run goes with --retain")
    if args.fsx is not None and not args.fsx.is_dir():
        raise BadInput(f"--fsx {args.fsx}: not a directory (where the stack's FSx file system is mounted)")
    bucket, prefix = checkpoint_location(args, stack, cfg)
    plan = build_local_plan(stack, cfg) if args.local else build_plan(stack, cfg)
    s3 = Aws(cfg.region, read_timeout=60).client("s3")
    try:
        steps = inventory(s3, bucket, prefix, args.fsx)
        changes = (
            retain(
                s3,
                bucket,
                steps,
                plan.training.checkpoint_interval,
                cfg.storage.lifecycle.checkpoint_milestone_every,
                dry_run=args.dry_run,
            )
            if args.retain
            else []
        )
    except Exception as e:  # noqa: BLE001 - an AWS failure is said in one line
        err.print(f"checkpoints: s3://{bucket}/{prefix}: {describe_error(e)[0]}", markup=False)
        return EXIT_FAILED
    if args.json:
        for s in steps:
            print(json.dumps(s.to_json(), sort_keys=True))
        if args.retain:
            print(json.dumps({"retention_changes": changes, "dry_run": args.dry_run}, sort_keys=True))
        return EXIT_OK
    print(f"s3://{bucket}/{prefix}: {len(steps)} steps in {len({s.run for s in steps})} runs")
    shown = None
    for s in steps:
        if s.run != shown:
            shown = s.run
            print(f"  run {s.run or '.'}: {_identity(s)}")
        where = f"; FSx {s.fsx}" if s.fsx else ""
        print(
            f"    step {s.step}: {s.objects} objects, {s.bytes / 1e6:,.1f} MB, {s.check}, "
            f"retention {s.retention or 'untagged (kept)'}{where}"
        )
    for c in changes:
        verb = "would tag" if args.dry_run else "tagged"
        print(f"  {verb} {c['run'] or '.'} step {c['step']}: {c['from']} -> {c['to']}")
    return EXIT_OK


def _identity(s) -> str:
    if not s.model_fingerprint:
        return f"{s.directory or '.'}/ (no run.json: a run from before run identities)"
    parent = f", branched from {s.parent.replace('@', ' step ')}" if s.parent else ""
    return f"stack {s.stack}, model {s.model_fingerprint}{parent}"
