"""`supernode import --stack S --from DIR [--local] [--write-manifest]`: can the stack start from this
Hugging Face model directory (`training.initFrom`)? Offline and torch-free (supernode.core.pretrained):
config.json against the stack's model section, every difference printed as (field, ours, theirs).
`--write-manifest` records the sha256 of every file of a directory `transformers` wrote, in the
export's manifest format, which the trainer verifies before it loads the weights."""

from __future__ import annotations

from pathlib import Path

from ...core.errors import EXIT_FAILED, EXIT_OK, BadInput
from ...core.files import sha256_file
from ...core.pretrained import MANIFEST, architecture, compare, read_config, write_manifest
from ..args import add_stack_args, stack_from_args


def register(sub) -> None:
    p = sub.add_parser(
        "import", help="check a Hugging Face MoE directory against the stack's model (training.initFrom)"
    )
    add_stack_args(p)
    p.add_argument(
        "--from",
        dest="source",
        type=Path,
        required=True,
        help="the Hugging Face model directory (config.json, *.safetensors)",
    )
    p.add_argument("--local", action="store_true", help="compare with the stack's local (CPU) model, local.model")
    p.add_argument(
        "--write-manifest",
        action="store_true",
        help=f"write DIR/{MANIFEST} (every file's sha256) for a directory transformers wrote, once it fits",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.source.is_dir():
        raise BadInput(f"--from {args.source}: not a directory")
    _, cfg = stack_from_args(args)
    model = (cfg.local_config() if args.local else cfg).model
    key = "local.model" if args.local else "model"
    hf = read_config(args.source)
    arch = architecture(hf) or hf.get("architectures")
    diffs = compare(hf, model, key)
    if diffs:
        print(f"{args.source} ({arch}) does not fit the stack's {key}: {len(diffs)} difference(s)")
        for d in diffs:
            print(f"  {d.line()}")
        return EXIT_FAILED
    print(f"{args.source} ({arch}) fits the stack's {key}")
    if args.write_manifest:
        write_manifest(args.source, str(arch))
    manifest = args.source / MANIFEST
    if manifest.is_file():
        t = "local.training" if args.local else "training"
        print(f"set {t}.initFrom: {args.source.resolve()} and {t}.initFromSha256: {sha256_file(manifest)}")
    else:
        print(f"no {MANIFEST} there: run again with --write-manifest before training from it")
    return EXIT_OK
