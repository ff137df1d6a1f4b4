"""Document masking (`training.documentMasking`): a packed window computes what each of its
documents would alone, the loss counts no target across a boundary and is normalised by the
step's global count, and a dataset without an EOS id is refused (exit 2 naming the field).
The pipeline-parallel equality is in test_pipeline.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from supernode.core.config import Model, from_mapping, load_stack
from supernode.core.runs import run_of
from supernode.trainer.engine import counted_per_micro_batch
from supernode.trainer.model import IGNORE, Transformer, document_attention, inputs_and_targets, loss_fn

ROOT = Path(__file__).resolve().parents[2]
EOS = 0
CFG = Model(
    layers=3,
    dim=32,
    heads=4,
    kv_heads=2,
    experts=4,
    top_k=2,
    shared_experts=1,
    expert_hidden=16,
    dense_hidden=48,
    first_dense_layers=1,
    vocab=64,
    seq_len=24,
)


def model(cfg: Model = CFG) -> Transformer:
    m = Transformer(cfg)
    m.init_weights(0)
    return m


def doc(n: int, seed: int) -> torch.Tensor:
    """n tokens of one document's text (no EOS)."""
    return torch.randint(1, CFG.vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_documents_positions_and_mask() -> None:
    windows = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 3], [EOS, 1, 2, 3, 4, 5, 6, EOS]])
    inputs, targets, documents = inputs_and_targets(windows, EOS)
    assert documents.tolist() == [[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]]  # an EOS ends its document
    assert targets.tolist() == [[6, EOS, IGNORE, EOS, IGNORE, 9, 3], [IGNORE, 2, 3, 4, 5, 6, EOS]]
    table = torch.arange(8.0)[:, None].expand(8, 2)  # row p holds p: the gathered rows are the positions
    cos, _, mask = document_attention(table, table, documents)
    assert cos[..., 0].tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 0, 1, 2, 3, 4, 5]]
    assert mask.shape == (2, 1, 7, 7)
    assert mask[0, 0, 6].tolist() == [False] * 5 + [True, True]  # the last document, causally
    assert mask[0, 0, 2].tolist() == [True] * 3 + [False] * 4  # the EOS sees its document, not the next
    assert mask[1, 0].sum().item() == 1 + 21  # 1 + (1 + ... + 6)
    # off: the tables unchanged and no mask (SDPA's causal kernel), targets untouched
    assert document_attention(table, table, None) == (table, table, None)
    assert inputs_and_targets(windows)[1].tolist() == windows[:, 1:].tolist()


def test_a_packed_window_computes_each_document_as_if_alone() -> None:
    """Row 0: the tail of a document, a whole one and the start of a third; row 1: two documents."""
    m = model()
    tail, whole, start = doc(5, 1), doc(9, 2), doc(8, 3)
    first, second = doc(11, 4), doc(10, 5)
    eos = torch.tensor([EOS])
    windows = torch.stack(
        [torch.cat([tail, eos, whole, eos, start, doc(1, 6)]), torch.cat([first, eos, second, eos, doc(2, 7)])]
    )
    inputs, _, documents = inputs_and_targets(windows, EOS)
    with torch.no_grad():
        packed, crossing = m(inputs, documents), m(inputs)
        for row, pieces in (
            (0, (torch.cat([tail, eos]), torch.cat([whole, eos]), start)),
            (1, (torch.cat([first, eos]), torch.cat([second, eos]), doc(2, 7)[:1])),
        ):
            at = 0
            for piece in pieces:
                alone = m(piece[None])[0]
                torch.testing.assert_close(packed[row, at : at + len(piece)], alone, rtol=1e-5, atol=1e-5)
                if at:  # off, a later document attends across the EOS and its positions run on: not the same
                    assert (crossing[row, at : at + len(piece)] - alone).abs().max() > 1e-2
                at += len(piece)
            assert at == inputs.shape[1]


def test_the_loss_counts_no_target_across_a_boundary() -> None:
    windows = torch.stack(
        [torch.cat([doc(4, 1), torch.tensor([EOS]), doc(4, 2)]), torch.cat([doc(6, 3), torch.tensor([EOS]), doc(2, 4)])]
    )
    _, targets, _ = inputs_and_targets(windows, EOS)
    logits = torch.randn(2, 8, CFG.vocab, generator=torch.Generator().manual_seed(0))
    counted = targets != IGNORE
    assert counted.sum() == 14 and not counted[0, 4] and not counted[1, 6]
    expected = F.cross_entropy(logits[counted], windows[:, 1:][counted])
    torch.testing.assert_close(loss_fn(logits, targets), expected)
    changed = logits.clone()
    changed[0, 4], changed[1, 6] = 100.0, -100.0  # the predictions made from an EOS do not matter
    torch.testing.assert_close(loss_fn(changed, targets), expected)
    # a given divisor replaces the count: the sum over counted targets, divided by it
    torch.testing.assert_close(loss_fn(logits, targets, 7.0), expected * 14 / 7)


