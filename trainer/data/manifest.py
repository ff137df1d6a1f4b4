"""A prepared dataset's manifest: reading it, verifying its shards, and checking its vocabulary
against the model's. Imports neither torch nor the tokenizers library (the CLI's plan and push use it);
numpy reads the ids.

    DIR/shard_00000.bin ...   token ids, the manifest's dtype, fixed size (the last may be shorter)
    DIR/tokenizer.json        the tokenizer, unless it is the byte tokenizer
    DIR/manifest.json         written last: {"tokenizer": {kind, file, sha256, eos_token}, "vocab",
                              "dtype", "eos", "documents", "total_tokens", "max_id", "shard_tokens",
                              "shards": [{file, tokens, sha256, max_id}], ...}
    DIR/.verified             the key of the manifest and shard files last verified in full

Verification hashes every shard once: `prepare` and `verify` leave `.verified`, and a loader whose
shards are unchanged since (same manifest, sizes and mtimes) trusts it. Where DIR is read-only, the
first process on a node verifies under a lock and leaves the marker in the node's temp directory,
so the other ranks of the node wait for it instead of hashing the same shards again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from supernode.core.files import plain_name, sha256_file

MANIFEST = "manifest.json"
VERIFIED = ".verified"
DTYPES = ("uint8", "uint16", "uint32")  # token id types a manifest may name
ITEMSIZE = {"uint8": 1, "uint16": 2, "uint32": 4}


class DataError(Exception):
    """Unusable data (missing or corrupt shard, bad manifest, too little data): the message names the file."""


def read_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"no {MANIFEST} in {data_dir}: run `supernode data prepare` first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        shards = manifest["shards"]
        for s in shards:
            s["file"], s["tokens"], s["sha256"]
    except (ValueError, KeyError, TypeError) as e:  # ValueError: bad JSON or not UTF-8
        raise DataError(f"{path}: not a valid manifest ({type(e).__name__}: {e})") from None
    dtype = manifest.get("dtype", "uint8")
    if dtype not in DTYPES:
        raise DataError(f"{path}: dtype {dtype!r} is not a token id type; use one of {', '.join(DTYPES)}")
    tok = manifest.get("tokenizer")
    for name in [s["file"] for s in shards] + ([tok["file"]] if isinstance(tok, dict) and tok.get("file") else []):
        if why := plain_name(name):
            raise DataError(f"{path}: {why}")
    for s in shards:
        if not isinstance(s["tokens"], int) or isinstance(s["tokens"], bool) or s["tokens"] < 0:
            raise DataError(f"{path}: shard {s['file']!r}: tokens must be a count (got {s['tokens']!r})")
    total = manifest.get("total_tokens")
    if total is not None and total != sum(s["tokens"] for s in shards):
        raise DataError(
            f"{path}: total_tokens {total!r} is not the sum of the shards' tokens ({sum(s['tokens'] for s in shards)})"
        )
    vocab = manifest.get("vocab")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise DataError(f"{path}: vocab must be the tokenizer's vocabulary size (got {vocab!r})")
    if vocab > 1 << (8 * ITEMSIZE[dtype]):
        raise DataError(f"{path}: dtype {dtype} cannot hold the ids of a vocabulary of {vocab}")
    eos = manifest.get("eos")  # absent: documents cannot be told apart (training.documentMasking refuses it)
    if eos is not None and (not isinstance(eos, int) or isinstance(eos, bool) or not 0 <= eos < vocab):
        raise DataError(f"{path}: eos must be a token id below the vocab of {vocab} (got {eos!r})")
    return manifest


def _check_sizes(data_dir: Path, manifest: dict) -> list[tuple[str, int, int]]:
    """Every shard is there with the size the manifest implies (cheap: a stat each); returns
    (file, size, mtime_ns) per shard for the verification key."""
    dtype = manifest.get("dtype", "uint8")
    stats = []
    for s in manifest["shards"]:
        path = data_dir / s["file"]
        try:
            st = path.stat()
        except FileNotFoundError:
            raise DataError(f"shard {path} is missing (listed in {MANIFEST})") from None
        tokens, rest = divmod(st.st_size, ITEMSIZE[dtype])
        if tokens != s["tokens"] or rest:
            raise DataError(
                f"shard {path} is corrupt: {st.st_size / ITEMSIZE[dtype]:g} tokens of {dtype} "
                f"({st.st_size} bytes), manifest says {s['tokens']}: a corrupt shard or a wrong dtype"
            )
        stats.append((s["file"], st.st_size, st.st_mtime_ns))
    return stats


def _key(data_dir: Path, stats: list) -> str:
    text = (data_dir / MANIFEST).read_bytes()
    return hashlib.sha256(text + json.dumps([str(data_dir.resolve()), stats]).encode()).hexdigest()


def verify(data_dir: str | Path) -> dict:
    """Check every shard against the manifest (size, then sha256), then leave the verified marker.
    A missing or corrupt shard raises DataError naming it."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    stats = _check_sizes(data_dir, manifest)
    dtype, vocab = manifest.get("dtype", "uint8"), manifest["vocab"]
    top = -1
    for s in manifest["shards"]:
        path = data_dir / s["file"]
        digest, max_id = scan_shard(path, dtype)
        if digest != s["sha256"]:
            raise DataError(f"shard {path} is corrupt: sha256 {digest} does not match the manifest's {s['sha256']}")
        # The ids themselves, not only the manifest's word for them: an id at or above the vocab
        # would be an IndexError on every rank of the run.
        if max_id >= vocab:
            raise DataError(f"shard {path} holds token id {max_id}, outside the manifest's vocab of {vocab}")
        if s.get("max_id", max_id) != max_id:
            raise DataError(
                f"shard {path}: the manifest says max_id {s['max_id']!r}, the shard's largest id is {max_id}"
            )
        top = max(top, max_id)
    if manifest["shards"] and manifest.get("max_id", top) != top:
        raise DataError(f"{data_dir / MANIFEST}: max_id {manifest['max_id']!r}, but the shards' largest id is {top}")
    _verify_tokenizer(data_dir, manifest)
    mark_verified(data_dir, stats)
    return manifest


