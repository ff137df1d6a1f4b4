"""One-command GPU benchmark: bf16 MoE layer MFU, and measured peak memory against the planner.

    python -m supernode.bench.gpu_moe [--stack dev] [--tokens 16384 --dim 2048 --hidden 1408 --experts 64 --topk 6]

1. `moe_layer_mfu`: forward+backward of `supernode.trainer.moe.MoE` in bf16 (grouped_mm on sm90+); MFU =
   achieved FLOP/s over the catalog's dense bf16 peak for this GPU.
2. `peak_memory_vs_plan`: one training step (forward, backward, AdamW) of the stack's model on
   this one GPU, laid out as the planner assumes (FSDP2 with fp32 sharded parameters, bf16
   compute, fp32 gradient reduction, on a 1-rank mesh), against `supernode.core.capacity.memory` for
   the same model, micro-batch and activation checkpointing with every degree 1. The planner's
   runtime reserve (CUDA context, communicator buffers) is outside the allocator, so it is
   compared without it.
Without CUDA it prints one JSON line saying so and exits 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from supernode.core import capacity
from supernode.core.catalog import CATALOG
from supernode.core.config import ConfigError, Parallel, load_stack


def peak_flops(device_name: str) -> tuple[str, float]:
    """The catalog's dense bf16 peak for the accelerator named in the CUDA device name."""
    for t in CATALOG.values():
        if t.accelerator in device_name:
            return t.accelerator, t.peak_flops
    raise SystemExit(
        f"no catalog entry for GPU {device_name!r}; known: {sorted({t.accelerator for t in CATALOG.values()})}"
    )


def layer_mfu(args: argparse.Namespace, peak: float) -> dict:
    from supernode.bench.moe import moe_layer_flops
    from supernode.trainer.moe import MoE, grouped_mm_applies

    layer = MoE(args.dim, args.experts, args.topk, args.hidden).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, args.dim**-0.5)
    x = torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn_like(x)
    for _ in range(3):  # warm-up
        (layer(x) * upstream).sum().backward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.repeat):
        (layer(x) * upstream).sum().backward()
    torch.cuda.synchronize()
    step = (time.perf_counter() - start) / args.repeat
    flops = moe_layer_flops(args.tokens, args.dim, args.hidden, args.experts, args.topk)
    return {
        "measurement": "moe_layer_mfu",
        "device": torch.cuda.get_device_name(),
        "tokens": args.tokens,
        "dim": args.dim,
        "hidden": args.hidden,
        "experts": args.experts,
        "topk": args.topk,
        "dtype": "bfloat16",
        "grouped_mm_used": grouped_mm_applies(x, layer.experts.w1),
        "step_s": round(step, 6),
        "tflops": round(flops / step / 1e12, 2),
        "mfu": round(flops / step / peak, 4),
    }


def peak_memory_vs_plan(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from supernode.trainer.model import Transformer, loss_fn

    cfg = load_stack(args.stack)
    m = cfg.model
    t = cfg.training.model_copy(update={"micro_batch": args.micro_batch or cfg.training.micro_batch})
    p = Parallel(activation_checkpointing=cfg.parallel.activation_checkpointing, mixed_precision="bf16")
    predicted = capacity.memory(m, p, t)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = Transformer(m)
    model.to_empty(device="cuda")
    model.init_weights(0)  # also fills the RoPE tables the meta device left empty
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        block.checkpoint = p.activation_checkpointing
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, m.vocab, (t.micro_batch, m.seq_len + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # the second step holds the optimizer moments too
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) + model.aux_loss()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    dist.destroy_process_group()
    expected = predicted.total - predicted.runtime_reserve
    return {
        "measurement": "peak_memory_vs_plan",
        "stack": args.stack,
        "micro_batch": t.micro_batch,
        "seq_len": m.seq_len,
        "activation_checkpointing": p.activation_checkpointing,
        "measured_peak_gib": round(peak / 2**30, 3),
        "planned_gib": round(expected / 2**30, 3),
        "planned_terms_gib": {k: round(v / 2**30, 3) for k, v in predicted.model_dump().items()},
        "measured_over_planned": round(peak / expected, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m supernode.bench.gpu_moe", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--stack", default="dev", help="stack whose model the memory check trains")
    ap.add_argument("--micro-batch", type=int, default=0, help="0: the stack's training.microBatch")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            json.dumps(
                {
                    "measurement": "gpu_moe",
                    "skipped": True,
                    "reason": "CUDA is not available on this machine; run this on a GPU node "
                    "(e.g. a p5 pod with the trainer image)",
                }
            ),
            flush=True,
        )
        return 0
    try:
        load_stack(args.stack)
    except ConfigError as e:
        print(f"bad stack {args.stack!r}:\n{e}", file=sys.stderr)
        return 2
    _, peak = peak_flops(torch.cuda.get_device_name())
    print(json.dumps(layer_mfu(args, peak)), flush=True)
    torch.cuda.empty_cache()
    print(json.dumps(peak_memory_vs_plan(args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
