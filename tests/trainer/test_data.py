"""Token shards, manifest checksums and the per-rank, resumable loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from supernode.trainer.data.loader import TokenLoader, decode, encode
from supernode.trainer.data.manifest import DataError, read_manifest
from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

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


# -- memmap, verification once, permutation, blends (issue 14) ------------------------------------

import os
import subprocess
import sys

import numpy as np

from supernode.trainer.data import manifest as manifest_module
from supernode.trainer.data.loader import permute
from supernode.trainer.data.manifest import MANIFEST, VERIFIED, ensure_verified, verify
from supernode.trainer.data.prepare import write_synthetic


def synthetic(out: Path, tokens: int, vocab: int = 1000, seed: int = 0, shard_tokens: int = 1 << 20) -> Path:
    return write_synthetic(out, tokens, vocab, seed, shard_tokens)


def test_permutation_is_a_bijection_fixed_by_its_key():
    for n in (1, 2, 7, 1000, 4097):
        p = permute(np.arange(n), n, key=42)
        assert sorted(p.tolist()) == list(range(n))
    assert not np.array_equal(permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2))
    assert np.array_equal(permute(np.arange(5, 9), 1000, 1), permute(np.arange(1000), 1000, 1)[5:9])


def test_verification_happens_once_until_a_shard_changes(shards, monkeypatch):
    ensure_verified(shards)  # prepare left the marker; this reads no shard
    assert (shards / VERIFIED).is_file()

    def no_hashing(path, dtype):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(manifest_module, "scan_shard", no_hashing)
    ensure_verified(shards)
    loader(shards).next_step()
    os.utime(shards / "shard_00001.bin")  # rewritten since: verified again, in full
    with pytest.raises(AssertionError, match=r"shard_00000\.bin hashed again"):
        ensure_verified(shards)


@pytest.mark.parametrize("lie", ["shard-max-id", "manifest-max-id", "vocab"])
def test_verify_reads_the_ids_not_the_manifests_word_for_them(tmp_path, lie):
    """Issue 30 #12: a manifest claiming max_id 200 over ids up to 8001 verified, and training then
    died with an IndexError on every rank. The shards' sha256 are intact here: only the claims lie."""
    d = synthetic(tmp_path / "d", 10_000, shard_tokens=997)
    m = json.loads((d / MANIFEST).read_text())
    true_top = m["max_id"]
    if lie == "shard-max-id":
        m["shards"][3]["max_id"] = 200
    elif lie == "manifest-max-id":
        m["max_id"] = 200
    else:  # a vocab below the ids the shards hold (and the max_id claims that match it)
        m["vocab"] = 201
        m["max_id"] = 200
        for s in m["shards"]:
            s["max_id"] = min(s["max_id"], 200)
    (d / MANIFEST).write_text(json.dumps(m))
    (d / VERIFIED).unlink(missing_ok=True)
    expected = {
        "shard-max-id": r"shard_00003\.bin: the manifest says max_id 200, the shard's largest id is \d+",
        "manifest-max-id": rf"manifest\.json: max_id 200, but the shards' largest id is {true_top}",
        "vocab": r"shard_\d+\.bin holds token id \d+, outside the manifest's vocab of 201",
    }[lie]
    with pytest.raises(DataError, match=expected):
        verify(d)
    assert not (d / VERIFIED).exists()


def test_windows_cross_shards_and_read_the_token_stream(tmp_path):
    d = synthetic(tmp_path / "d", 10_000, shard_tokens=997)
    stream = np.concatenate([np.fromfile(d / f"shard_{i:05d}.bin", dtype=np.uint16) for i in range(11)])
    ld = TokenLoader(d, 50, 8, 4, 0, 1, 3)
    for w in (0, 19, 39, 198):  # 19: tokens 950-1000 straddle shards 0 and 1
        assert np.array_equal(ld.datasets[0].window(w), stream[w * 50 : w * 50 + 51])