def test_the_normaliser_is_the_steps_counted_total_not_a_mean_of_means(group) -> None:
    """Two micro-batches of 15 inputs, with 15 and 11 counted targets: each loss is its sum over
    (26 / 2), so their mean is the mean over all 26 targets; a mean of the two means would weigh
    a token of the second more."""
    eos = torch.tensor([EOS])
    micro = [
        torch.cat([doc(15, 1), eos])[None],
        torch.cat([doc(3, 2), eos, doc(2, 3), eos, doc(4, 4), eos, doc(2, 5), eos, doc(1, 6)])[None],
    ]
    batches = [inputs_and_targets(mb, EOS) for mb in micro]
    assert [int((t != IGNORE).sum()) for _, t, _ in batches] == [15, 11]
    counted = counted_per_micro_batch(micro, EOS, torch.device("cpu"))
    assert counted.item() == 26 / 2  # one rank: the step's counted targets per micro-batch
    g = torch.Generator().manual_seed(0)
    losses, sums, means = [], [], []
    for scale, (_, targets, _) in zip((1.0, 4.0), batches):  # the two micro-batches' mean losses far apart
        logits = scale * torch.randn(1, 15, CFG.vocab, generator=g)
        losses.append(loss_fn(logits, targets, counted))
        sums.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"))
        means.append(loss_fn(logits, targets))
    step = sum(losses) / len(losses)  # what the trainer reports and differentiates (then the dp mean)
    torch.testing.assert_close(step, sum(sums) / 26)
    assert abs(step - sum(means) / 2) > 0.1
    # without document masking every target counts: micro_batch x seq_len, no collective
    assert counted_per_micro_batch(micro, None, torch.device("cpu")) == 15.0


# -- through the trainer: `supernode train --local` ----------------------------------------------


def stack_file(path: Path, nproc: int = 1, pp: int = 1, **training) -> Path:
    """The dev stack, its local run on `nproc` ranks at pp `pp` (no data or expert parallelism), with
    local training overrides (camelCase keys)."""
    data = load_stack("dev", ROOT).to_mapping()
    data["local"]["nproc"] = nproc
    data["local"]["parallel"].update({"dpShard": 1, "ep": 1, "pp": pp})
    data["local"]["training"].update({"warmupSteps": 2, **training})
    from_mapping(data)  # valid as written
    path.write_text(yaml.safe_dump({"config": {f"supernode:{k}": v for k, v in data.items()}}))
    return path


@pytest.fixture(scope="module")
def documents_data(tmp_path_factory) -> Path:
    """The shipped corpus as JSON lines of short documents (paragraphs), so most windows hold an EOS."""
    from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

    tmp = tmp_path_factory.mktemp("documents")
    text = DEFAULT_CORPUS[0].read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if p.strip()][:400]
    (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs), encoding="utf-8")
    manifest = prepare([tmp / "docs.jsonl"], tmp / "tokens", shard_tokens=1 << 16)
    assert manifest["eos"] == EOS and manifest["documents"] == 400
    return tmp / "tokens"


def supernode_train(stack: Path, data: Path, out: Path, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "supernode",
            "train",
            "--config",
            str(stack),
            "--local",
            "--steps",
            str(steps),
            "--out",
            str(out),
            "--data",
            str(data),
            "--log-every",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_of(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_document_masking_trains_the_same_with_and_without_pipeline_stages(tmp_path, documents_data) -> None:
    """One rank, and two ranks as two pipeline stages: the same batches, the same losses."""
    runs = {}
    for pp in (1, 2):
        stack = stack_file(tmp_path / f"pp{pp}.yaml", nproc=pp, pp=pp, documentMasking=True)
        r = supernode_train(stack, documents_data, tmp_path / f"pp{pp}", 4)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        runs[pp] = losses(tmp_path / f"pp{pp}")
    assert len(runs[1]) == 4 and runs[1][-1] < runs[1][0]  # it learned
    assert runs[2] == pytest.approx(runs[1], rel=1e-4)
    crossing = stack_file(tmp_path / "crossing.yaml")
    assert supernode_train(crossing, documents_data, tmp_path / "crossing", 1).returncode == 0
    assert abs(losses(tmp_path / "crossing")[0] - runs[1][0]) > 1e-4  # the option changes what is computed


@pytest.mark.slow
def test_document_masking_on_a_dataset_without_eos_exits_2(tmp_path, documents_data) -> None:
    data = tmp_path / "tokens"
    shutil.copytree(documents_data, data)
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["eos"]  # as a dataset prepared without a document separator
    (data / "manifest.json").write_text(json.dumps(manifest))
    r = supernode_train(stack_file(tmp_path / "stack.yaml", documentMasking=True), data, tmp_path / "out", 2)
    assert r.returncode == 2, (r.stdout + r.stderr)[-4000:]
    assert f"error: training.documentMasking is true but {data / 'manifest.json'} records no eos" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_plan_and_preview_refuse_document_masking_on_data_without_eos(tmp_path, documents_data, capsys) -> None:
    from supernode.cli import main as cli

    data = tmp_path / "tokens"
    shutil.copytree(documents_data, data)
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["eos"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    config = load_stack("dev", ROOT).to_mapping()
    config["training"]["documentMasking"] = True
    stack = tmp_path / "Pulumi.dev.yaml"
    stack.write_text(yaml.safe_dump({"config": {f"supernode:{k}": v for k, v in config.items()}}))
    for command in ("plan", "preview"):
        assert cli([command, "--config", str(stack), "--data", str(data), "--json"]) == 2
        assert (
            f"training.documentMasking is true but {data / 'manifest.json'} records no eos" in capsys.readouterr().err
        )
    assert cli(["plan", "--config", str(stack), "--data", str(documents_data), "--json"]) == 0  # it has one
