"""`supernode data prepare`: text files -> fixed-size token shards + manifest (see supernode.trainer.data.manifest).

Documents: a `.txt` file is one document, a `.jsonl` file holds one per line (its "text" field).
The EOS id is written between documents. Files are cut at line ends into chunks of about
`chunk_bytes`, tokenised in parallel processes (in order), and the token stream is cut into
shards of exactly `shard_tokens` tokens (the last may be shorter). A cut inside a `.txt` file
falls at a line end; a byte-level BPE may merge across a newline there, so a big file's tokens can
differ from tokenising it whole by a token at each cut (bytes are exact).

Each shard is written to a temporary name and renamed when complete; after each, `prepare.json`
records the shards done and where the input resumes. An interrupted prepare run again with the
same inputs, tokenizer and shard size resumes there; with anything else it starts over (old
shards, tokenizer and manifest removed first). The manifest is written last, then `.verified`.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from supernode.core.inputs import SURROGATE_ESCAPE
from supernode.core.processes import die_with_parent

from .manifest import MANIFEST, VERIFIED, DataError, mark_verified
from .tokenizer import TOKENIZER_FILE, Tokenizer, byte_tokenizer, from_file, train_bpe

DEFAULT_CORPUS = sorted((Path(__file__).parent / "corpus").glob("*.txt"))
JOURNAL = "prepare.json"
FORMAT = 2
CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Chunk:
    path: str
    start: int
    end: int
    jsonl: bool
    first: bool  # the corpus's first chunk: no EOS before its first document


def chunks(paths: Sequence[Path], chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Line-aligned byte ranges of every input, in order."""
    out: list[Chunk] = []
    for p in paths:
        size, start = p.stat().st_size, 0
        with p.open("rb") as f:
            while start < size:
                f.seek(min(start + chunk_bytes, size) - 1)
                end = min(start + chunk_bytes, size) + len(f.readline())  # on to the line's end
                out.append(Chunk(str(p), start, end, p.suffix == ".jsonl", not out))
                start = end
    return out


_worker_tok: Tokenizer | None = None


def _init(tok: Tokenizer, parent: int | None = None) -> None:
    global _worker_tok
    _worker_tok = tok
    if parent is not None:  # a pool worker: killed with the prepare, not left tokenizing for minutes
        die_with_parent(parent)


def _texts(c: Chunk) -> list[str]:
    """The chunk's documents (for a `.txt` chunk, a piece of one)."""
    with open(c.path, "rb") as f:
        f.seek(c.start)
        raw = f.read(c.end - c.start)
    try:
        if not c.jsonl:
            return [raw.decode("utf-8")]
        docs, at = [], c.start  # `at`: the byte offset of the line in the file, for messages
        for line in raw.split(b"\n"):
            if line.strip():
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{c.path}: line at byte {at} is not JSON (column {e.colno}: {e.msg})") from None
                if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                    raise DataError(f'{c.path}: line at byte {at} is not a JSON object with a "text" string')
                if SURROGATE_ESCAPE.search(line.decode("utf-8")) and not _encodable(doc["text"]):
                    raise DataError(
                        f"{c.path}: line at byte {at} has a lone surrogate escape (\\ud800-\\udfff): not text"
                    )
                docs.append(doc["text"])
            at += len(line) + 1
        return docs
    except UnicodeDecodeError as e:
        raise DataError(f"corpus file is not UTF-8 text: {c.path} (byte {c.start + e.start})") from None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _tokenize(c: Chunk) -> tuple[np.ndarray, int, int]:
    """(token ids with EOS before each document but the corpus's first, bytes read, documents begun)."""
    tok = _worker_tok
    texts = _texts(c)
    ids = tok.encode_batch(texts)
    begins = c.jsonl or c.start == 0  # which of these texts start a document
    parts = []
    for i, doc in enumerate(ids):
        if begins and not (c.first and i == 0):
            parts.append(np.array([tok.eos], dtype=tok.dtype))
        parts.append(doc.astype(tok.dtype, copy=False))
    docs = len(ids) if begins else 0
    return (np.concatenate(parts) if parts else np.zeros(0, tok.dtype)), c.end - c.start, docs


