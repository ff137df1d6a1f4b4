"""Pipeline parallel gives the loss, gradients and update of one process on the same global batch,
and a pipelined run trains, checkpoints and resumes under `supernode train --local`, also at pp 1.

As in test_parallel.py: each rank builds only its stages (meta device, parallelise, to_empty, init
in place) and reads its data-parallel slice, split by the schedule into micro-batches; the
reference in this process sees the whole batch. The load-balance loss is measured per routing
group (the tokens of one micro-batch on one rank), so the reference splits its rows into
dp x micro-batches groups. The aux-loss coefficients are large here so that a stage that dropped
its aux loss from backward would fail the gradient comparison.

With document masking (an EOS id given) the windows hold documents of varied lengths, so the
micro-batches and data-parallel ranks count different numbers of targets: the pipeline's loss
and gradients equal the reference's only if the document indices reach every stage and the loss
is normalised by the step's global count of targets.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from ranks import spawn
from torch.distributed.tensor import DTensor

from supernode.core.config import Model, Parallel, from_mapping, load_stack
from supernode.core.layout import stage_layers
from supernode.core.mesh import Mesh
from supernode.core.runs import checkpoints_of, run_of
from supernode.trainer.engine import counted_per_micro_batch
from supernode.trainer.model import Transformer, inputs_and_targets, loss_fn
from supernode.trainer.moe import ExpertBalancer
from supernode.trainer.parallel import Meshes
from supernode.trainer.pipeline import Stage, StageParts, build_pipeline, rank_stages

ROOT = Path(__file__).resolve().parents[2]
SEED = 7
LR = 0.5
BATCH = 8
MICRO_BATCHES = 4  # per data-parallel rank and step
MODEL = Model(
    layers=4,
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
    seq_len=16,
    load_balance_coef=0.1,
    z_loss_coef=0.01,
)

# name: (world, dp_shard, ep, pp, schedule, virtual stages, activation checkpointing, tp)
LAYOUTS = {
    "pp2": (2, 1, 1, 2, "1f1b", 1, "none", 1),
    "pp2_dp2": (4, 2, 1, 2, "1f1b", 1, "selective", 1),
    "pp2_ep2": (4, 2, 2, 2, "gpipe", 1, "none", 1),
    "pp2_v2_dp2_interleaved": (4, 2, 1, 2, "interleaved1f1b", 2, "full", 1),
    "pp2_tp2": (4, 1, 1, 2, "1f1b", 1, "none", 2),
}


def batch(eos: int | None = None) -> torch.Tensor:
    """Random tokens; with `eos`, tokens other than it and about one in five replaced by it (documents)."""
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, MODEL.vocab, (BATCH, MODEL.seq_len + 1), generator=g)
    if eos is None:
        return tokens
    tokens[tokens == eos] = eos + 1
    return tokens.masked_fill(torch.rand(tokens.shape, generator=g) < 0.2, eos)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference(groups: int, eos: int | None = None) -> dict:
    """One process, the whole batch: CE + aux, its gradients, then an SGD step with the router-bias step."""
    model = Transformer(MODEL)
    model.init_weights(SEED)
    for moe in model.moe_layers():
        moe.balance_groups = groups
    inputs, targets, documents = inputs_and_targets(batch(eos), eos)
    ce = loss_fn(model(inputs, documents), targets)  # the mean over every counted target of the batch
    (ce + model.aux_loss()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    balancer = ExpertBalancer(model.moe_layers(), MODEL.bias_update_rate)
    balancer.attach(opt)
    opt.step()
    return {
        "ce": ce.item(),
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "biases": {i: m.router.bias.clone() for i, m in enumerate(model.moe_layers())},
    }


def run_layouts(rank: int, world_size: int, names: list[str], eos: int | None = None) -> dict:
    results = {}
    for name in names:
        _, dps, ep, pp, schedule, virtual, ac, tp = LAYOUTS[name]
        parallel = Parallel(
            dp_shard=dps,
            tp=tp,
            ep=ep,
            pp=pp,
            pp_schedule=schedule,
            pp_virtual_stages=virtual,
            activation_checkpointing=ac,
        )
        assert parallel.world_size == world_size
        mesh = Meshes.build(parallel, "cpu")
        tokens = batch(eos).chunk(parallel.dp)[parallel.dp_rank(rank)]
        pipe = build_pipeline(
            MODEL,
            parallel,
            torch.device("cpu"),
            SEED,
            tokens.shape[0] // MICRO_BATCHES,
            MICRO_BATCHES,
            loss_fn,
            mesh=mesh,
        )
        counted = counted_per_micro_batch(list(tokens.chunk(MICRO_BATCHES)), eos, torch.device("cpu"))
        parts = pipe.parts
        reductions: list[tuple[int, ...]] = []
        real = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            if not tensor.is_floating_point():
                reductions.append(tuple(tensor.shape))
            return real(tensor, *args, **kwargs)

        dist.all_reduce = counting
        try:
            losses = pipe.step(tokens, eos, counted)
            grads = {n: _full(p.grad) for n, p in parts.named_parameters()}  # collectives of this stage's ranks
            in_backward = list(reductions)
            opt = torch.optim.SGD(parts.parameters(), lr=LR)
            ExpertBalancer(parts.moe_layers(), MODEL.bias_update_rate, group=mesh.stage_group).attach(opt)
            opt.step()
        finally:
            dist.all_reduce = real
        params = {n: _full(p.detach()) for n, p in parts.named_parameters()}
        layers = [int(k) for k in parts.layers]
        moe_ids = [sum(MODEL.is_moe(j) for j in range(i)) for i in layers if MODEL.is_moe(i)]
        results[name] = {
            "ce": [loss.item() for loss in losses],
            "grads": grads,
            "params": params,
            "biases": dict(zip(moe_ids, (m.router.bias.clone() for m in parts.moe_layers()))),
            "count_reductions_in_backward": in_backward,
            "count_reductions": reductions,
            "moe_layers": len(parts.moe_layers()),
            "stage_size": world_size // pp,
        }
    return results


def check_layout(name: str, per_rank: list[dict], eos: int | None = None) -> None:
    world, dps, *_, tp = LAYOUTS[name]
    ref = reference(groups=dps * tp * MICRO_BATCHES, eos=eos)  # each tp rank routes its own 1/tp of the tokens
    got = [r[name] for r in per_rank]
    ces = [ce for g in got for ce in g["ce"]]  # the last stage's ranks (tp ranks alike), each its micro-batches
    assert len(ces) == dps * tp * MICRO_BATCHES, "the loss lives on the last stage only"
    assert sum(ces) / len(ces) == pytest.approx(ref["ce"], rel=1e-5)
    for g in (
        got
    ):  # expert counts: none in forward/backward, one reduction at the step (if the stage has ranks to reduce over)
        assert g["count_reductions_in_backward"] == []
        expected = [(g["moe_layers"], MODEL.experts)] if g["moe_layers"] and g["stage_size"] > 1 else []
        assert g["count_reductions"] == expected
    grads = {k: v for g in got for k, v in g["grads"].items()}
    params = {k: v for g in got for k, v in g["params"].items()}
    biases = {k: v for g in got for k, v in g["biases"].items()}
    assert set(grads) == set(ref["grads"]), "the stages together hold every parameter, under the model's names"
    for n, g in ref["grads"].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    for n, w in ref["params"].items():  # the update, from a gradient the schedule scaled by the micro-batches
        torch.testing.assert_close(params[n], w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n} after the step: {m}")
    assert set(biases) == set(ref["biases"])
    for i, b in ref["biases"].items():  # router biases moved by the global token counts
        assert torch.equal(biases[i], b), f"MoE layer {i}: router bias"


@pytest.mark.slow
def test_pipelines_match_single_process(tmp_path) -> None:

    failures = []
    for world in (2, 4):
        names = [n for n, layout in LAYOUTS.items() if layout[0] == world]
        per_rank = spawn(run_layouts, world, tmp_path / f"w{world}", names)
        for name in names:
            try:
                check_layout(name, per_rank)
            except AssertionError as e:
                failures.append(f"{name}: {e}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_pipelines_with_document_masking_match_single_process(tmp_path) -> None:
    """The data-parallel, interleaved (several stages per rank) and tensor-parallel pipelines."""

    eos = 0
    tokens = batch(eos)
    counts = [int((mb[:, :-1] != eos).sum()) for mb in tokens.chunk(2 * MICRO_BATCHES)]
    assert len(set(counts)) > 1, "the micro-batches must count different numbers of targets to test the normaliser"
    names = ["pp2_dp2", "pp2_v2_dp2_interleaved", "pp2_tp2"]
    per_rank = spawn(run_layouts, 4, tmp_path, names, eos)
    failures = []
    for name in names:
        try:
            check_layout(name, per_rank, eos)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n\n".join(failures)


def test_stage_split_and_placement() -> None:
    assert stage_layers(8, 2) == [4, 4]
    assert stage_layers(7, 2) == [4, 3]  # uneven
    assert stage_layers(10, 4) == [2, 3, 3, 2]  # the remainder to the middle stages
    assert stage_layers(8, 4, 1, 1) == [1, 3, 3, 1]  # fewer layers on the first and last
    assert rank_stages(1, 4, 2) == [1, 5]  # loop placement for interleaved 1F1B
    # pp is the outermost mesh dim: a stage is a block of consecutive ranks, read the same data slices.
    layout = Mesh(dp_replicate=1, dp_shard=2, tp=2, ep=2, pp=2)
    assert [layout.coordinate(r, "pp") for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_stages_keep_the_whole_models_names() -> None:
    with torch.device("meta"):
        whole = Transformer(MODEL)
        stages = [
            Stage(whole, range(0, 1), first=True, last=False),
            Stage(whole, range(1, 3), False, False),
            Stage(whole, range(3, 4), False, True),
        ]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())
    parts = StageParts(stages[1:])
    assert [n for n, _ in parts.named_parameters()][0].startswith("layers.1.")
    assert parts.moe_layer_ids() == [0, 1, 2]  # layers 1-3 are the model's MoE layers 0-2


# -- end to end: `supernode train --local` at pp 2, resumed at pp 2 and at pp 1 ---------------------


def pp_stack(path: Path, **local_parallel) -> Path:
    """The dev stack with its local layout pipelined (the dev stack's own local layout unchanged)."""
    data = load_stack("dev", ROOT).to_mapping()
    local = data["local"]
    local["nproc"] = 2
    local["parallel"].update({"dpShard": 1, "ep": 1, "pp": 2, **local_parallel})
    local["training"].update({"steps": 6, "checkpointInterval": 4, "microBatch": 4, "warmupSteps": 2})
    from_mapping(data)  # valid as written
    path.write_text(yaml.safe_dump({"config": {f"supernode:{k}": v for k, v in data.items()}}))
    return path


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_of(out) / "metrics.jsonl").read_text().splitlines())}


