"""The training data loader: memory-mapped token shards, one dataset or a weighted blend.

Preparing and verifying data lives beside this module: supernode.trainer.data.prepare, .tokenizer and .manifest.
Each dataset is read as one token stream through memory maps of its shards (mmap + np.frombuffer),
cut into windows of seq_len + 1 tokens (inputs and next-token targets): window w starts at token
w * seq_len. Windows cross document boundaries; the EOS between documents marks them, so the model
learns where a document ends. By default a window is one causal sequence (a token sees across an
EOS into the previous document); with `training.documentMasking` the loader names the datasets'
EOS id (`eos`) and the trainer keeps attention, positions and the loss within each document
(`supernode.trainer.model.inputs_and_targets`). Resident memory does not grow with the dataset: only the pages of
the windows being read are mapped in (and unmapped after), and the per-epoch order is a keyed
permutation computed per window (no array of all windows).

An optimizer step takes the next `global_batch` windows, cut into micro-batches of `micro_batch`
consecutive windows, and each data-parallel rank takes its own contiguous run of micro-batches. At an
elastic layout whose dp does not divide the global batch's micro-batches (`Plan.padded_micro_batches`),
every rank still runs the same number of micro-batches (FSDP's collectives stay matched): the highest
`padded` ranks run one slot less of real data and, in the last round, a copy of the batch's first
micro-batches that the trainer weighs zero (`real_micro_batches` says how many of a rank's are real).

With one dataset the windows are those of a seeded permutation of its windows, epoch after epoch
(the ragged tail of an epoch is dropped). A blend (`training.data`) picks the dataset of each global
sample from a seeded hash of the sample's index, in proportion to the weights; each dataset then
hands out its own permuted windows. The state (epoch and position per dataset, and the blend's sample
count) is the same on every rank and means the same thing at any data-parallel size: a run saved on
4 ranks resumes on 2, or on 3 with padding, with the same batches.
"""

from __future__ import annotations

import bisect
import hashlib
import mmap
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from .manifest import DataError, check_vocab, dataset_dirs, document_eos, ensure_verified
from .tokenizer import byte_tokenizer

VOCAB = 256  # the byte tokenizer's


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids (the byte tokenizer): lossless, vocab 256."""
    return byte_tokenizer().encode(text)


def decode(tokens: Iterable[int]) -> str:
    return byte_tokenizer().decode(tokens)


# -- a keyed permutation of range(n), computed per index -----------------------------------------


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic is the point)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(idx: np.ndarray, n: int, key: int) -> np.ndarray:
    """Position idx of a pseudo-random permutation of range(n) fixed by `key`: a 4-round Feistel
    network on the smallest even-bit domain >= n, cycle-walking back into range (at most 4x n, so
    a few rounds on average). Memory is that of `idx`, not of n."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = _mix(np.arange(4, dtype=np.uint64) + np.uint64(key & 0xFFFFFFFFFFFFFFFF))
    x = np.asarray(idx, dtype=np.uint64).copy()
    todo = np.ones(x.shape, bool)
    while todo.any():
        left, right = x[todo] >> np.uint64(half), x[todo] & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        x[todo] = (left << np.uint64(half)) | right
        todo[todo] = x[todo] >= np.uint64(n)
    return x.astype(np.int64)