class ShardWriter:
    """Cuts a token stream into shards of exactly `shard_tokens`, each written under a temporary
    name and renamed once complete; `on_shard` runs after each rename (the journal's hook)."""

    def __init__(
        self,
        out: Path,
        dtype: str,
        shard_tokens: int,
        done: Sequence[dict] = (),
        on_shard: Callable[[], None] = lambda: None,
    ):
        self.out, self.dtype, self.on_shard = out, dtype, on_shard
        self.buf = np.empty(shard_tokens, dtype)
        self.fill = 0
        self.shards = list(done)

    def add(self, ids: np.ndarray) -> None:
        i = 0
        while i < ids.size:
            take = min(self.buf.size - self.fill, ids.size - i)
            self.buf[self.fill : self.fill + take] = ids[i : i + take]
            self.fill, i = self.fill + take, i + take
            if self.fill == self.buf.size:
                self.consumed = i  # how many of this call's ids are in shards now (read by on_shard)
                self._flush()
                self.on_shard()

    def _flush(self) -> None:
        data = self.buf[: self.fill]
        name = f"shard_{len(self.shards):05d}.bin"
        tmp = self.out / (name + ".tmp")
        with tmp.open("wb") as f:
            f.write(data.tobytes())
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.out / name)
        self.shards.append(
            {
                "file": name,
                "tokens": int(self.fill),
                "sha256": hashlib.sha256(data).hexdigest(),
                "max_id": int(data.max()),
            }
        )
        self.fill = 0

    def close(self) -> list[dict]:
        if self.fill:
            self._flush()
        return self.shards


def write_manifest(out: Path, manifest: dict) -> dict:
    """The manifest appears only once every shard is in place; the shards were hashed as written,
    so the dataset is marked verified."""
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    tmp.replace(out / MANIFEST)
    mark_verified(out)
    return manifest


def write_synthetic(out: Path, tokens: int, vocab: int, seed: int = 0, shard_tokens: int = 1 << 20) -> Path:
    """Random uint16 token ids (1..vocab-1) through the same shard writer and manifest as `prepare`:
    datasets of any size for tests and benchmarks, written in 4 Mi-token blocks."""
    out.mkdir(parents=True, exist_ok=True)
    writer, rng = ShardWriter(out, "uint16", shard_tokens), np.random.default_rng(seed)
    for start in range(0, tokens, 1 << 22):
        writer.add(rng.integers(1, vocab, size=min(1 << 22, tokens - start), dtype=np.uint16))
    shards = writer.close()
    write_manifest(
        out,
        {
            "tokenizer": {"kind": "synthetic"},
            "vocab": vocab,
            "dtype": "uint16",
            "eos": 0,
            "total_tokens": tokens,
            "max_id": max(s["max_id"] for s in shards),
            "shards": shards,
        },
    )
    return out


def _settings_key(paths: Sequence[Path], tokenizer: str, shard_tokens: int, chunk_bytes: int) -> str:
    inputs = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    return hashlib.sha256(json.dumps([FORMAT, inputs, tokenizer, shard_tokens, chunk_bytes]).encode()).hexdigest()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _start_over(out: Path) -> None:
    """Remove what an earlier prepare left (manifest first: a half-rewritten dataset is never whole)."""
    for name in (MANIFEST, VERIFIED, JOURNAL, TOKENIZER_FILE):
        (out / name).unlink(missing_ok=True)
    for p in [*out.glob("shard_*.bin"), *out.glob("*.tmp")]:
        p.unlink()


def _bpe_texts(paths: Sequence[Path]) -> Iterator[str]:
    for c in chunks(paths, 1 << 20):
        yield from _texts(c)


