"""Every parallel layout gives the weights, loss and gradients of one process on the same global batch.

One spawn of 4 gloo ranks runs all layouts in turn (process start-up dominates the cost); each
rank builds its shards only (meta device, parallelize, to_empty, init in place) and reads its
data-parallel slice; the reference in this process builds the whole model and sees the whole
batch. Weights after init and gradients are compared as full tensors (DTensor.full_tensor), which
also catches FSDP summing instead of averaging over data-parallel ranks (a past gloo bug). The
load-balance loss is measured per routing group (the tokens one rank routes), so the reference
splits its rows into dp*tp groups. Expert counts cross ranks once per step: every all-reduce of
integer counts is recorded, and there must be exactly one, at the optimizer step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from supernode.core.config import Model, Parallel
from trainer.model import Transformer, loss_fn
from trainer.moe import ExpertBalancer
from trainer.parallel import ParallelDims, build_model, parallelize

SEED = 7
LR = 0.5
BATCH = 8
MODEL = Model(layers=3, dim=32, heads=4, kv_heads=2, experts=4, top_k=2, shared_experts=1, expert_hidden=16,
              dense_hidden=48, first_dense_layers=1, vocab=64, seq_len=16, load_balance_coef=0.01,
              z_loss_coef=0.001)
SIGMOID = MODEL.model_copy(update={"router": "sigmoid", "shared_experts": 0, "tie_embeddings": True})

# name: (dp_replicate, dp_shard, tp, ep, activation checkpointing, overlap, model)
LAYOUTS = {
    "fsdp": (1, 4, 1, 1, "none", True, MODEL),
    "hsdp": (2, 2, 1, 1, "selective", True, MODEL),
    "ep": (1, 4, 1, 4, "none", False, MODEL),
    "tp": (1, 2, 2, 1, "full", True, MODEL),
    "ep_fsdp_tp": (1, 2, 2, 2, "selective", True, MODEL),
    "hsdp_ep_tp_sigmoid": (2, 1, 2, 2, "none", True, SIGMOID),
}
# bf16 mixed precision is the GPU path; on CPU it is checked against the fp32 reference loosely.
# With ep = dp_shard the experts are outside FSDP and must still compute in bf16.
BF16_LAYOUT = "ep_fsdp_bf16"
LAYOUTS[BF16_LAYOUT] = (1, 4, 1, 4, "none", True, MODEL)


def batch() -> torch.Tensor:
    return torch.randint(0, MODEL.vocab, (BATCH, MODEL.seq_len + 1), generator=torch.Generator().manual_seed(SEED))


def second_step(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An SGD step with the router-bias step as its pre-hook (the step's counts reduced once),
    then the next forward's CE. -> (CE, the step's global expert load)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    balancer = ExpertBalancer(model.moe_layers(), model.cfg.bias_update_rate)
    balancer.attach(opt)
    opt.step()
    with torch.no_grad():
        return loss_fn(model(tokens[:, :-1]), tokens[:, 1:]), balancer.last_load


def reference(model_cfg: Model, groups: int) -> dict:
    model = Transformer(model_cfg)
    model.init_weights(SEED)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    for moe in model.moe_layers():
        moe.balance_groups = groups
    tokens = batch()
    ce = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    aux = model.aux_loss()
    (ce + aux).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ce_after, load = second_step(model, tokens)
    return {"ce": ce.item(), "aux": aux.item(), "load": load, "grads": grads, "params": params,
            "ce_after_step": ce_after.item()}


class CountReductions:
    """Records the all-reduces of integer tensors (expert counts) while active."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.phase = "forward/backward"

    def __enter__(self) -> "CountReductions":
        real = self.real = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            if not tensor.is_floating_point():
                self.calls.append((self.phase, tuple(tensor.shape)))
            return real(tensor, *args, **kwargs)
        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self.real


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_layouts(rank: int, world_size: int) -> dict:
    results = {}
    for name, (dpr, dps, tp, ep, ac, overlap, model_cfg) in LAYOUTS.items():
        dims = ParallelDims(dp_replicate=dpr, dp_shard=dps, tp=tp, ep=ep, pp=1, world_size=world_size)
        parallel = Parallel(dp_replicate=dpr, dp_shard=dps, tp=tp, ep=ep, activation_checkpointing=ac,
                            overlap=overlap, mixed_precision="bf16")  # bf16 must be ignored on CPU
        if name == BF16_LAYOUT:  # parallelize's device type decides mixed precision: "cuda" is the GPU (bf16) path
            model = Transformer(model_cfg)
            model.init_weights(SEED)
            parallelize(model, dims, dims.build_mesh("cpu"), parallel, "cuda")
        else:
            model = build_model(model_cfg, dims, parallel, torch.device("cpu"), SEED)
        params = {n: _full(p.detach()) for n, p in model.named_parameters()}  # collective: every rank
        tokens = batch().chunk(dims.dp_size)[dims.dp_rank(rank)]
        compute_dtypes: set[str] = set()
        for moe in model.moe_layers():
            moe.experts.register_forward_hook(lambda mod, args, out: compute_dtypes.add(str(out.dtype)))
        counted = CountReductions().__enter__()
        ce = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        aux = model.aux_loss()
        (ce + aux).backward()
        # Data-parallel mean of the CE; aux terms are split over tp slices, so sum them then average.
        stats = torch.stack([ce.detach() / dims.dp_size * (1 / tp), aux.detach() / dims.dp_size])
        dist.all_reduce(stats)
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}  # collective: every rank
        dtypes = {str(p.dtype) for p in model.parameters()}
        counted.phase = "step"
        ce_after, load = second_step(model, tokens)
        counted.__exit__()
        ce_after = ce_after / (dims.dp_size * tp)
        dist.all_reduce(ce_after)
        results[name] = {"ce": stats[0].item(), "aux": stats[1].item(), "load": load, "params": params,
                         "grads": grads, "dtypes": dtypes, "compute_dtypes": compute_dtypes,
                         "ce_after_step": ce_after.item(), "count_reductions": counted.calls}
    return results if rank == 0 else {}


