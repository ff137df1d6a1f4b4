"""MoE layer benchmarks: grouped_mm vs a naive per-expert loop, and all-to-all bytes vs the minimum.

1. Forward+backward tokens/s of `trainer.moe.MoE` (stacked experts through `torch._grouped_mm`)
   against a naive per-expert loop of identical math (mask the tokens of each expert, compute,
   scatter-add: how simple MoE implementations do it), measured alternately in the same run so
   machine noise hits both alike; outputs are checked equal first.
2. Expert-parallel dispatch on EP gloo ranks: bytes each rank hands to all_to_all_single for
   other ranks in one forward, against the analytic minimum tokens*top_k*dim*bytes*(ep-1)/ep
   (uniform routing). The goal is <= 1.05.
One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from trainer.dispatcher import AllToAllDispatcher
from trainer.moe import MoE, grouped_mm_applies

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def moe_layer_flops(tokens: int, dim: int, hidden: int, experts: int, topk: int) -> int:
    """Forward+backward matmul FLOPs of one MoE layer: router + top-k SwiGLU experts (3 matmuls)."""
    return 6 * tokens * (topk * 3 * dim * hidden + dim * experts)


def build_layer(args: argparse.Namespace, seed: int = 0) -> MoE:
    layer = MoE(args.dim, args.experts, args.topk, args.hidden)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-2] ** 0.5)
    return layer.to(DTYPES[args.dtype])


def naive_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same router and SwiGLU experts, one masked gather/compute/scatter per expert."""
    weights, ids, _, _ = layer.router(x)
    out = torch.zeros_like(x)
    ex = layer.experts
    for e in range(layer.experts_total):
        token, slot = torch.where(ids == e)
        h = x[token]
        y = (F.silu(h @ ex.w1[e]) * (h @ ex.w3[e])) @ ex.w2[e]
        out = out.index_add(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


def _timed(fn: Callable[[], torch.Tensor], x: torch.Tensor, upstream: torch.Tensor) -> float:
    x.grad = None
    start = time.perf_counter()
    (fn() * upstream).sum().backward()
    return time.perf_counter() - start


def layer_throughput(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    layer = build_layer(args)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.dim, generator=gen).to(dtype).requires_grad_()
    upstream = torch.randn(args.tokens, args.dim, generator=gen).to(dtype)
    impls = {"grouped_mm": lambda: layer(x), "naive_loop": lambda: naive_moe(layer, x)}
    with torch.no_grad():
        torch.testing.assert_close(impls["grouped_mm"](), impls["naive_loop"](), rtol=5e-2, atol=5e-2)
    # The ceiling on this machine: the same expert matmuls as one dense SwiGLU over all token copies.
    ex = layer.experts

    def dense() -> torch.Tensor:
        copies = x.repeat(args.topk, 1)
        return ((F.silu(copies @ ex.w1[0]) * (copies @ ex.w3[0])) @ ex.w2[0]).view(args.topk, -1, args.dim).sum(0)

    impls["dense_ceiling"] = dense
    times: dict[str, list[float]] = {k: [] for k in impls}
    for name, fn in impls.items():  # warm-up
        _timed(fn, x, upstream)
    for _ in range(args.repeat):
        for name, fn in impls.items():
            times[name].append(_timed(fn, x, upstream))
    best = {k: min(v) for k, v in times.items()}
    return {
        "measurement": "moe_layer_fwd_bwd", "tokens": args.tokens, "dim": args.dim, "hidden": args.hidden,
        "experts": args.experts, "topk": args.topk, "dtype": args.dtype, "threads": args.threads,
        "grouped_mm_used": grouped_mm_applies(x, layer.experts.w1),
        "grouped_mm_tokens_per_s": round(args.tokens / best["grouped_mm"], 1),
        "naive_loop_tokens_per_s": round(args.tokens / best["naive_loop"], 1),
        "speedup_vs_naive": round(best["naive_loop"] / best["grouped_mm"], 3),
        "grouped_mm_gflop_per_s": round(
            moe_layer_flops(args.tokens, args.dim, args.hidden, args.experts, args.topk) / best["grouped_mm"] / 1e9, 1),
        "fraction_of_dense_ceiling": round(best["dense_ceiling"] / best["grouped_mm"], 3),
        "grouped_mm_median_s": round(statistics.median(times["grouped_mm"]), 5),
        "naive_loop_median_s": round(statistics.median(times["naive_loop"]), 5),
    }


# -- all-to-all bytes ---------------------------------------------------------------------------

def _a2a_worker(rank: int, ep: int, workdir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=ep)
    layer = build_layer(args)  # every rank builds the full layer, then keeps its experts
    per = args.experts // ep
    for name in ("w1", "w2", "w3"):
        full = getattr(layer.experts, name)
        setattr(layer.experts, name, torch.nn.Parameter(full.detach()[rank * per:(rank + 1) * per].clone()))
    layer.dispatcher = AllToAllDispatcher(dist.group.WORLD)
    calls: list[int] = []
    real = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        splits = input_split_sizes or [input.shape[0] // ep] * ep
        row_bytes = input[:1].numel() * input.element_size()
        calls.append(sum(n for j, n in enumerate(splits) if j != rank) * row_bytes)  # what leaves this rank
        return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    x = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(10 + rank)).to(DTYPES[args.dtype])
    dist.all_to_all_single = counting
    try:
        with torch.no_grad():
            start = time.perf_counter()
            layer(x)
            elapsed = time.perf_counter() - start
    finally:
        dist.all_to_all_single = real
    # Forward calls: token counts, dispatch, combine. Routing-exact minimum: the copies whose expert lives elsewhere.
    counts_bytes, dispatch_bytes, combine_bytes = calls
    load = layer.tokens_per_expert  # this rank's routed copies (nothing reduced them)
    row_bytes = args.dim * torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    remote_rows = int(load.sum() - load[rank * per:(rank + 1) * per].sum())
    Path(workdir, f"rank{rank}.json").write_text(json.dumps({
        "counts_bytes": counts_bytes, "dispatch_bytes": dispatch_bytes, "combine_bytes": combine_bytes,
        "routing_minimum_bytes": remote_rows * row_bytes, "forward_s": elapsed}))
    dist.destroy_process_group()


def all_to_all_bytes(args: argparse.Namespace, ep: int) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(_a2a_worker, args=(ep, workdir, args), nprocs=ep, start_method="spawn", join=True)
        ranks = [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(ep)]
    itemsize = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    analytic = args.tokens * args.topk * args.dim * itemsize * (ep - 1) / ep
    sent = statistics.mean(r["counts_bytes"] + r["dispatch_bytes"] for r in ranks)
    routing_min = statistics.mean(r["routing_minimum_bytes"] for r in ranks)
    return {
        "measurement": "all_to_all_dispatch_bytes", "ep": ep, "tokens_per_rank": args.tokens, "dim": args.dim,
        "topk": args.topk, "dtype": args.dtype, "bytes_sent_per_rank": round(sent),
        "analytic_minimum_bytes": round(analytic), "ratio_vs_analytic": round(sent / analytic, 4),
        "ratio_vs_routing_minimum": round(sent / routing_min, 4) if routing_min else None,
        "combine_bytes_per_rank": round(statistics.mean(r["combine_bytes"] for r in ranks)),
        "forward_s": round(max(r["forward_s"] for r in ranks), 5),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="supernode bench moe", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512, help="expert hidden size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ep", type=int, nargs="*", default=[2, 4], help="expert-parallel sizes for all-to-all (none: skip)")
    args = ap.parse_args(argv)
    problems = [f"--{k} must be >= 1 (got {getattr(args, k)})" for k in ("tokens", "dim", "hidden", "experts", "topk",
                                                                        "threads", "repeat") if getattr(args, k) < 1]
    if args.topk > args.experts:
        problems.append(f"--topk must be at most --experts ({args.experts}) (got {args.topk})")
    problems += [f"--ep {ep} must be >= 2 and divide --experts ({args.experts})" for ep in args.ep
                 if ep < 2 or args.experts % ep]
    if problems:
        ap.error("; ".join(problems))  # exit 2
    print(json.dumps(layer_throughput(args)), flush=True)
    for ep in args.ep:
        print(json.dumps(all_to_all_bytes(args, ep)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