def _checked_inputs(
    corpus_paths: Sequence[str | Path],
    out_dir: str | Path,
    shard_tokens: int,
    tokenizer: Path | None,
    train_bpe_vocab: int | None,
) -> tuple[list[Path], Path]:
    """The corpus files and the output directory, or a DataError before anything is written."""
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive (got {shard_tokens})")
    if tokenizer is not None and train_bpe_vocab is not None:
        raise DataError("give either --tokenizer FILE or --train-bpe VOCAB, not both")
    paths = [Path(p) for p in corpus_paths]
    for p in paths:
        if not p.exists():
            raise DataError(f"corpus file not found: {p}")
        if not p.is_file():  # a directory, or a pipe that would be read without end
            raise DataError(f"corpus {p} is not a regular file")
    if not any(p.stat().st_size for p in paths):
        raise DataError(f"the corpus is empty: {[str(p) for p in corpus_paths]}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is an existing file, not a directory; give a directory for the shards")
    if tokenizer is not None:
        if not Path(tokenizer).is_file():
            raise DataError(f"--tokenizer {tokenizer}: file not found")
        if Path(tokenizer).resolve() == (out / TOKENIZER_FILE).resolve():
            raise DataError(
                f"--tokenizer {tokenizer} is the tokenizer of the output directory; copy it elsewhere first"
            )
    return paths, out


def _tokenizer_spec(tokenizer: Path | None, train_bpe_vocab: int | None, eos: str | None) -> str:
    """The tokenizer setting as the settings key records it (a given file by its content)."""
    return (
        f"file:{hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()}:{eos}"
        if tokenizer
        else f"bpe:{train_bpe_vocab}"
        if train_bpe_vocab
        else "bytes"
    )


def _journal(out: Path, key: str) -> dict:
    """Where an interrupted prepare with the same settings stopped; with other settings, a fresh
    journal and the earlier run's files removed."""
    out.mkdir(parents=True, exist_ok=True)
    journal = _read_json(out / JOURNAL)
    if journal.get("key") != key:
        _start_over(out)
        journal = {"key": key, "shards": [], "chunk": 0, "skip": 0, "documents": 0}
    return journal


def _write_shards(
    out: Path,
    work: list[Chunk],
    tok: Tokenizer,
    journal: dict,
    shard_tokens: int,
    workers: int | None,
    progress: bool,
) -> tuple[list[dict], int]:
    """Tokenize the chunks from where the journal resumes into shards, journalled after each; the
    shards and the count of documents."""
    cursor = {"chunk": journal["chunk"], "skip": journal["skip"], "documents": journal["documents"]}

    def record() -> None:  # after each shard: where the input resumes (a chunk, tokens of it to skip)
        state = {**journal, **cursor, "skip": cursor["skip"] + writer.consumed, "shards": writer.shards}
        tmp = out / (JOURNAL + ".tmp")
        tmp.write_text(json.dumps(state), encoding="utf-8")
        tmp.replace(out / JOURNAL)

    writer = ShardWriter(out, tok.dtype, shard_tokens, journal["shards"], record)
    documents = journal["documents"]
    with _Progress(
        progress, sum(c.end - c.start for c in work), sum(c.end - c.start for c in work[: journal["chunk"]])
    ) as bar:
        for i, (ids, nbytes, docs) in enumerate(_run(work[journal["chunk"] :], tok, workers), start=journal["chunk"]):
            skip = journal["skip"] if i == journal["chunk"] else 0  # already in shards written before
            cursor.update(chunk=i, skip=skip, documents=documents)
            writer.add(ids[skip:])
            documents += docs
            bar.advance(nbytes, ids.size - skip)
        shards = writer.close()
    return shards, documents


