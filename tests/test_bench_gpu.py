"""bench/gpu.py: fails fast without a GPU; its layout for the GPUs at hand; its ranks' code on CPU (gloo)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest
import torch

from bench import gpu

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_a_gpu_it_stops_at_once_with_exit_2(capsys) -> None:
    start = time.monotonic()
    assert gpu.main(["--stack", "dev", "--root", str(ROOT)]) == 2
    assert time.monotonic() - start < 5  # before loading a stack or building anything
    out, err = capsys.readouterr()
    assert out == ""  # no JSON line pretends to be a measurement
    assert "needs a CUDA GPU and this machine has none" in err and "python -m bench.gpu" in err


def test_the_cli_runs_it_as_bench_gpu() -> None:
    from supernode.cli.commands.bench import BENCHES

    assert BENCHES["gpu"] == "bench.gpu"


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
