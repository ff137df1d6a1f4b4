"""Memory honesty: a rank never holds the whole model, at build or at restore, and the planner's
state terms equal the bytes of the shards a rank really holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from supernode.core.config import Model, Parallel
from supernode.trainer.checkpoint import ModelState
from supernode.trainer.parallel import build_model

ROOT = Path(__file__).resolve().parents[2]
# ~110 M parameters: 440 MB in fp32, four times what each of 4 FSDP ranks holds. Large enough that the
# ~50 MB a gloo rank needs for itself stays well inside the margins below.
BIG = Model(
    layers=4,
    dim=768,
    heads=12,
    kv_heads=12,
    experts=16,
    top_k=2,
    expert_hidden=768,
    dense_hidden=1536,
    first_dense_layers=1,
    vocab=8192,
    seq_len=16,
)


def full_bytes(cfg: Model) -> int:
    with torch.device("meta"):
        from supernode.trainer.model import Transformer

        return sum(p.numel() * 4 for p in Transformer(cfg).parameters())


def build_and_restore(rank: int, world: int, ckpt: str) -> dict:
    from supernode.bench.memory import local_bytes, resident_bytes

    parallel = Parallel(dp_shard=world, ep=2, mixed_precision="fp32")
    baseline = resident_bytes()
    model = build_model(BIG, parallel, torch.device("cpu"), seed=1)
    built = resident_bytes("VmHWM") - baseline
    dcp.save({"model": ModelState(model)}, checkpoint_id=ckpt)
    again = build_model(BIG, parallel, torch.device("cpu"), seed=2)  # other weights...
    dcp.load({"model": ModelState(again)}, checkpoint_id=ckpt)  # ...replaced by the checkpoint's, in place
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), again.parameters()))
    return {
        "built": built,
        "restored": resident_bytes("VmHWM") - baseline,
        "share": local_bytes(model.parameters()),
        "same": same,
    }


@pytest.mark.slow
def test_no_rank_ever_holds_the_whole_model(tmp_path) -> None:
    from conftest import spawn

    full = full_bytes(BIG)
    ranks = spawn(build_and_restore, 4, tmp_path, str(tmp_path / "ckpt"))
    for rank, r in enumerate(ranks):
        assert r["same"], f"rank {rank}: the restored shards differ from the saved ones"
        assert r["share"] <= full / 4 * 1.01
        # Two models' shards (built, then a second one restored into) and the runtime, never one whole model.
        assert r["built"] < full / 2, f"rank {rank}: build peaked at {r['built'] / 1e6:.0f} MB of {full / 1e6:.0f} MB"
        assert r["restored"] < full, (
            f"rank {rank}: restore peaked at {r['restored'] / 1e6:.0f} MB of {full / 1e6:.0f} MB"
        )


@pytest.mark.slow
def test_bench_memory_state_terms_equal_the_plan(capsys) -> None:
    from supernode.bench.memory import main

    assert main(["--stack", "dev", "--root", str(ROOT), "--local", "--nproc", "2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["rank"] for x in lines] == [0, 1]
    for x in lines:
        for term in ("parameters", "gradients", "optimizer_state"):
            assert x[term]["plan"] == x[term]["measured"] > 0, (term, x[term])
        assert x["peak_resident_after_step"]["measured"] > 0


def test_bench_memory_full_plan_without_gpus_exits_2(capsys) -> None:
    from supernode.bench.memory import main

    if torch.cuda.device_count() >= 16:
        pytest.skip("this machine can run the full dev plan")
    assert main(["--stack", "dev", "--root", str(ROOT)]) == 2
    assert "measures the full plan on 16 GPUs; this machine has" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_memory_state_terms_equal_the_plan_under_tensor_parallel(tmp_path, capsys) -> None:
    """tp 2: the planner's layout (embedding, head and norms not split by tp; router and shared expert
    over dp_shard x tp) is the trainer's, byte for byte."""
    import yaml

    from supernode.bench.memory import main

    doc = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())
    local = doc["config"]["supernode:local"]
    local["nproc"] = 4
    local["model"].update(heads=4, kvHeads=2, sharedExperts=1)
    local["parallel"].update(dpShard=2, tp=2, ep=2)
    (tmp_path / "Pulumi.tp.yaml").write_text(yaml.safe_dump(doc))
    assert main(["--stack", "tp", "--root", str(tmp_path), "--local", "--nproc", "4"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["rank"] for x in lines] == [0, 1, 2, 3]
    for x in lines:
        for term in ("parameters", "gradients", "optimizer_state"):
            assert x[term]["plan"] == x[term]["measured"] > 0, (x["rank"], term, x[term])