def prepare(
    corpus_paths: Sequence[str | Path],
    out_dir: str | Path,
    shard_tokens: int = 1 << 27,
    *,
    tokenizer: Path | None = None,
    train_bpe_vocab: int | None = None,
    eos: str | None = None,
    workers: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    progress: bool = False,
) -> dict:
    """Tokenize the corpus into `out_dir` (see the module docstring); returns the manifest."""
    paths, out = _checked_inputs(corpus_paths, out_dir, shard_tokens, tokenizer, train_bpe_vocab)
    key = _settings_key(paths, _tokenizer_spec(tokenizer, train_bpe_vocab, eos), shard_tokens, chunk_bytes)
    if _read_json(out / MANIFEST).get("prepare_key") == key:
        return _read_json(out / MANIFEST)  # already prepared from these inputs with these settings
    journal = _journal(out, key)
    tok = _tokenizer(paths, out, tokenizer, train_bpe_vocab, eos, journal)
    shards, documents = _write_shards(out, chunks(paths, chunk_bytes), tok, journal, shard_tokens, workers, progress)
    manifest = {
        "format": FORMAT,
        "tokenizer": tok.describe(),
        "vocab": tok.vocab,
        "dtype": tok.dtype,
        "eos": tok.eos,
        "documents": documents,
        "total_tokens": sum(s["tokens"] for s in shards),
        "max_id": max(s["max_id"] for s in shards),
        "shard_tokens": shard_tokens,
        "shards": shards,
        "inputs": input_records(paths),
        "prepare_key": key,
    }
    write_manifest(out, manifest)
    (out / JOURNAL).unlink(missing_ok=True)
    return manifest


def input_records(paths: Sequence[Path]) -> list[dict]:
    """The corpus files as the manifest lists them: each by its path relative to the files' common
    directory (a tree of sources holds many `__init__.py`: a basename would not tell them apart)."""
    resolved = [p.resolve() for p in paths]
    root = Path(os.path.commonpath([r.parent for r in resolved]))
    return [{"file": r.relative_to(root).as_posix(), "bytes": r.stat().st_size} for r in resolved]


def _tokenizer(
    paths: Sequence[Path], out: Path, given: Path | None, bpe_vocab: int | None, eos: str | None, journal: dict
) -> Tokenizer:
    if given is not None:
        tok = from_file(given, eos)
        shutil.copyfile(given, out / TOKENIZER_FILE)  # the dataset carries its tokenizer
        return from_file(out / TOKENIZER_FILE, tok.eos_token)
    if bpe_vocab is not None:
        trained = out / TOKENIZER_FILE
        if journal.get("tokenizer_sha256") and trained.is_file():  # a resume: the BPE trained before
            tok = from_file(trained, None, kind="bpe")
            if tok.sha256 == journal["tokenizer_sha256"]:
                return tok
        tok = train_bpe(_bpe_texts(paths), bpe_vocab, trained)
        journal["tokenizer_sha256"] = tok.sha256
        return tok
    return byte_tokenizer()


def _run(todo: list[Chunk], tok: Tokenizer, workers: int | None) -> Iterator[tuple[np.ndarray, int, int]]:
    """Tokenized chunks in input order: in this process for one chunk or one worker, else in a pool
    of spawned processes (the parent may run rich's refresh thread, which a fork would copy
    mid-lock). A worker that dies ends the prepare with BrokenProcessPool instead of a hang; the
    prepare dying (SIGKILL included) kills its workers."""
    n = min(workers or os.cpu_count() or 1, len(todo))
    if n <= 1:
        _init(tok)
        yield from map(_tokenize, todo)
        return
    with ProcessPoolExecutor(
        n, mp_context=mp.get_context("spawn"), initializer=_init, initargs=(tok, os.getpid())
    ) as pool:
        yield from pool.map(_tokenize, todo)


class _Progress:
    """A rich progress bar on stderr (bytes read, bytes/s, tokens and tokens/s), or nothing."""

    def __init__(self, show: bool, total: int, done: int):
        self.bar = None
        if show:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(
                TextColumn("tokenizing"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TextColumn("{task.fields[tokens]:,} tokens, {task.fields[rate]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.task = self.bar.add_task("tokenizing", total=total, completed=done, tokens=0, rate="")
            self.tokens = 0

    def __enter__(self) -> _Progress:
        if self.bar:
            self.bar.start()
        return self

    def advance(self, nbytes: int, tokens: int) -> None:
        if self.bar:
            self.tokens += tokens
            elapsed = self.bar.tasks[0].elapsed or 1e-9
            self.bar.update(
                self.task, advance=nbytes, tokens=self.tokens, rate=f"{self.tokens / elapsed:,.0f} tokens/s"
            )

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()