def _key(*parts: int) -> int:
    """A 64-bit key for (seed, epoch, ...): the same in every process and Python version."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


# -- one dataset -----------------------------------------------------------------------------------


class Dataset:
    """A prepared dataset's windows through memory maps, and its (epoch, position) in its order."""

    def __init__(self, data_dir: Path, seq_len: int, seed: int, vocab: int | None, vocab_key: str = "model.vocab"):
        manifest = ensure_verified(data_dir)
        if vocab is not None:  # else an index error in the embedding, on every rank
            check_vocab(manifest, vocab, data_dir, vocab_key)
        self.dir, self.seq_len, self.seed = data_dir, seq_len, seed
        self.manifest = manifest
        self.dtype = np.dtype(manifest.get("dtype", "uint8"))
        shards = [s for s in manifest["shards"] if s["tokens"]]
        self.files = [data_dir / s["file"] for s in shards]
        self.starts = np.cumsum([0] + [s["tokens"] for s in shards]).tolist()
        self.maps: dict[int, tuple] = {}  # shard -> (mmap, its tokens), mapped on first read
        self.tokens = self.starts[-1]
        self.windows = max(0, (self.tokens - 1) // seq_len)
        self.epoch = self.position = 0

    def _map(self, i: int) -> tuple[mmap.mmap, np.ndarray]:
        if i not in self.maps:
            with open(self.files[i], "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.maps[i] = (mm, np.frombuffer(mm, dtype=self.dtype))
        return self.maps[i]

    def _read(self, i: int, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of shard i, copied out; then the pages are unmapped again (they stay in the
        page cache). The kernel maps whole large folios on a fault, so without this the mapped,
        resident part of a long run's shards grows towards all of them."""
        mm, tokens = self._map(i)
        out = tokens[a:b].copy()
        lo = a * self.dtype.itemsize // mmap.PAGESIZE * mmap.PAGESIZE
        mm.madvise(mmap.MADV_DONTNEED, lo, b * self.dtype.itemsize - lo)
        return out

    def window(self, w: int) -> np.ndarray:
        """Tokens [w * seq_len, w * seq_len + seq_len + 1), across shard boundaries if need be."""
        a, b = w * self.seq_len, w * self.seq_len + self.seq_len + 1
        i = bisect.bisect_right(self.starts, a) - 1
        parts = []
        while a < b:
            end = min(b, self.starts[i + 1])
            parts.append(self._read(i, a - self.starts[i], end - self.starts[i]))
            a, i = end, i + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def take(self, count: int) -> np.ndarray:
        """The next `count` window ids of this dataset's order; an epoch too short for them ends
        (its ragged tail is dropped) and the next epoch's order begins."""
        if self.position + count > self.windows:
            self.epoch, self.position = self.epoch + 1, 0
        ids = permute(np.arange(self.position, self.position + count), self.windows, _key(self.seed, self.epoch))
        self.position += count
        return ids

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load(self, sd: dict) -> None:
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])


class TokenLoader:
    """Per-step micro-batches for one data-parallel rank, deterministic for a seed and resumable.

    `data_dir` is a prepared dataset, or with `blend` ([{path, weight}], config `training.data`)
    the directory the blend's paths are relative to. With `documents` (`training.documentMasking`)
    `eos` is the id that ends the datasets' documents (DataError if a manifest records none), else None."""

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        vocab: int | None = None,
        blend: Sequence = (),
        documents: bool = False,
        vocab_key: str = "model.vocab",
        padded_micro_batches: int = 0,
    ):
        micro_batches = global_batch // micro_batch
        slots = micro_batches + padded_micro_batches
        if global_batch % micro_batch or not 0 <= padded_micro_batches < dp_size or slots % dp_size:
            raise ValueError(
                f"global batch {global_batch} in micro-batches of {micro_batch} padded by {padded_micro_batches} "
                f"does not split evenly over {dp_size} data-parallel ranks"
            )
        self.rounds = slots // dp_size  # micro-batches per step on every rank, padded ones included
        first_padded = dp_size - padded_micro_batches  # the highest ranks pad, one slot each
        self.real_micro_batches = self.rounds - (dp_rank >= first_padded)
        self.first_micro_batch = dp_rank * self.rounds - max(0, dp_rank - first_padded)
        # A padded slot repeats one of the batch's micro-batches: real tokens, so its (discarded)
        # forward and backward cost and route like any other.
        self.padding_copy = (dp_rank - first_padded) % micro_batches if dp_rank >= first_padded else None
        sources = dataset_dirs(data_dir, list(blend or ()))
        self.datasets = [
            Dataset(path, seq_len, seed * 1_000_003 + n, vocab, vocab_key) for n, (path, _) in enumerate(sources)
        ]
        weights = np.array([w for _, w in sources], dtype=np.float64)
        self.cumulative = np.cumsum(weights / weights.sum())
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.samples = 0  # global samples drawn so far (a blend's choices are a function of it)
        self.eos = document_eos([(d.dir, d.manifest) for d in self.datasets]) if documents else None
        for d in self.datasets:
            if d.windows < global_batch:
                raise DataError(
                    f"{d.dir} holds {d.tokens} tokens: fewer than one global batch of "
                    f"{global_batch} x {seq_len + 1}; add text or shrink the batch"
                )

    @property
    def windows(self) -> int:
        return self.datasets[0].windows

    def state_dict(self) -> dict:
        if len(self.datasets) == 1:
            return self.datasets[0].state()
        return {"samples": self.samples, "datasets": [d.state() for d in self.datasets]}

    def load_state_dict(self, sd: dict) -> None:
        states = sd.get("datasets", [sd])
        if len(states) != len(self.datasets):
            raise DataError(
                f"the checkpoint's data state is of {len(states)} dataset(s), training.data names "
                f"{len(self.datasets)}: resume with the blend it was trained on"
            )
        for d, s in zip(self.datasets, states):
            d.load(s)
        self.samples = int(sd.get("samples", 0))

    def choices(self, start: int, count: int) -> np.ndarray:
        """The dataset of global samples start..start+count: a seeded hash of each index, by weight."""
        if len(self.datasets) == 1:
            return np.zeros(count, dtype=np.int64)
        u = _mix(np.arange(start, start + count, dtype=np.uint64) + np.uint64(_key(self.seed, -1)))
        return np.searchsorted(self.cumulative, (u >> np.uint64(11)) / float(1 << 53), side="right").clip(
            max=len(self.datasets) - 1
        )

    def next_step(self) -> list[torch.Tensor]:
        """This rank's micro-batches for the next optimizer step, each [micro_batch, seq_len + 1] int64:
        `rounds` of them, the first `real_micro_batches` its share of the global batch, the rest padding."""
        pick = self.choices(self.samples, self.global_batch)
        rows: list = [None] * self.global_batch
        for n, d in enumerate(self.datasets):  # every rank draws the whole batch: the state stays global
            where = np.flatnonzero(pick == n)
            for slot, w in zip(where, d.take(where.size) if where.size else ()):
                rows[slot] = w
        self.samples += self.global_batch
        mb = self.micro_batch
        mine = list(range(self.first_micro_batch * mb, (self.first_micro_batch + self.real_micro_batches) * mb))
        if self.padding_copy is not None:
            mine += range(self.padding_copy * mb, (self.padding_copy + 1) * mb)
        batch = np.stack([self.datasets[pick[i]].window(int(rows[i])) for i in mine]).astype(np.int64)
        return list(torch.from_numpy(batch).split(mb))
