"""`supernode export --stack S [--local] --checkpoint DIR --out DIR`: a training checkpoint as a
Hugging Face model directory (Glm4MoeForCausalLM or Qwen3MoeForCausalLM) with a sha256 manifest,
streamed tensor by tensor (supernode.trainer.hf.export)."""

from __future__ import annotations

from pathlib import Path

from ...core.errors import EXIT_FAILED, BadInput
from ...core.inference import DTYPES
from ..args import add_stack_args, err, stack_from_args


def register(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint as a Hugging Face model directory vLLM serves")
    add_stack_args(p)
    p.add_argument("--local", action="store_true", help="the checkpoint is of the stack's local (CPU) model")
    p.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="a step_N checkpoint directory, a checkpoints directory (its newest complete one), or a `supernode train` "
        "--out directory (its latest run's newest)",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the model directory to write: a new one, or an earlier export (replaced; nothing else is)",
    )
    p.add_argument("--data", type=Path, default=None, help="the prepared data whose tokenizer ships with the model")
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPES),
        help="weights' dtype (default: inference.dtype, else bf16)",
    )
    p.add_argument("--shard-gib", type=float, default=2.0, help="safetensors shard size (default 2 GiB)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.shard_gib <= 0:
        raise BadInput(f"--shard-gib must be positive (got {args.shard_gib})")
    for flag in ("checkpoint", "data"):
        value = getattr(args, flag)
        if value is not None and not value.is_dir():
            raise BadInput(f"--{flag} {value}: not a directory")
    stack, cfg = stack_from_args(args)
    model = (cfg.local_config() if args.local else cfg).model
    dtype = args.dtype or (cfg.inference.dtype if cfg.inference else "bf16")
    import warnings

    from supernode.trainer.hf.export import NoSpace, export  # torch only for this command

    with warnings.catch_warnings():  # DCP's "loading in a single process" is the intent here
        warnings.simplefilter("ignore", UserWarning)
        try:
            export(
                args.checkpoint,
                args.out,
                model=model,
                dtype=dtype,
                data=args.data,
                shard_bytes=int(args.shard_gib * 2**30),
            )
        except NoSpace as e:  # the disk, not the input: exit 1
            err.print(f"export failed: {e}", markup=False)
            return EXIT_FAILED
    return 0
