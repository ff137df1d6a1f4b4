"""Elastic layouts in the trainer (issue 26 item 2): a world whose dp does not divide the global
batch runs zero-weight padded micro-batches (`Plan.padded_micro_batches`) and still learns from
exactly the global batch: the same samples, the same loss, the same gradient as the planned world.
The two-agent kill/grow run is tests/trainer/test_elastic_agents.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ranks import spawn
from torch.distributed.tensor import DTensor

from supernode.core.config import from_mapping, load_stack
from supernode.core.errors import BadInput
from supernode.core.plan import Plan, build_local_plan
from supernode.trainer.data.loader import TokenLoader
from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare
from supernode.trainer.engine import Trainer, counted_per_micro_batch

ROOT = Path(__file__).resolve().parents[2]
SEQ = 16


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens")
    prepare(DEFAULT_CORPUS, out, shard_tokens=1 << 16)
    return out


def elastic_plan(nproc: int = 4, **training) -> Plan:
    """The dev stack's local plan at `nproc` ranks: its elastic layouts cover worlds 1..nproc."""
    data = load_stack("dev", ROOT).to_mapping()
    data["local"]["training"].update({"warmupSteps": 2, **training})
    return build_local_plan("dev", from_mapping(data), nproc)


def loaders(data: Path, dp: int, padded: int, global_batch: int = 12, micro_batch: int = 2) -> list[TokenLoader]:
    return [
        TokenLoader(data, SEQ, global_batch, micro_batch, rank, dp, 7, padded_micro_batches=padded)
        for rank in range(dp)
    ]


def real_rows(ranks: list[TokenLoader]) -> torch.Tensor:
    """One step of every rank, its real micro-batches only, in rank order."""
    return torch.cat([torch.cat(r.next_step()[: r.real_micro_batches]) for r in ranks])


def test_padding_keeps_the_global_batch_and_pads_the_last_round_of_the_highest_ranks(data_dir):
    # 6 micro-batches over dp 4: 2 rounds, 8 slots, the last round's 2 on ranks 2 and 3 are padding
    whole = real_rows(loaders(data_dir, 1, 0))
    ranks = loaders(data_dir, 4, 2)
    steps = [r.next_step() for r in ranks]
    assert [len(s) for s in steps] == [2, 2, 2, 2]  # every rank runs the same forwards: FSDP stays matched
    assert [r.real_micro_batches for r in ranks] == [2, 2, 1, 1]
    real = torch.cat([torch.cat(s[: r.real_micro_batches]) for s, r in zip(steps, ranks)])
    assert torch.equal(real, whole)  # exactly the global batch, each sample once, in order
    # the padding repeats real windows (a forward that costs and routes like any other)
    assert torch.equal(steps[2][1], whole[0:2]) and torch.equal(steps[3][1], whole[2:4])


def test_loader_state_is_global_a_resume_at_another_dp_reads_the_same_samples(data_dir):
    at4 = loaders(data_dir, 4, 2)
    for _ in range(3):
        real_rows(at4)
    state = json.loads(json.dumps(at4[0].state_dict()))
    assert all(r.state_dict() == state for r in at4)  # the same on every rank
    expected = real_rows(at4)
    for dp, padded in ((1, 0), (2, 0), (3, 0), (5, 4)):
        resumed = loaders(data_dir, dp, padded)
        for r in resumed:
            r.load_state_dict(state)
        assert torch.equal(real_rows(resumed), expected), f"dp {dp}"


def test_a_rank_past_the_global_batch_runs_only_padding(data_dir):
    whole = real_rows(loaders(data_dir, 1, 0, global_batch=4))  # 2 micro-batches over dp 3: 1 round
    ranks = loaders(data_dir, 3, 1, global_batch=4)
    assert [r.real_micro_batches for r in ranks] == [1, 1, 0]
    steps = [r.next_step() for r in ranks]
    assert [len(s) for s in steps] == [1, 1, 1]
    assert torch.equal(torch.cat([steps[0][0], steps[1][0]]), whole) and torch.equal(steps[2][0], whole[:2])


def test_padding_that_does_not_split_over_the_ranks_is_refused(data_dir):
    with pytest.raises(ValueError, match="does not split evenly over 4 data-parallel ranks"):
        TokenLoader(data_dir, SEQ, 12, 2, 0, 4, 7, padded_micro_batches=1)


def test_counted_without_document_ends_spreads_the_real_tokens_over_every_slot(group):
    micro = [torch.zeros(2, SEQ + 1, dtype=torch.long)] * 2
    assert counted_per_micro_batch(micro, None, torch.device("cpu")) == 2 * SEQ
    # 6 real of 8 slots: each slot's divisor is three quarters of a micro-batch's tokens
    assert counted_per_micro_batch(micro, None, torch.device("cpu"), 1, 6 / 8) == 2 * SEQ * 6 / 8


