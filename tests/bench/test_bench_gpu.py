"""supernode/bench/gpu.py: fails fast without a GPU; its layout for the GPUs at hand; its ranks' code on CPU (gloo)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest
import torch

from supernode.bench import gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_a_gpu_it_stops_at_once_with_exit_2(capsys) -> None:
    start = time.monotonic()
    assert gpu.main(["--stack", "dev", "--root", str(ROOT)]) == 2
    assert time.monotonic() - start < 5  # before loading a stack or building anything
    out, err = capsys.readouterr()
    assert out == ""  # no JSON line pretends to be a measurement
    assert "needs a CUDA GPU and this machine has none" in err and "python -m supernode.bench.gpu" in err


def test_the_cli_runs_it_as_bench_gpu() -> None:
    from supernode.cli.commands.bench import BENCHES

    assert BENCHES["gpu"] == "supernode.bench.gpu"


@pytest.mark.parametrize(
    "gpus, layout, degrees",
    [
        (1, "on 1 GPU(s)", {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "ep": 1, "pp": 1}),
        (4, "on 4 GPU(s)", {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "ep": 4, "pp": 1}),
        (16, "full plan", None),
    ],
)
def test_layout_is_the_full_plan_or_the_stacks_model_on_the_gpus_here(gpus, layout, degrees) -> None:
    from supernode.core.config import load_stack
    from supernode.core.plan import build_plan

    full = build_plan("dev", load_stack("dev", ROOT))
    plan, said = gpu.gpu_plan("dev", ROOT, gpus)
    assert layout in said
    assert plan.world_size == (full.world_size if degrees is None else gpus)
    assert plan.model == full.model and plan.training == full.training  # the real model, not the CPU demo's
    assert plan.parallel.mixed_precision == full.parallel.mixed_precision
    assert plan.degrees.model_dump() == (degrees or full.degrees.model_dump())


def _tiny_plan_json() -> str:
    from supernode.core.config import load_stack
    from supernode.core.plan import build_local_plan

    return build_local_plan("dev", load_stack("dev", ROOT), 2).model_dump_json()


@pytest.mark.slow
def test_rank_workers_measure_on_cpu_gloo() -> None:
    """The code the GPU ranks run (expert-parallel layer, memory per rank, model MFU), on 2 CPU ranks."""
    args = argparse.Namespace(tokens=64, dim=32, hidden=64, experts=4, topk=2, repeat=1)
    ep = gpu._spawn(gpu._ep_worker, 2, "cpu", args, 1e12)
    assert [line["rank"] for line in ep] == [0, 1]
    assert all(line["backend"] == "gloo" and line["ep"] == 2 and line["tokens_per_s"] > 0 for line in ep)
    lines = gpu._spawn(gpu._model_worker, 2, "cpu", _tiny_plan_json(), "test layout", 1, 1e12)
    memory = [line for line in lines if line["measurement"] == "memory_per_rank"]
    mfu = [line for line in lines if line["measurement"] == "model_mfu"]
    assert len(memory) == len(mfu) == 2
    for line in memory:  # bench memory's exact terms still hold when run from here
        for term in ("parameters", "gradients", "optimizer_state"):
            assert line[term]["plan"] == line[term]["measured"], (term, json.dumps(line))
        assert line["layout"] == "test layout"
    for line in mfu:
        assert line["tokens_per_s_per_gpu"] > 0 and 0 < line["mfu"] < 1 and line["flops_per_token"] > 0


# -- the calibration it writes (no GPU needed: the writer is fed lines) -------------------------------
LAYER = {"measurement": "moe_layer_mfu", "device": "NVIDIA H100 80GB HBM3", "step_s": 0.010, "mfu": 0.42}


def _ep_line(rank: int, step_s: float) -> dict:
    return {
        "measurement": "moe_layer_expert_parallel",
        "rank": rank,
        "ep": 8,
        "tokens_per_rank": 16384,
        "dim": 2048,
        "topk": 6,
        "step_s": step_s,
    }


def test_calibration_from_the_lines_by_hand() -> None:
    lines = [LAYER, _ep_line(0, 0.012), _ep_line(1, 0.014), {"measurement": "model_mfu", "mfu": 0.3}]
    cal = gpu.calibration_from(lines, "H100", LAYER["device"], "2026-01-01T00:00:00+00:00")
    assert cal.accelerator == "H100" and cal.matmul_efficiency == 0.42  # the one-GPU layer's MFU
    # the slowest EP rank's step less the one-GPU step, 0.014 - 0.010 = 4 ms, moves
    # 4 x 16384 tokens x top-6 x 2048 x 2 B x 7/8 = 1,409,286,144 B per rank: 352 GB/s of NVLink's 450 one way
    assert cal.nvlink_efficiency == round(1409286144 / 0.004 / 450e9, 4) == 0.7829
    assert cal.efa_efficiency is None  # one machine: EFA not measured
    assert cal.measurements == lines[:3]  # the lines the figures come from


@pytest.mark.parametrize(
    "ep_lines",
    [
        [],  # one GPU
        [{"measurement": "moe_layer_expert_parallel", "skipped": True, "reason": "..."}],
        [_ep_line(0, 0.009)],  # no slower than one GPU: nothing to derive
        [_ep_line(0, 0.0105)],  # faster than NVLink's catalog bandwidth: not a figure to trust
    ],
)
def test_calibration_without_a_usable_expert_parallel_line_keeps_nvlink_unmeasured(ep_lines) -> None:
    cal = gpu.calibration_from([LAYER, *ep_lines], "H100", LAYER["device"])
    assert cal.nvlink_efficiency is None and cal.matmul_efficiency == 0.42


def test_the_written_calibration_is_what_the_plan_reads(tmp_path) -> None:
    from supernode.core.capacity import Calibration
    from supernode.core.config import load_stack
    from supernode.core.plan import build_plan

    cal = gpu.calibration_from([LAYER, _ep_line(0, 0.014)], "H100", LAYER["device"], "2026-01-01T00:00:00+00:00")
    gpu.write_calibration(tmp_path / "h100.json", cal)
    read = Calibration.read(tmp_path / "h100.json")
    assert read == cal.model_copy(update={"path": str(tmp_path / "h100.json")})
    plan = build_plan("prod", load_stack("prod", ROOT), read)
    assert (
        plan.calibration == read and plan.step.compute_s > build_plan("prod", load_stack("prod", ROOT)).step.compute_s
    )


def test_calibration_out_is_an_option_checked_before_measuring(capsys) -> None:
    with pytest.raises(SystemExit):
        gpu.main(["--help"])
    assert "--calibration-out FILE" in capsys.readouterr().out
