"""Token shards, manifest checksums and the per-rank, resumable loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.data import DEFAULT_CORPUS, DataError, TokenLoader, decode, encode, prepare, read_manifest

SEQ = 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    prepare(DEFAULT_CORPUS, out, shard_tokens=50_000)
    return out


def loader(path: Path, rank: int = 0, dp: int = 1, seed: int = 7, global_batch: int = 8) -> TokenLoader:
    return TokenLoader(path, seq_len=SEQ, global_batch=global_batch, micro_batch=2, dp_rank=rank, dp_size=dp, seed=seed)


def test_tokenizer_round_trips_unicode():
    text = "Grüße, 世界: ids < 256\n"
    ids = encode(text)
    assert ids.max() < 256 and len(ids) == len(text.encode())
    assert decode(ids) == text


def test_prepare_writes_shards_that_reassemble_the_corpus(shards):
    m = read_manifest(shards)
    corpus = b"".join(p.read_bytes() for p in DEFAULT_CORPUS)
    assert m["total_tokens"] == len(corpus) == sum(s["tokens"] for s in m["shards"])
    assert len(m["shards"]) == -(-len(corpus) // 50_000)
    assert b"".join((shards / s["file"]).read_bytes() for s in m["shards"]) == corpus
    assert all(len(s["sha256"]) == 64 for s in m["shards"])


def test_shipped_corpus_is_real_text():
    text = "".join(p.read_text() for p in DEFAULT_CORPUS)
    assert 100_000 < len(text.encode()) < 500_000
    assert "Module json" in text and text.count(" the ") > 1000


def test_each_rank_gets_its_own_slice_of_the_same_global_batch(shards):
    single = torch.cat(loader(shards).next_step())
    ranks = [torch.cat(loader(shards, r, 2).next_step()) for r in range(2)]
    assert not torch.equal(ranks[0], ranks[1])
    assert torch.equal(torch.cat(ranks), single)  # same global batch at any dp size
    assert single.shape == (8, SEQ + 1)
    corpus = b"".join(p.read_bytes() for p in DEFAULT_CORPUS)
    assert all(bytes(row.tolist()) in corpus for row in single)  # inputs + next-token targets: contiguous text
    assert not torch.equal(torch.cat(loader(shards, seed=8).next_step()), single)


def test_same_seed_same_stream_and_resume_mid_epoch(shards):
    a = loader(shards, 1, 2)
    steps = [a.next_step() for _ in range(5)]
    b = loader(shards, 1, 2)
    for _ in range(3):
        b.next_step()
    state = json.loads(json.dumps(b.state_dict()))  # survives serialisation
    assert state == {"epoch": 0, "position": 24}
    c = loader(shards, 1, 2, seed=7)
    c.load_state_dict(state)
    for expected in steps[3:]:
        assert all(torch.equal(x, y) for x, y in zip(c.next_step(), expected))


def test_epochs_wrap_with_a_new_order(shards):
    a = loader(shards, global_batch=8)
    a.load_state_dict({"epoch": 0, "position": a.windows - a.windows % 8})
    first_of_epoch1 = a.next_step()
    assert a.state_dict() == {"epoch": 1, "position": 8}
    b = loader(shards)
    assert not all(torch.equal(x, y) for x, y in zip(first_of_epoch1, b.next_step()))


def test_corrupt_shard_is_named(tmp_path):
    prepare(DEFAULT_CORPUS, tmp_path, shard_tokens=100_000)
    shard = tmp_path / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard .*shard_00001\.bin is corrupt: sha256"):
        loader(tmp_path)


def test_missing_and_truncated_shards_are_named(tmp_path):
    prepare(DEFAULT_CORPUS, tmp_path, shard_tokens=100_000)
    (tmp_path / "shard_00002.bin").write_bytes(b"short")
    with pytest.raises(DataError, match=r"shard_00002\.bin is corrupt: 5 tokens"):
        loader(tmp_path)
    (tmp_path / "shard_00002.bin").unlink()
    with pytest.raises(DataError, match=r"shard .*shard_00002\.bin is missing"):
        loader(tmp_path)


def test_missing_manifest_and_too_little_data(tmp_path):
    with pytest.raises(DataError, match="no manifest.json"):
        loader(tmp_path)
    (tmp_path / "tiny.txt").write_text("too short")
    prepare([tmp_path / "tiny.txt"], tmp_path / "d")
    with pytest.raises(DataError, match="fewer than one global batch"):
        loader(tmp_path / "d")