def test_counted_with_document_ends_counts_only_the_real_micro_batches(group):
    eos = 1
    real, padding = torch.zeros(2, SEQ + 1, dtype=torch.long), torch.ones(2, SEQ + 1, dtype=torch.long)
    cpu = torch.device("cpu")
    # one rank: the real micro-batch's 2 x SEQ targets, spread over both slots; the padding's (all EOS) ignored
    assert counted_per_micro_batch([real, padding], eos, cpu, 1).item() == 2 * SEQ / 2
    assert counted_per_micro_batch([real, real], eos, cpu, 1).item() == 2 * SEQ / 2
    assert counted_per_micro_batch([padding], eos, cpu, 0).item() == 1  # no real one: never a division by 0


def first_step(rank: int, world: int, plan_json: str, data: str, out: str) -> dict:
    """Step 1 at `world`: the loss, the gradient norm, every full gradient (before the update) and
    the global routed-token counts the router biases move by."""
    plan = Plan.from_json(plan_json).for_world(world)
    trainer = Trainer(plan, torch.device("cpu"), Path(data), Path(out), False)
    grads: dict[str, torch.Tensor] = {}

    def capture(optimizer, args, kwargs) -> None:  # before the update: the clipped gradients
        for name, p in trainer.model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.detach().clone()

    trainer.optimizer.register_step_pre_hook(capture)
    r = trainer.train_step(trainer.loader.next_step(), stop_term=False, stop_interrupt=False)
    trainer.checkpointer.close()
    return {
        "loss": r.loss,
        "grad_norm": r.grad_norm,
        "grads": grads,
        "load": trainer.balancer.last_load.clone(),
        "padded": plan.padded_micro_batches,
        "rounds": plan.micro_batches_per_step,
    }


# Document masking in the fast run: its count of targets is the collective path; plain is the formula.
@pytest.mark.parametrize(
    "masking", [pytest.param(False, marks=pytest.mark.slow), True], ids=["plain", "document-masking"]
)
def test_a_padded_world_takes_the_planned_worlds_first_step(tmp_path, data_dir, masking):
    # grad clipping off: a wrong normalisation must change the gradient, not be clipped away
    plan = elastic_plan(4, gradClip=1e9, documentMasking=masking)
    planned = spawn(first_step, 4, tmp_path / "w4", plan.to_json(), str(data_dir), str(tmp_path / "o4"))[0]
    padded = spawn(first_step, 3, tmp_path / "w3", plan.to_json(), str(data_dir), str(tmp_path / "o3"))[0]
    assert (planned["rounds"], planned["padded"]) == (1, 0)
    assert (padded["rounds"], padded["padded"]) == (2, 2)  # 4 micro-batches over dp 3: 6 slots
    # fp32 on CPU, the same samples: only the order of the reductions differs (~1e-7 relative)
    assert padded["loss"] == pytest.approx(planned["loss"], rel=1e-5)
    assert padded["grad_norm"] == pytest.approx(planned["grad_norm"], rel=1e-4)
    assert planned["grads"].keys() == padded["grads"].keys()
    for name, g in planned["grads"].items():
        torch.testing.assert_close(padded["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert torch.equal(padded["load"], planned["load"])  # the padding routed no counted token


def test_pipeline_parallel_has_no_layout_for_a_world_that_needs_padding():
    data = load_stack("dev", ROOT).to_mapping()
    data["local"].update(nproc=8)
    data["local"]["parallel"].update({"pp": 2, "dpShard": 4})
    data["local"]["training"].update({"globalBatch": 32, "warmupSteps": 2})
    plan = build_local_plan("dev", from_mapping(data))
    assert plan.for_world(4).padded_micro_batches == 0  # dp 2 divides the 8 micro-batches: pp runs there
    # dp 3 would need 1 padded slot, which the pipeline schedule cannot weigh zero: the plan refuses it,
    # so the trainer never builds it (train.py reads the layout through for_world)
    with pytest.raises(BadInput) as refused:
        plan.for_world(6)
    assert "pipeline parallel (pp 2) runs no zero-weight micro-batches: dp 3 does not divide the global batch's 8" in (
        str(refused.value)
    )


@pytest.mark.slow
def test_pipeline_parallel_runs_an_elastic_world_without_padding(tmp_path, data_dir):
    data = load_stack("dev", ROOT).to_mapping()
    data["local"].update(nproc=4)
    data["local"]["parallel"].update({"pp": 2, "dpShard": 2})
    data["local"]["training"].update({"warmupSteps": 2, "gradClip": 1e9})
    plan = build_local_plan("dev", from_mapping(data))
    planned = spawn(first_step, 4, tmp_path / "w4", plan.to_json(), str(data_dir), str(tmp_path / "o4"))[0]
    shrunk = spawn(first_step, 2, tmp_path / "w2", plan.to_json(), str(data_dir), str(tmp_path / "o2"))[0]
    assert (planned["rounds"], shrunk["rounds"], shrunk["padded"]) == (2, 4, 0)  # dp 2 -> 1: twice the rounds
    assert shrunk["loss"] == pytest.approx(planned["loss"], rel=1e-5)
    assert shrunk["grad_norm"] == pytest.approx(planned["grad_norm"], rel=1e-4)  # summed over both stages
