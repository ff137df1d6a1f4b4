"""Token data: a byte-level tokenizer, token shards with a checksummed manifest, and a loader.

Layout written by `prepare`:

    out_dir/shard_00000.bin ...   raw uint8 token ids (byte-level: every id < 256)
    out_dir/manifest.json         {"tokenizer", "vocab", "dtype", "total_tokens", "shards": [{file, tokens, sha256}]}

The loader reads the shards as one token stream cut into windows of seq_len + 1 tokens (inputs and
next-token targets). Each epoch visits the windows in a seeded permutation; an optimizer step takes
the next `global_batch` windows of it and each data-parallel rank takes its own contiguous slice.
Because the order is global, the state (epoch, position) is the same on every rank and means the
same thing at any data-parallel size: a run saved on 4 ranks resumes on 2 with the same batches.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

VOCAB = 256
MANIFEST = "manifest.json"
DTYPE = np.uint8
DTYPES = ("uint8", "uint16", "uint32")  # token id types a manifest may name
DEFAULT_CORPUS = sorted((Path(__file__).parent / "corpus").glob("*.txt"))


class DataError(Exception):
    """Unusable data (missing or corrupt shard, bad manifest, too little data): the message names the file."""


# -- tokenizer -------------------------------------------------------------------------------

def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids: lossless, vocab 256 (valid ids in any larger vocab too)."""
    return np.frombuffer(text.encode("utf-8"), dtype=DTYPE).copy()


def decode(tokens: Iterable[int]) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


# -- shards ----------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare(corpus_paths: Sequence[str | Path], out_dir: str | Path, shard_tokens: int = 1 << 20) -> dict:
    """Tokenize text files into shards of at most `shard_tokens` tokens plus `manifest.json`."""
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive (got {shard_tokens})")
    parts = []
    for p in map(Path, corpus_paths):
        if not p.is_file():
            raise DataError(f"corpus file not found: {p}")
        try:
            parts.append(encode(p.read_text(encoding="utf-8")))
        except UnicodeDecodeError as e:
            raise DataError(f"corpus file is not UTF-8 text: {p} ({e})") from None
    stream = np.concatenate(parts) if parts else np.zeros(0, DTYPE)
    if stream.size == 0:
        raise DataError(f"the corpus is empty: {[str(p) for p in corpus_paths]}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is an existing file, not a directory; give a directory for the shards")
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, start in enumerate(range(0, stream.size, shard_tokens)):
        path = out / f"shard_{i:05d}.bin"
        path.write_bytes(stream[start:start + shard_tokens].tobytes())
        shards.append({"file": path.name, "tokens": int(min(shard_tokens, stream.size - start)),
                       "sha256": _sha256(path)})
    manifest = {"tokenizer": "bytes", "vocab": VOCAB, "dtype": np.dtype(DTYPE).name,
                "total_tokens": int(stream.size), "shards": shards}
    tmp = out / (MANIFEST + ".tmp")  # the manifest appears only once every shard is written
    tmp.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    tmp.replace(out / MANIFEST)
    return manifest


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
    for s in shards:
        if not isinstance(s["tokens"], int) or isinstance(s["tokens"], bool) or s["tokens"] < 0:
            raise DataError(f"{path}: shard {s['file']!r}: tokens must be a count (got {s['tokens']!r})")
    total = manifest.get("total_tokens")
    if total is not None and total != sum(s["tokens"] for s in shards):
        raise DataError(f"{path}: total_tokens {total!r} is not the sum of the shards' tokens "
                        f"({sum(s['tokens'] for s in shards)})")
    return manifest


def verify(data_dir: str | Path) -> dict:
    """Check every shard against the manifest; a missing or corrupt shard raises DataError naming it."""
    manifest = read_manifest(data_dir)
    for s in manifest["shards"]:
        path = Path(data_dir) / s["file"]
        if not path.is_file():
            raise DataError(f"shard {path} is missing (listed in {MANIFEST})")
        itemsize = np.dtype(manifest.get("dtype", "uint8")).itemsize
        size, rest = divmod(path.stat().st_size, itemsize)
        if size != s["tokens"] or rest:
            raise DataError(f"shard {path} is corrupt: {path.stat().st_size / itemsize:g} tokens of "
                            f"{manifest.get('dtype', 'uint8')} ({path.stat().st_size} bytes), manifest says "
                            f"{s['tokens']}: a corrupt shard or a wrong dtype")
        digest = _sha256(path)
        if digest != s["sha256"]:
            raise DataError(f"shard {path} is corrupt: sha256 {digest} does not match the manifest's {s['sha256']}")
    return manifest


# -- loader ----------------------------------------------------------------------------------

@dataclass
class DataState:
    epoch: int = 0
    position: int = 0  # windows of this epoch's permutation already consumed (global, all ranks)


class TokenLoader:
    """Per-step micro-batches for one data-parallel rank, deterministic for a seed and resumable."""

    def __init__(self, data_dir: str | Path, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int, vocab: int | None = None):
        manifest = verify(data_dir)
        self.tokens = np.concatenate([np.fromfile(Path(data_dir) / s["file"], dtype=manifest.get("dtype", "uint8"))
                                      for s in manifest["shards"]])
        top = int(self.tokens.max()) if self.tokens.size else 0
        if vocab is not None and top >= vocab:  # else an index error in the embedding, on every rank
            raise DataError(f"{data_dir} holds token id {top}, outside the model's vocab of {vocab} "
                            f"(manifest dtype {manifest.get('dtype', 'uint8')}, vocab {manifest.get('vocab')})")
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.windows = (self.tokens.size - 1) // seq_len
        if self.windows < global_batch:
            raise DataError(f"{data_dir} holds {self.tokens.size} tokens: fewer than one global batch of "
                            f"{global_batch} x {seq_len + 1}; add text or shrink the batch")
        self.state = DataState()
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.windows, generator=g)

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "position": self.state.position}

    def load_state_dict(self, sd: dict) -> None:
        self.state = DataState(int(sd["epoch"]), int(sd["position"]))
        self._order = self._permutation(self.state.epoch)

    def next_step(self) -> list[torch.Tensor]:
        """This rank's micro-batches for the next optimizer step, each [micro_batch, seq_len + 1] int64."""
        if self.state.position + self.global_batch > self.windows:  # drop the ragged tail, next epoch
            self.state = DataState(self.state.epoch + 1, 0)
            self._order = self._permutation(self.state.epoch)
        per_rank = self.global_batch // self.dp_size
        start = self.state.position + self.dp_rank * per_rank
        ids = self._order[start:start + per_rank].numpy()
        self.state.position += self.global_batch
        offsets = ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        batch = torch.from_numpy(self.tokens[offsets].astype(np.int64))
        return list(batch.split(self.micro_batch))
