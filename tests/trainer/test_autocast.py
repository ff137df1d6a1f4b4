"""bf16 where FSDP's mixed precision does not apply (issue 39 item 4): a layout of several ranks with
dp 1 (tp alone here) has no FSDP mesh, so it trained fp32 on an accelerator; now its forward runs
under torch.autocast, and the matmuls are bf16. On CPU the plan's bf16 is never applied
(`bf16_compute`), so the spawned ranks take the accelerator's rule on gloo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranks import spawn
from torch.utils._python_dispatch import TorchDispatchMode

from supernode.core.config import Parallel, from_mapping, load_stack
from supernode.core.plan import Plan, build_local_plan
from supernode.trainer.data.prepare import DEFAULT_CORPUS, prepare
from supernode.trainer.parallel import Meshes, autocast_dtype

ROOT = Path(__file__).resolve().parents[2]
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"}


class MatmulDtypes(TorchDispatchMode):
    """The dtype of every matmul the code under it runs (the first operand's)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMULS:
            first = args[0] if name in ("mm", "bmm", "_grouped_mm") else args[1]
            self.seen.append((name, getattr(first, "dtype", None)))
        return func(*args, **(kwargs or {}))


def test_autocast_only_where_fsdp_mixed_precision_has_no_mesh():
    no_dp = Meshes(dense=None, experts=None, moe=None)  # what Meshes.build gives a layout without dp dims
    tp_only = Parallel(tp=8, mixed_precision="bf16")
    assert autocast_dtype(tp_only, no_dp, "cuda") is torch.bfloat16
    assert autocast_dtype(tp_only, no_dp, "neuron") is torch.bfloat16
    assert autocast_dtype(tp_only, no_dp, "cpu") is None  # bf16 never applies on CPU
    assert autocast_dtype(tp_only.model_copy(update={"mixed_precision": "fp32"}), no_dp, "cuda") is None


def forward_matmul_dtypes(rank: int, world: int, plan_json: str, data: str, out: str, as_accelerator: bool):
    import supernode.trainer.engine as engine
    import supernode.trainer.parallel as parallel

    if as_accelerator:  # the accelerator's rule on these CPU ranks: bf16 wherever the plan says so
        parallel.bf16_compute = lambda p, device_type: p.mixed_precision == "bf16"
    plan = Plan.from_json(plan_json)
    trainer = engine.Trainer(plan, torch.device("cpu"), Path(data), Path(out), False)
    real_loss = engine.loss_fn
    modes: list[MatmulDtypes] = []

    def model_forward(module, args, kwargs):  # record the forward's matmuls, not the backward's
        modes.append(MatmulDtypes())
        modes[-1].__enter__()

    def forward_done(module, args, kwargs, output):
        modes[-1].__exit__(None, None, None)

    trainer.model.register_forward_pre_hook(model_forward, with_kwargs=True)
    trainer.model.register_forward_hook(forward_done, with_kwargs=True)
    result = trainer.train_step(trainer.loader.next_step(), stop_term=False, stop_interrupt=False)
    engine.loss_fn = real_loss
    return {
        "autocast": str(trainer.autocast),
        "dtypes": sorted({str(d) for m in modes for _, d in m.seen}),
        "fp32": sorted({n for m in modes for n, d in m.seen if d == torch.float32}),
        "matmuls": sum(len(m.seen) for m in modes),
        "loss": result.loss,
    }


@pytest.mark.slow
def test_a_tp_only_layout_computes_its_matmuls_in_bf16(tmp_path):
    data = load_stack("dev", ROOT).to_mapping()
    data["local"]["model"].update({"heads": 2, "kvHeads": 2})
    data["local"]["parallel"].update({"tp": 2, "dpShard": 1, "ep": 1, "mixedPrecision": "bf16"})
    data["local"]["nproc"] = 2
    # The plan for an accelerator keeps mixedPrecision bf16 (a CPU plan says fp32: Parallel.computed_on);
    # run on CPU here, the trainer computes it by the same rule.
    plan = build_local_plan("dev", from_mapping(data), 2, device="cuda")
    assert plan.parallel.dp == 1 and plan.parallel.tp == 2 and plan.parallel.mixed_precision == "bf16"
    tokens = tmp_path / "data"
    prepare(DEFAULT_CORPUS, tokens, shard_tokens=1 << 16)
    got = {}
    for accelerator in (False, True):
        got[accelerator] = spawn(
            forward_matmul_dtypes,
            2,
            tmp_path / f"run{accelerator}",
            plan.to_json(),
            str(tokens),
            str(tmp_path / f"out{accelerator}"),
            accelerator,
        )[0]
    assert got[False]["autocast"] == "None" and got[False]["dtypes"] == ["torch.float32"]  # CPU: fp32, no autocast
    # every matmul, the experts' own (which autocast does not reach: GroupedExperts casts) included
    assert got[True]["autocast"] == "torch.bfloat16" and got[True]["dtypes"] == ["torch.bfloat16"], got[True]["fp32"]
    assert got[True]["matmuls"] == got[False]["matmuls"] > 0  # the same forward, every matmul in bf16
    assert abs(got[True]["loss"] - got[False]["loss"]) < 0.05 * got[False]["loss"]  # bf16 rounding, not another model
