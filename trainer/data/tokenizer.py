"""Tokenizers for `supernode data prepare`: bytes (the demo), a Hugging Face `tokenizer.json`, or a
byte-level BPE trained here from the corpus with the `tokenizers` library. Nothing is downloaded.

A tokenizer has a vocabulary size, an end-of-document id (EOS, written between documents) and,
when it comes from a file, that file's sha256, which the manifest records. Token ids are stored in
the smallest unsigned type that holds the vocabulary (`dtype_for`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from supernode.core.files import sha256_file

from .manifest import DataError

BYTES = "bytes"
TOKENIZER_FILE = "tokenizer.json"  # a dataset carries its tokenizer under this name
EOS_TOKEN = "<|endoftext|>"  # the EOS of a BPE trained here (id 0)
EOS_NAMES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")  # looked up, in order
MIN_BPE_VOCAB = 512  # 256 byte tokens + EOS + enough merges to be worth a BPE


def dtype_for(vocab: int) -> str:
    """uint8 for a byte vocabulary (256), uint16 up to 65 536 ids, else uint32."""
    if vocab <= 1 << 8:
        return "uint8"
    return "uint16" if vocab <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class Tokenizer:
    kind: str  # "bytes", "huggingface" (a given tokenizer.json) or "bpe" (trained here)
    vocab: int
    eos: int
    eos_token: str | None = None
    file: Path | None = None
    sha256: str | None = None

    @property
    def dtype(self) -> str:
        return dtype_for(self.vocab)

    def describe(self) -> dict:
        """What the manifest records about the tokenizer."""
        return {
            "kind": self.kind,
            "file": TOKENIZER_FILE if self.file else None,
            "sha256": self.sha256,
            "eos_token": self.eos_token,
        }

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self.kind == BYTES:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        return [
            np.asarray(e.ids, dtype=self.dtype) for e in _hf(self.file).encode_batch(texts, add_special_tokens=False)
        ]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        if self.kind == BYTES:
            return bytes(int(t) for t in ids).decode("utf-8", errors="replace")
        return _hf(self.file).decode([int(t) for t in ids], skip_special_tokens=False)


_loaded: dict[Path, object] = {}


def _hf(path: Path | None):
    """The `tokenizers` object for a file, loaded once per process (workers reload it by path)."""
    if path not in _loaded:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # our processes are the parallelism
        from tokenizers import Tokenizer as HF

        try:
            _loaded[path] = HF.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise DataError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({e})") from None
    return _loaded[path]


def byte_tokenizer() -> Tokenizer:
    """UTF-8 bytes as ids: lossless, vocab 256. EOS is byte 0 (NUL), which UTF-8 text does not hold."""
    return Tokenizer(BYTES, 256, 0)


def from_file(path: Path, eos_token: str | None = None, kind: str = "huggingface") -> Tokenizer:
    """A Hugging Face tokenizer.json; EOS is `eos_token`, else the first of EOS_NAMES it knows."""
    if not path.is_file():
        raise DataError(f"--tokenizer {path}: file not found")
    hf = _hf(path)
    names = (eos_token,) if eos_token else EOS_NAMES
    eos = next(((n, i) for n in names if (i := hf.token_to_id(n)) is not None), None)
    if eos is None:
        raise DataError(
            f"--tokenizer {path}: no end-of-document token {' / '.join(names)} in its vocabulary; "
            "name the one it has with --eos TOKEN"
        )
    return Tokenizer(kind, hf.get_vocab_size(with_added_tokens=True), eos[1], eos[0], path, sha256_file(path))


def train_bpe(texts: Iterator[str], vocab: int, out: Path) -> Tokenizer:
    """A byte-level BPE (GPT-2 style: any text encodes, decoding is exact) trained on `texts`,
    saved to `out`. A small corpus may stop short of `vocab`; the manifest records the real size."""
    if not MIN_BPE_VOCAB <= vocab <= 1 << 32:
        raise DataError(f"--train-bpe {vocab}: a BPE vocabulary must be between {MIN_BPE_VOCAB} and {1 << 32}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(texts, trainer)
    tmp = out.with_name(out.name + ".tmp")
    hf.save(str(tmp))
    tmp.replace(out)
    _loaded.pop(out, None)
    return from_file(out, EOS_TOKEN, kind="bpe")
