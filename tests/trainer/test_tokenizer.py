"""Tokenizers and `prepare`: a BPE trained on the shipped corpus, a given tokenizer.json, dtype
selection, EOS between documents, parallel = serial shards, and an interrupted prepare resumed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from supernode.core.runs import run_of
from supernode.trainer.data.manifest import DataError, read_manifest, verify
from supernode.trainer.data.prepare import DEFAULT_CORPUS, ShardWriter, prepare
from supernode.trainer.data.tokenizer import EOS_TOKEN, byte_tokenizer, dtype_for, from_file

TEXT = "Grüße, 世界: def f(x):\n    return x ** 2  # the docs\n\n\tTabs and NUL-free bytes ~ é"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    prepare(DEFAULT_CORPUS, out, shard_tokens=20_000, train_bpe_vocab=1024)
    return out


def test_dtype_is_the_smallest_that_holds_the_vocab():
    assert [dtype_for(v) for v in (256, 257, 4096, 65536, 65537, 128000)] == [
        "uint8",
        "uint16",
        "uint16",
        "uint16",
        "uint32",
        "uint32",
    ]


def test_bpe_trained_on_the_corpus_round_trips_and_compresses(bpe):
    m = read_manifest(bpe)
    tok = from_file(bpe / "tokenizer.json")
    assert (m["vocab"], m["dtype"], m["eos"], tok.eos_token) == (1024, "uint16", 0, EOS_TOKEN)
    assert m["tokenizer"] == {"kind": "bpe", "file": "tokenizer.json", "sha256": tok.sha256, "eos_token": EOS_TOKEN}
    assert tok.decode(tok.encode(TEXT)) == TEXT  # byte-level: any text, exactly
    corpus = DEFAULT_CORPUS[0].read_text()
    assert len(corpus.encode()) / m["total_tokens"] > 2.5  # a real BPE, not bytes
    ids = np.concatenate([np.fromfile(bpe / s["file"], dtype=np.uint16) for s in m["shards"]])
    assert tok.decode(ids) == corpus and ids.max() == m["max_id"] < 1024
    assert [s["tokens"] for s in m["shards"]][:-1] == [20_000] * (len(m["shards"]) - 1)  # fixed-size shards


def test_a_given_tokenizer_json_is_copied_and_recorded(bpe, tmp_path):
    m = prepare(DEFAULT_CORPUS, tmp_path / "d", tokenizer=bpe / "tokenizer.json")
    assert (tmp_path / "d" / "tokenizer.json").read_bytes() == (bpe / "tokenizer.json").read_bytes()
    assert m["tokenizer"]["kind"] == "huggingface" and m["total_tokens"] == read_manifest(bpe)["total_tokens"]
    with pytest.raises(DataError, match=r"no end-of-document token <nope>.*--eos TOKEN"):
        prepare(DEFAULT_CORPUS, tmp_path / "e", tokenizer=bpe / "tokenizer.json", eos="<nope>")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match=r"bad\.json: not a Hugging Face tokenizer\.json"):
        prepare(DEFAULT_CORPUS, tmp_path / "f", tokenizer=tmp_path / "bad.json")


def test_documents_are_separated_by_eos(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third"}) + "\n")
    m = prepare([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "d")
    assert m["documents"] == 3 and m["eos"] == 0
    assert (tmp_path / "d" / "shard_00000.bin").read_bytes() == b"first\x00second\x00third"
    (tmp_path / "c.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(DataError, match=r"c\.jsonl: line at byte 0 is not a JSON object with a \"text\" string"):
        prepare([tmp_path / "c.jsonl"], tmp_path / "e")


def test_bad_corpus_lines_and_files_name_where_they_are(tmp_path):
    """Issue 30 #11 and "also seen": a lone surrogate was an internal error, a bad line was "near byte
    0" whatever its place, a directory or a pipe as the corpus was "not found"."""
    good = json.dumps({"text": "fine"}) + "\n"
    (tmp_path / "s.jsonl").write_text(good + '{"text": "a\\ud800b"}\n')
    with pytest.raises(DataError, match=rf"s\.jsonl: line at byte {len(good)} has a lone surrogate escape"):
        prepare([tmp_path / "s.jsonl"], tmp_path / "a")
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "\ud83d\ude00"}) + "\n")  # a pair: one emoji, fine
    assert prepare([tmp_path / "p.jsonl"], tmp_path / "b")["documents"] == 1
    (tmp_path / "j.jsonl").write_text(good + good + "{oops\n")
    with pytest.raises(DataError, match=rf"j\.jsonl: line at byte {2 * len(good)} is not JSON \(column 2: "):
        prepare([tmp_path / "j.jsonl"], tmp_path / "c")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for name in ("dir", "fifo"):
        with pytest.raises(DataError, match=rf"corpus .*{name} is not a regular file"):
            prepare([tmp_path / name], tmp_path / "d")


def test_parallel_workers_write_the_same_shards_as_one(tmp_path):
    files = []
    for i in range(3):
        files.append(tmp_path / f"c{i}.txt")
        files[-1].write_text(DEFAULT_CORPUS[0].read_text()[i * 20_000 : (i + 1) * 60_000])
    one = prepare(files, tmp_path / "one", 25_000, workers=1, chunk_bytes=16_000)
    two = prepare(files, tmp_path / "two", 25_000, workers=2, chunk_bytes=16_000)
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]
    assert one["documents"] == 3 and b"".join(
        (tmp_path / "one" / s["file"]).read_bytes() for s in one["shards"]
    ) == b"\x00".join(f.read_bytes() for f in files)