def check_layout(layout: str, got: dict) -> None:
    dpr, dps, tp, *_, model_cfg = LAYOUTS[layout]
    ref = reference(model_cfg, groups=dpr * dps * tp)
    # One reduction of every MoE layer's counts per step, none in forward or backward.
    assert got["count_reductions"] == [("step", (model_cfg.moe_layers, model_cfg.experts))]
    if layout == BF16_LAYOUT:
        assert got["ce"] == pytest.approx(ref["ce"], rel=2e-2)
        assert got["compute_dtypes"] == {"torch.bfloat16"}
        # bf16 keeps ~3 significant digits and flips some near-tied routing choices (~1% error,
        # up to ~7% on experts); a wrong scale (sum vs mean over 4 ranks) would be >= 75%.
        for name, g in ref["grads"].items():
            error = (got["grads"][name] - g).norm() / g.norm()
            assert error < 0.1, f"{name}: relative error {error:.3f}"
        return
    assert got["compute_dtypes"] == {"torch.float32"}
    assert got["ce"] == pytest.approx(ref["ce"], rel=1e-5)
    assert got["aux"] == pytest.approx(ref["aux"], rel=1e-4)
    assert torch.equal(got["load"], ref["load"]), "expert load must be the global token counts"
    assert set(got["params"]) == set(ref["params"])
    for name, w in ref["params"].items():  # sharded init = the single-process init, bit for bit
        assert torch.equal(got["params"][name], w), f"{name}: initialised differently from the reference"
    assert got["dtypes"] == {"torch.float32"}
    assert got["ce_after_step"] == pytest.approx(ref["ce_after_step"], rel=1e-5)
    assert got["ce_after_step"] < got["ce"] - 0.01, "the step must have changed the model"
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_every_layout_matches_single_process(tmp_path) -> None:
    # One test, not one per layout: under pytest-xdist a shared fixture would spawn once per worker.
    from conftest import spawn

    results = spawn(run_layouts, 4, tmp_path)[0]
    failures = []
    for layout, got in results.items():
        try:
            check_layout(layout, got)
        except AssertionError as e:
            failures.append(f"{layout}: {e}")
    assert not failures, "\n\n".join(failures)


def _dev_local_plan():
    from pathlib import Path

    from supernode.core.config import load_stack
    from supernode.core.plan import build_local_plan

    return build_local_plan("dev", load_stack("dev", Path(__file__).resolve().parents[2]))


def _with_degrees(plan, **degrees):
    return plan.model_copy(update={"parallel": plan.parallel.model_copy(update=degrees),
                                   "degrees": plan.degrees.model_copy(update=degrees)})


def test_dims_from_degrees_and_errors() -> None:
    from pydantic import ValidationError

    from supernode.core.config import Parallel
    from supernode.core.errors import ConfigError

    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, ep=4, pp=1, world_size=8)
    assert (dims.dp_size, dims.edp) == (4, 1)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # Layout errors come from the core's one validator, named by the plan's field.
    plan = _dev_local_plan()
    with pytest.raises(ConfigError, match=r"world size is 6"):
        ParallelDims.from_plan(_with_degrees(plan, dp_replicate=1, dp_shard=4, tp=1, ep=1, pp=1), 6)
    with pytest.raises(ConfigError, match=r"plan:parallel.ep: ep must divide dpShard\*tp"):
        ParallelDims.from_plan(_with_degrees(plan, dp_replicate=1, dp_shard=4, tp=1, ep=3, pp=1), 4)
    # pp > 1 is accepted (trainer.pipeline); its rules are the core's too, e.g. a stage per layer at least.
    with pytest.raises(ConfigError, match=r"plan:parallel.pp: every pipeline stage needs a layer"):
        ParallelDims.from_plan(_with_degrees(plan, dp_replicate=1, dp_shard=1, tp=1, ep=1, pp=4), 4)
    dims = ParallelDims.from_plan(_with_degrees(plan, dp_replicate=1, dp_shard=1, tp=1, ep=1, pp=2), 2)
    assert (dims.pp, dims.dp_size) == (2, 1)
    assert [dims.pp_rank(r) for r in range(2)] == [0, 1] and [dims.dp_rank(r) for r in range(2)] == [0, 0]
    with pytest.raises(ValidationError, match=r"tp\n.*greater than or equal to 1"):
        Parallel(dp_replicate=1, dp_shard=2, tp=0, ep=1, pp=1)


def test_dims_from_the_dev_stack_plan() -> None:
    from pathlib import Path

    from supernode.core.config import load_stack
    from supernode.core.errors import ConfigError
    from supernode.core.plan import build_local_plan, build_plan

    root = Path(__file__).resolve().parents[2]
    cfg = load_stack("dev", root)
    local = build_local_plan("dev", cfg)
    dims = ParallelDims.from_plan(local, local.world_size)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.ep, dims.pp) == (1, 2, 1, 2, 1)
    assert dims.dp_size == 2 and dims.edp == 1
    full = build_plan("dev", cfg)
    assert ParallelDims.from_plan(full, full.world_size).dp_size == full.parallel.dp
    with pytest.raises(ConfigError, match=f"the world size is {local.world_size + 1}"):
        ParallelDims.from_plan(local, local.world_size + 1)
