"""`supernode data prepare`: text corpus -> byte-level token shards + checksummed manifest."""

from __future__ import annotations

from pathlib import Path

from ...core.errors import BadInput


def register(sub) -> None:
    p = sub.add_parser("data", help="training data: tokenize a corpus into checksummed shards")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    prep = verbs.add_parser("prepare", help="tokenize text files into shards plus manifest.json")
    prep.add_argument("--corpus", type=Path, nargs="+", default=None,
                      help="UTF-8 text files (default: the corpus shipped in trainer/corpus)")
    prep.add_argument("--out", type=Path, required=True, help="directory for the shards and manifest.json")
    prep.add_argument("--shard-tokens", type=int, default=1 << 20, help="tokens per shard (default 1Mi)")
    prep.set_defaults(func=run_prepare)


def run_prepare(args) -> int:
    from trainer.data import DEFAULT_CORPUS, DataError, prepare  # torch is imported only for this command

    if args.shard_tokens < 1:
        raise BadInput(f"--shard-tokens must be a positive number of tokens (got {args.shard_tokens})")
    try:
        manifest = prepare(args.corpus or DEFAULT_CORPUS, args.out, args.shard_tokens)
    except DataError as e:
        raise BadInput(str(e)) from None
    print(f"{manifest['total_tokens']:,} tokens in {len(manifest['shards'])} shard(s) -> {args.out}/manifest.json")
    return 0