def test_an_interrupted_prepare_resumes_where_it_stopped(tmp_path, monkeypatch):
    whole = prepare(DEFAULT_CORPUS, tmp_path / "whole", 30_000, chunk_bytes=50_000)
    flush, written = ShardWriter._flush, []

    def dies_after_three(self):
        if len(written) == 3:
            raise KeyboardInterrupt  # Ctrl-C (or a kill) mid-prepare
        flush(self)
        written.append(self.shards[-1]["file"])

    monkeypatch.setattr(ShardWriter, "_flush", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(DEFAULT_CORPUS, tmp_path / "d", 30_000, chunk_bytes=50_000)
    assert not (tmp_path / "d" / "manifest.json").exists()  # half a dataset is never one
    monkeypatch.setattr(ShardWriter, "_flush", lambda self: (flush(self), written.append(self.shards[-1]["file"])))
    done = prepare(DEFAULT_CORPUS, tmp_path / "d", 30_000, chunk_bytes=50_000)
    assert written[3] == "shard_00003.bin"  # resumed: shards 0-2 were not written again
    assert done["shards"] == whole["shards"] and done["documents"] == 1
    verify(tmp_path / "d")
    other = prepare(DEFAULT_CORPUS, tmp_path / "d", 50_000)  # other settings: starts over cleanly
    assert [s["tokens"] for s in other["shards"]][0] == 50_000 and not list((tmp_path / "d").glob("*.tmp"))
    assert sorted(p.name for p in (tmp_path / "d").glob("shard_*")) == [s["file"] for s in other["shards"]]


def test_byte_tokenizer_keeps_the_demo_format():
    tok = byte_tokenizer()
    assert (tok.vocab, tok.dtype, tok.eos) == (256, "uint8", 0)
    assert tok.decode(tok.encode(TEXT)) == TEXT


# -- the data's vocabulary against the model's: plan, preview, trainer ------------------------------

import subprocess
import sys

from supernode.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]


def stack_file(tmp_path: Path, vocab: int, local_vocab: int = 256) -> Path:
    """Pulumi.dev.yaml with other model.vocab values (the stack's, and its local section's)."""
    text = (ROOT / "Pulumi.dev.yaml").read_text()
    assert "    vocab: 32768\n" in text and "      vocab: 256\n" in text
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(
        text.replace("    vocab: 32768\n", f"    vocab: {vocab}\n").replace(
            "      vocab: 256\n", f"      vocab: {local_vocab}\n"
        )
    )
    return path


def test_vocab_mismatch_is_exit_2_from_plan_and_preview(bpe, tmp_path, capsys):
    small = stack_file(tmp_path, 1000)
    assert cli(["plan", "--config", str(small), "--data", str(bpe)]) == 2
    err = capsys.readouterr().err
    assert "holds token id 1023, outside the model's vocab of 1000: its bpe tokenizer has 1024 tokens" in err
    assert "; set model.vocab to at least 1024" in err  # the cluster plan's key, not local.model.vocab
    assert cli(["plan", "--stack", "dev", "--root", str(ROOT), "--data", str(bpe), "--json"]) == 0
    capsys.readouterr()
    assert cli(["preview", "--config", str(small), "--data", str(bpe), "--json"]) == 2
    assert "model's vocab of 1000: its bpe tokenizer has 1024 tokens" in capsys.readouterr().err


def test_vocab_mismatch_is_exit_2_from_the_trainer(bpe, tmp_path):
    from supernode.core.config import from_mapping, load_stack
    from supernode.core.plan import build_local_plan

    cfg = load_stack("dev", ROOT).to_mapping()  # one rank: local vocab 256, the data's 1024
    cfg["local"].update(nproc=1, parallel={**cfg["local"]["parallel"], "dpShard": 1, "ep": 1})
    plan = tmp_path / "plan.json"
    plan.write_text(build_local_plan("dev", from_mapping(cfg), 1).to_json())
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "supernode.trainer.train",
            "--plan",
            str(plan),
            "--data",
            str(bpe),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={
            **__import__("os").environ,
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29731",
            "OMP_NUM_THREADS": "1",
        },
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (
        # a local run's vocab is local.model.vocab: model.vocab is the cluster's and changes nothing here
        "outside the model's vocab of 256: its bpe tokenizer has 1024 tokens; set local.model.vocab to at least 1024"
        in r.stderr
    )


@pytest.mark.slow
def test_a_demo_sized_run_trains_on_a_trained_bpe(tmp_path, capsys):
    data = tmp_path / "bpe"
    assert cli(["data", "prepare", "--train-bpe", "4096", "--out", str(data), "--shard-tokens", "16384"]) == 0
    assert "vocab 4,096, uint16, EOS id 0" in capsys.readouterr().out
    config = stack_file(tmp_path, 32768, local_vocab=4096)
    out = tmp_path / "run"
    assert (
        cli(
            [
                "train",
                "--config",
                str(config),
                "--local",
                "--data",
                str(data),
                "--out",
                str(out),
                "--steps",
                "12",
                "--log-every",
                "4",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (run_of(out) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if isinstance(r.get("loss"), float)]
    assert losses[0] > 7.5 and losses[-1] < losses[0] - 0.5  # ln 4096 = 8.3 at the start, then it learns


def test_verify_checks_the_tokenizer_file_too(bpe, tmp_path):
    import shutil

    data = tmp_path / "d"
    shutil.copytree(bpe, data)
    verify(data)
    (data / "tokenizer.json").write_text((data / "tokenizer.json").read_text().replace('"<|endoftext|>"', '"<|eot|>"'))
    with pytest.raises(DataError, match=r"tokenizer .*tokenizer.json is corrupt or replaced: sha256"):
        verify(data)
    (data / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"tokenizer .*tokenizer.json is missing"):
        verify(data)