def test_blend_proportions_and_resume_at_another_world_size(tmp_path):
    a, b = synthetic(tmp_path / "a", 40_000, seed=1), synthetic(tmp_path / "b", 40_000, seed=2)
    blend = [{"path": "a", "weight": 3}, {"path": "b", "weight": 1}]

    def make(rank=0, dp=1):
        return TokenLoader(tmp_path, SEQ, 8, 2, rank, dp, 5, vocab=1000, blend=blend)

    one = make()
    steps = [torch.cat(one.next_step()) for _ in range(400)]
    picks = one.choices(0, 400 * 8)
    assert abs((picks == 0).mean() - 0.75) < 0.03  # 3:1 within tolerance over 400 steps
    stream_b = np.concatenate([np.fromfile(p, dtype=np.uint16) for p in sorted(b.glob("shard_*.bin"))]).tobytes()
    from_b = sum(row.numpy().astype(np.uint16).tobytes() in stream_b for step in steps[:50] for row in step)
    assert from_b == (picks[:400] == 1).sum()  # each sample came from the dataset its pick names
    assert not torch.equal(torch.cat(TokenLoader(tmp_path, SEQ, 8, 2, 0, 1, 6, blend=blend).next_step()), steps[0])
    # saved after 100 steps on one rank, resumed on two: the same global batches
    first = make()
    for _ in range(100):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))
    assert state["samples"] == 800 and len(state["datasets"]) == 2
    ranks = [make(r, 2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    for expected in steps[100:130]:
        assert torch.equal(torch.cat([torch.cat(r.next_step()) for r in ranks]), expected)
    with pytest.raises(DataError, match=r"data state is of 2 dataset\(s\), training.data names 1"):
        TokenLoader(a, SEQ, 8, 2, 0, 1, 5).load_state_dict(state)


def test_vocab_larger_than_the_model_names_both_numbers(tmp_path):
    d = synthetic(tmp_path / "d", 5_000, vocab=50_000)
    with pytest.raises(
        DataError, match=r"tokenizer has 50000 tokens; set model.vocab to at least 50000.* at most 4096"
    ):
        TokenLoader(d, SEQ, 8, 2, 0, 1, 0, vocab=4096)


RSS = """
import sys, resource
from supernode.trainer.data.loader import TokenLoader
def anon():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
before = anon()
ld = TokenLoader(sys.argv[1], 512, 64, 8, 0, 8, 0)  # 300 steps: 19 MB of windows read
for _ in range(300):
    ld.next_step()
print(anon() - before)
"""


def test_loader_resident_memory_does_not_grow_with_the_dataset(tmp_path):
    grown = []
    for mb in (8, 128):
        d = synthetic(tmp_path / str(mb), mb << 19, shard_tokens=1 << 22)
        r = subprocess.run([sys.executable, "-c", RSS, str(d)], capture_output=True, text=True, check=True)
        grown.append(int(r.stdout) / 1024)  # MiB resident (anonymous and mapped file pages) the loader added
    assert grown[1] - grown[0] < 4, grown  # 16x the data, the same memory (the old loader held it all)


def test_document_masking_takes_the_eos_id_from_the_manifests(tmp_path):
    a, b = synthetic(tmp_path / "a", 5_000), synthetic(tmp_path / "b", 5_000)
    blend = [{"path": "a", "weight": 1}, {"path": "b", "weight": 1}]
    assert TokenLoader(tmp_path, SEQ, 8, 2, 0, 1, 0, blend=blend).eos is None  # off: the windows are one sequence
    assert TokenLoader(tmp_path, SEQ, 8, 2, 0, 1, 0, blend=blend, documents=True).eos == 0

    def rewrite(path: Path, **changes):
        manifest = {k: v for k, v in json.loads((path / "manifest.json").read_text()).items() if k != "eos"}
        (path / "manifest.json").write_text(json.dumps({**manifest, **changes}))

    rewrite(b, eos=7)
    with pytest.raises(
        DataError,
        match=rf"training.documentMasking is true but the blend's datasets end documents "
        rf"with different eos ids \({a}: 0, {b}: 7\); prepare them with one tokenizer",
    ):
        TokenLoader(tmp_path, SEQ, 8, 2, 0, 1, 0, blend=blend, documents=True)
    rewrite(b)  # no eos recorded
    with pytest.raises(DataError, match=rf"training.documentMasking is true but {b / 'manifest.json'} records no eos"):
        TokenLoader(tmp_path, SEQ, 8, 2, 0, 1, 0, blend=blend, documents=True)
    assert TokenLoader(b, SEQ, 8, 2, 0, 1, 0).eos is None  # needed only with document masking
    rewrite(b, eos=1000)
    with pytest.raises(DataError, match=r"eos must be a token id below the vocab of 1000 \(got 1000\)"):
        read_manifest(b)


@pytest.mark.parametrize("name", ["../../../../etc/hostname", "/etc/hostname", "sub/shard.bin", "..", None, 7])
def test_a_manifest_file_outside_its_folder_or_not_a_name_is_refused(tmp_path, name):
    """Issue 30 #9 (data half) and #11: paths escaping the folder were read; `"file": null` crashed."""
    d = synthetic(tmp_path / "d", 2_000, shard_tokens=997)
    m = json.loads((d / MANIFEST).read_text())
    m["shards"][1]["file"] = name
    (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match="not a plain file name|a file name is required"):
        verify(d)