def scan_shard(path: Path, dtype: str, chunk_tokens: int = 1 << 22) -> tuple[str, int]:
    """sha256 of the shard's bytes and its largest token id (-1 if empty), in one bounded read."""
    h, top = hashlib.sha256(), -1
    with open(path, "rb") as f:
        while block := f.read(chunk_tokens * ITEMSIZE[dtype]):
            h.update(block)
            top = max(top, int(np.frombuffer(block, dtype=dtype).max()))
    return h.hexdigest(), top


def _verify_tokenizer(data_dir: Path, manifest: dict) -> None:
    """The tokenizer file the data was made with (and that an export ships) is the one recorded."""
    tok = manifest.get("tokenizer") or {}
    if not tok.get("file"):
        return  # the byte tokenizer has no file
    path = data_dir / tok["file"]
    if not path.is_file():
        raise DataError(f"tokenizer {path} is missing (listed in {MANIFEST})")
    digest = sha256_file(path)
    if tok.get("sha256") and digest != tok["sha256"]:
        raise DataError(
            f"tokenizer {path} is corrupt or replaced: sha256 {digest} does not match the manifest's {tok['sha256']}"
        )


def mark_verified(data_dir: Path, stats: list | None = None) -> None:
    key = _key(data_dir, stats if stats is not None else _check_sizes(data_dir, read_manifest(data_dir)))
    for path in (data_dir / VERIFIED, _node_marker(key)):
        try:
            path.write_text(key, encoding="utf-8")
        except OSError:
            pass  # a read-only dataset: the node's marker serves


def _node_marker(key: str) -> Path:
    return Path(tempfile.gettempdir()) / f"supernode-verified-{key[:32]}"


def ensure_verified(data_dir: str | Path) -> dict:
    """The manifest, its shards verified in full unless a marker says they already were."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    key = _key(data_dir, _check_sizes(data_dir, manifest))
    node = _node_marker(key)

    def marked() -> bool:
        return any(
            p.is_file() and p.read_text(encoding="utf-8", errors="replace") == key for p in (data_dir / VERIFIED, node)
        )

    if marked():
        return manifest
    with open(node.with_suffix(".lock"), "a") as lock:  # one verifier per node; the others wait for it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marked():
            verify(data_dir)
    return manifest


def check_vocab(manifest: dict, model_vocab: int, where: str | Path, vocab_key: str = "model.vocab") -> None:
    """The one comparison of the data's vocabulary with the model's (plan, preview and trainer);
    `vocab_key` is the stack-file key that sets model_vocab (`local.model.vocab` for a local run)."""
    vocab, top = manifest["vocab"], manifest.get("max_id")
    if vocab <= model_vocab:
        return
    tok = manifest.get("tokenizer")
    name = tok.get("kind") if isinstance(tok, dict) else tok
    held = (
        f"holds token id {top}, outside"
        if isinstance(top, int) and top >= model_vocab
        else "was tokenized with a vocabulary larger than"
    )
    raise DataError(
        f"{where} {held} the model's vocab of {model_vocab}: its {name} tokenizer has {vocab} tokens; "
        f"set {vocab_key} to at least {vocab}, or prepare the data with a tokenizer of at most "
        f"{model_vocab} tokens"
    )


def document_eos(manifests: Sequence[tuple[Path, dict]]) -> int:
    """The EOS id that ends the documents of every dataset, for `training.documentMasking`."""
    eos = {str(path): m.get("eos") for path, m in manifests}
    missing = [path for path, e in eos.items() if e is None]
    if missing:
        raise DataError(
            f"training.documentMasking is true but {Path(missing[0]) / MANIFEST} records no eos (the "
            "document separator's id), so its documents cannot be told apart; prepare it again with "
            "`supernode data prepare`, or set training.documentMasking to false"
        )
    if len(set(eos.values())) > 1:
        listed = ", ".join(f"{path}: {e}" for path, e in eos.items())
        raise DataError(
            f"training.documentMasking is true but the blend's datasets end documents with different "
            f"eos ids ({listed}); prepare them with one tokenizer"
        )
    return next(iter(eos.values()))


def dataset_dirs(data_dir: str | Path, blend: Sequence = ()) -> list[tuple[Path, float]]:
    """(directory, weight) of each dataset: the blend's paths under `data_dir`, else `data_dir` itself."""
    if not blend:
        return [(Path(data_dir), 1.0)]
    return [(Path(data_dir) / _get(b, "path"), float(_get(b, "weight"))) for b in blend]


def _get(item, name: str):
    return item[name] if isinstance(item, dict) else getattr(item, name)


def check_data(
    data_dir: str | Path,
    model_vocab: int,
    blend: Iterable = (),
    documents: bool = False,
    vocab_key: str = "model.vocab",
) -> list[dict]:
    """For `supernode plan/preview --data DIR`: every dataset's manifest, its vocabulary checked, and
    with `documents` (training.documentMasking) the EOS that separates its documents."""
    manifests = []
    for path, _ in dataset_dirs(data_dir, list(blend)):
        manifests.append((path, read_manifest(path)))
        check_vocab(manifests[-1][1], model_vocab, path, vocab_key)
    if documents:
        document_eos(manifests)
    return [m for _, m in manifests]