def cli_train(stack: Path, out: Path, data: Path, steps: int) -> str:
    proc = subprocess.run(
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
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_pp2_trains_checkpoints_and_resumes_also_at_pp1(tmp_path) -> None:
    from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

    data = tmp_path / "tokens"
    prepare(DEFAULT_CORPUS, data, shard_tokens=1 << 16)
    stack = pp_stack(tmp_path / "pp2.yaml")
    out = tmp_path / "pp2"
    cli_train(stack, out, data, 4)  # steps 1-4, checkpoint at 4
    log = cli_train(stack, out, data, 6)  # resumed
    assert "resumed from checkpoint at step 4" in log and "'pp': 2" in log
    pp2 = losses(out)
    assert pp2[6] < pp2[1] - 0.5  # it learned

    # The step-4 checkpoint of the pipelined run, resumed by the dev stack's pp 1 local layout
    # (dpShard 2, ep 2): other keys per rank, the same model, optimizer and data position.
    flat = tmp_path / "pp1"
    (flat / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoints_of(out) / "step_00000004", flat / "checkpoints" / "step_00000004")
    log = cli_train(pp_stack(tmp_path / "pp1.yaml", pp=1, dpShard=2, ep=2), flat, data, 6)
    assert "resumed from checkpoint at step 4" in log and "'pp': 1" in log
    pp1 = losses(flat)
    assert pp1[5] == pytest.approx(pp2[5], rel=1e-4)
    assert pp1[6] == pytest.approx(pp2[6], rel=1e-4)  # Adam moments, schedule and router biases carried over
