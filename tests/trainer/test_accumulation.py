"""Gradient accumulation holds only gradient shards: each micro-batch's gradients are reduce-scattered
as its backward ends (trainer/engine.py train_step). Skipping the reduce-scatter until the last
micro-batch kept every parameter's unsharded fp32 gradient across the accumulation, ~40 GiB per rank
more than the plan's memory at prod (10.8 B unsharded parameters x 4 B)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranks import spawn

import supernode.trainer.engine as engine
from supernode.core.config import load_stack
from supernode.core.plan import Plan, build_local_plan
from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare

ROOT = Path(__file__).resolve().parents[2]


def _unsharded_grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of unsharded gradients FSDP2 holds (the accumulated ones, or a parameter's own)."""
    held = 0
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        for fp in group.fsdp_params if group else ():
            unsharded = getattr(fp, "_unsharded_param", None)  # absent until its first all-gather
            for grad in (fp.unsharded_accumulated_grad, unsharded.grad if unsharded is not None else None):
                held += grad.numel() * grad.element_size() if grad is not None else 0
    return held


def held_between_micro_batches(rank: int, world: int, plan_json: str, data: str, out: str) -> list[int]:
    plan = Plan.from_json(plan_json)
    trainer = engine.Trainer(plan, torch.device("cpu"), Path(data), Path(out), False)
    seen: list[int] = []
    real = engine.inputs_and_targets

    def recording(batch, eos):  # called once per micro-batch, before its forward
        seen.append(_unsharded_grad_bytes(trainer.model))
        return real(batch, eos)

    engine.inputs_and_targets = recording
    trainer.train_step(trainer.loader.next_step(), stop_term=False, stop_interrupt=False)
    return seen


@pytest.mark.slow
def test_no_rank_holds_unsharded_gradients_between_micro_batches(tmp_path):
    cfg = load_stack("dev", ROOT)
    plan = build_local_plan("dev", cfg, 2)
    assert plan.micro_batches_per_step > 1 and plan.parallel.dp_shard == 2  # accumulation over a sharded model
    data = tmp_path / "data"
    prepare(DEFAULT_CORPUS, data, shard_tokens=1 << 16)
    seen = spawn(held_between_micro_batches, 2, tmp_path / "run", plan.to_json(), str(data), str(tmp_path / "out"))
    for per_micro_batch in seen:
        assert len(per_micro_batch) == plan.micro_batches_per_step
        assert per_micro_batch == [0] * len(per_micro_batch)
