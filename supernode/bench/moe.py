"""MoE layer benchmarks: the layer vs a naive per-expert loop, and all-to-all bytes vs the minimum.

1. Forward+backward tokens/s of `supernode.trainer.moe.MoE` (stacked experts; on CPU batched matmuls over
   padded blocks of experts, `supernode.trainer.moe.expert_blocks`) against a naive per-expert loop of
   identical math (mask the tokens of each expert, compute, scatter-add: how simple MoE
   implementations do it), measured alternately in the same run so
   machine noise hits both alike; outputs are checked equal first.
2. Expert-parallel dispatch on EP gloo ranks: bytes each rank hands to all_to_all_single for
   other ranks in one forward, against the analytic minimum tokens*top_k*dim*bytes*(ep-1)/ep
   (uniform routing). The goal is <= 1.05.
3. `--compare torchtitan` (instead of 1 and 2): forward+backward tokens/s of this layer against
   torchtitan 0.3.0's `torchtitan.models.common.moe.MoE` (the best open implementation that runs on
   CPU), configured alike (dims, experts, top-k, router score, normalised top-k weights, shared
   expert, bf16) and loaded with the SAME weights (ours stored [E, dim, hidden], theirs
   [E, hidden, dim]: transposed copies). First both compute the same input: the fraction of tokens
   routed to the same experts, and the largest difference of the outputs of those tokens, must
   show the same function; every token routed otherwise must be a near-tie within bf16 rounding
   (torchtitan's router runs in bf16 on CPU, where its fp32 autocast is unsupported; ours takes
   fp32 softmax/sigmoid of the bf16 logits). Then the two alternate repetition by repetition
   (noise hits both alike): medians, tokens/s, `speedup_vs_torchtitan` and the median (and
   quartiles) of the repetition-by-repetition ratios, `paired_speedup_median` (the goal is >= 1.3 at
   bf16, 2 threads; on a machine shared with other work the 2-thread medians mostly measure the
   scheduler: `load_average_1m` says how busy it was, and --threads 1 is steadier), with each
   layer's `minor_page_faults_per_step`: fresh memory faults once per 4 KiB page on first touch,
   and how much of it a layer allocates afresh is part of its speed. Then both run again after
   glibc is told to keep freed memory (`freed_memory_kept`): what is left without page faults.
   torchtitan is not a project dependency: install it beside the project, e.g.

       pip install --target /tmp/tt --no-deps torchtitan==0.3.0 einops safetensors tyro spmd-types \
           docstring-parser triton
       supernode bench moe --compare torchtitan --torchtitan-path /tmp/tt --dtype bfloat16

   (--torchtitan-path, or $SUPERNODE_TORCHTITAN_PATH, is put on sys.path in this process only.)
One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.metadata
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from supernode.trainer.device import cpu_has_native_bf16
from supernode.trainer.dispatcher import AllToAllDispatcher
from supernode.trainer.moe import MoE, expert_strategy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def moe_layer_flops(tokens: int, dim: int, hidden: int, experts: int, topk: int) -> int:
    """Forward+backward matmul FLOPs of one MoE layer: router + top-k SwiGLU experts (3 matmuls)."""
    return 6 * tokens * (topk * 3 * dim * hidden + dim * experts)


def build_layer(args: argparse.Namespace, seed: int = 0) -> MoE:
    layer = MoE(args.dim, args.experts, args.topk, args.hidden, shared_experts=args.shared, score=args.score)
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
    impls = {"layer": lambda: layer(x), "naive_loop": lambda: naive_moe(layer, x)}
    with torch.no_grad():
        torch.testing.assert_close(impls["layer"](), impls["naive_loop"](), rtol=5e-2, atol=5e-2)
    # The ceiling on this machine: the same expert matmuls as one dense SwiGLU over all token copies.
    ex = layer.experts

    def dense() -> torch.Tensor:
        copies = x.repeat(args.topk, 1)
        return ((F.silu(copies @ ex.w1[0]) * (copies @ ex.w3[0])) @ ex.w2[0]).view(args.topk, -1, args.dim).sum(0)

    impls["dense_ceiling"] = dense
    times: dict[str, list[float]] = {k: [] for k in impls}
    for fn in impls.values():  # warm-up
        _timed(fn, x, upstream)
    for _ in range(args.repeat):
        for name, fn in impls.items():
            times[name].append(_timed(fn, x, upstream))
    best = {k: min(v) for k, v in times.items()}
    return {
        "measurement": "moe_layer_fwd_bwd",
        "tokens": args.tokens,
        "dim": args.dim,
        "hidden": args.hidden,
        "experts": args.experts,
        "topk": args.topk,
        "dtype": args.dtype,
        "threads": args.threads,
        "expert_strategy": expert_strategy(x, layer.experts.w1),
        "layer_tokens_per_s": round(args.tokens / best["layer"], 1),
        "naive_loop_tokens_per_s": round(args.tokens / best["naive_loop"], 1),
        "speedup_vs_naive": round(best["naive_loop"] / best["layer"], 3),
        "layer_gflop_per_s": round(
            moe_layer_flops(args.tokens, args.dim, args.hidden, args.experts, args.topk) / best["layer"] / 1e9, 1
        ),
        "fraction_of_dense_ceiling": round(best["dense_ceiling"] / best["layer"], 3),
        "layer_median_s": round(statistics.median(times["layer"]), 5),
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
        setattr(layer.experts, name, torch.nn.Parameter(full.detach()[rank * per : (rank + 1) * per].clone()))
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
    # Forward calls: token counts, then the pieces' dispatches and combines in the order
    # AllToAllDispatcher.compute issues them: dispatch 0, then per piece i the next dispatch and its
    # combine. Routing-exact minimum: the copies whose expert lives elsewhere.
    k = layer.dispatcher.chunks
    roles = ["dispatch"] + [role for i in range(k) for role in ["dispatch"] * (i + 1 < k) + ["combine"]]
    assert len(calls) == 1 + len(roles), f"{len(calls)} all-to-alls for {k} pieces"
    counts_bytes = calls[0]
    dispatch_bytes = sum(n for n, role in zip(calls[1:], roles) if role == "dispatch")
    combine_bytes = sum(n for n, role in zip(calls[1:], roles) if role == "combine")
    load = layer.tokens_per_expert  # this rank's routed copies (nothing reduced them)
    row_bytes = args.dim * torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    remote_rows = int(load.sum() - load[rank * per : (rank + 1) * per].sum())
    Path(workdir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "counts_bytes": counts_bytes,
                "dispatch_bytes": dispatch_bytes,
                "combine_bytes": combine_bytes,
                "routing_minimum_bytes": remote_rows * row_bytes,
                "forward_s": elapsed,
            }
        )
    )
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
        "measurement": "all_to_all_dispatch_bytes",
        "ep": ep,
        "tokens_per_rank": args.tokens,
        "dim": args.dim,
        "topk": args.topk,
        "dtype": args.dtype,
        "bytes_sent_per_rank": round(sent),
        "analytic_minimum_bytes": round(analytic),
        "ratio_vs_analytic": round(sent / analytic, 4),
        "ratio_vs_routing_minimum": round(sent / routing_min, 4) if routing_min else None,
        "combine_bytes_per_rank": round(statistics.mean(r["combine_bytes"] for r in ranks)),
        "forward_s": round(max(r["forward_s"] for r in ranks), 5),
    }


# -- torchtitan side by side ------------------------------------------------------------------------

TORCHTITAN_VERSION = "0.3.0"
TORCHTITAN_INSTALL = (
    "pip install --target DIR --no-deps torchtitan==0.3.0 einops safetensors tyro spmd-types "
    "docstring-parser triton, then pass --torchtitan-path DIR (not into the project's venv)"
)


def import_torchtitan(path: str | None):
    """torchtitan's MoE module, with `path` (if any) put on sys.path for this process; ImportError if absent."""
    if path:
        if not os.path.isdir(path):
            raise ImportError(f"--torchtitan-path {path}: no such directory")
        if path not in sys.path:
            sys.path.insert(0, path)
    return importlib.import_module("torchtitan.models.common.moe")


def build_torchtitan(tt, ours: MoE, args: argparse.Namespace):
    """torchtitan's MoE configured like `ours` and holding the same weights (transposed where its layout is)."""
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    def linear(i: int, o: int):
        return Linear.Config(in_features=i, out_features=o)

    e, k, dim, hidden = args.experts, args.topk, args.dim, args.hidden
    cfg = tt.MoE.Config(
        num_experts=e,
        routed_experts=tt.RoutedExperts.Config(
            inner_experts=tt.GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=e),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=k),
        ),
        # Ours: top-k of the scores plus the balancing bias, weights renormalised to sum to 1.
        router=tt.TokenChoiceTopKRouter.Config(
            num_experts=e, gate=linear(dim, e), top_k=k, score_func=args.score, route_norm=True, route_scale=1.0
        ),
        load_balance_coeff=1e-3,  # keeps its expert bias (zero here, as ours), like our aux-loss-free bias
        shared_experts=(
            FeedForward.Config(
                w1=linear(dim, hidden * args.shared),
                w2=linear(hidden * args.shared, dim),
                w3=linear(dim, hidden * args.shared),
            )
            if args.shared
            else None
        ),
    )
    layer = cfg.build()
    with torch.no_grad():
        inner = layer.routed_experts.inner_experts
        for theirs, mine in (
            (inner.w1_EFD, ours.experts.w1),
            (inner.w3_EFD, ours.experts.w3),
            (inner.w2_EDF, ours.experts.w2),
        ):
            theirs.copy_(mine.transpose(1, 2))
        layer.router.gate.weight.copy_(ours.router.gate.weight)
        if args.shared:
            for name in ("w1", "w2", "w3"):
                getattr(layer.shared_experts, name).weight.copy_(getattr(ours.shared, name).weight)
    layer = layer.to(DTYPES[args.dtype])
    # Its balancing buffers are fp32 by design (ours: as the layer's dtype; neither enters the math here).
    layer.expert_bias_E = layer.expert_bias_E.float()
    layer.tokens_per_expert_E = layer.tokens_per_expert_E.float()
    return layer.train()


def compare_torchtitan(args: argparse.Namespace, tt) -> dict:
    # Its router asks for fp32 autocast, which CPU autocast does not support: it warns on every call.
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    ours = build_layer(args)
    theirs = build_torchtitan(tt, ours, args)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.dim, generator=gen).to(dtype).requires_grad_()
    upstream = torch.randn(args.tokens, args.dim, generator=gen).to(dtype)
    impls = {"ours": lambda: ours(x), "torchtitan": lambda: theirs(x.view(1, args.tokens, args.dim)).view_as(x)}
    sameness = _same_function(ours, theirs, impls, x, args)
    times, faults = _alternate(impls, (ours, theirs), x, upstream, args.repeat)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    kept = _with_freed_memory_kept(impls, (ours, theirs), x, upstream, args.repeat)
    return {
        "measurement": "moe_layer_vs_torchtitan",
        "torchtitan_version": _version("torchtitan"),
        "tokens": args.tokens,
        "dim": args.dim,
        "hidden": args.hidden,
        "experts": args.experts,
        "topk": args.topk,
        "shared_experts": args.shared,
        "score": args.score,
        "dtype": args.dtype,
        "threads": args.threads,
        "repeat": args.repeat,
        **sameness,
        **_speeds(args.tokens, times, faults),
        "freed_memory_kept": kept,
        "load_average_1m": load,
    }


def _same_function(
    ours: MoE, theirs, impls: dict[str, Callable[[], torch.Tensor]], x: torch.Tensor, args: argparse.Namespace
) -> dict:
    """Whether both layers compute the same function on x (`same_function`), and the figures it rests on."""
    # Same function: the same outputs for the tokens routed alike, and every token routed otherwise
    # a near-tie, i.e. the experts torchtitan chose score, by our fp32 scores, within bf16's rounding
    # (2^-8 relative) of our k-th best: its router rounds the scores to bf16 on CPU, so ties there
    # break differently (many with sigmoid scores, which sit near 0.5 where bf16 steps are 2^-9).
    with torch.no_grad():
        out_ours, out_tt = impls["ours"]().float(), impls["torchtitan"]().float()
        _, ids_ours, _, scores = ours.router(x)
        _, ids_tt, _ = theirs.router(x.view(1, args.tokens, args.dim), theirs.expert_bias_E)
        ids_tt = ids_tt.view_as(ids_ours)
    same = (ids_ours.sort(-1).values == ids_tt.sort(-1).values).all(-1)
    diff = (out_ours[same] - out_tt[same]).abs().max().item() if same.any() else float("inf")
    scale = out_ours.abs().max().item()
    agreement = same.float().mean().item()
    kth = scores.gather(-1, ids_ours).min(-1).values
    near_tie = scores.gather(-1, ids_tt).min(-1).values >= kth * (1 - 2.0**-7) - 1e-6
    same_function = bool(agreement >= 0.5 and near_tie[~same].all() and diff <= 0.05 * max(scale, 1e-6))
    return {
        "routing_agreement": round(agreement, 5),
        "other_routing_all_bf16_near_ties": bool(near_tie[~same].all()),
        "max_abs_diff_same_routing": round(diff, 6),
        "output_abs_max": round(scale, 6),
        "same_function": same_function,
    }


def _alternate(
    impls: dict[str, Callable[[], torch.Tensor]],
    layers: tuple[torch.nn.Module, ...],
    x: torch.Tensor,
    upstream: torch.Tensor,
    repeat: int,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Both, repetition by repetition (noise hits both alike): times, and minor page faults per step."""
    times: dict[str, list[float]] = {k: [] for k in impls}
    faults = dict.fromkeys(impls, 0)
    for fn in impls.values():  # warm-up
        _timed(fn, x, upstream)
    for _ in range(repeat):
        for name, fn in impls.items():
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            times[name].append(_timed(fn, x, upstream))
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return times, {k: round(v / repeat) for k, v in faults.items()}


def _speeds(tokens: int, times: dict[str, list[float]], faults: dict[str, float]) -> dict:
    """Tokens/s, speedups (of the medians, and paired) and step times of the alternated runs."""
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = _paired(times)
    return {
        "ours_tokens_per_s": round(tokens / med["ours"], 1),
        "torchtitan_tokens_per_s": round(tokens / med["torchtitan"], 1),
        "speedup_vs_torchtitan": round(med["torchtitan"] / med["ours"], 3),
        "paired_speedup_median": round(statistics.median(paired), 3),
        "paired_speedup_quartiles": _quartiles(paired),
        "ours_median_s": round(med["ours"], 5),
        "torchtitan_median_s": round(med["torchtitan"], 5),
        "ours_min_s": round(min(times["ours"]), 5),
        "torchtitan_min_s": round(min(times["torchtitan"]), 5),
        "minor_page_faults_per_step": faults,
    }


def _with_freed_memory_kept(
    impls: dict[str, Callable[[], torch.Tensor]],
    layers: tuple[torch.nn.Module, ...],
    x: torch.Tensor,
    upstream: torch.Tensor,
    repeat: int,
) -> dict | None:
    """Then with freed memory kept by the C allocator, for both: what is left without page faults.
    None where glibc cannot be told to keep it."""
    if not _keep_freed_memory():
        return None
    times, faults = _alternate(impls, layers, x, upstream, repeat)
    paired = _paired(times)
    return {
        "paired_speedup_median": round(statistics.median(paired), 3),
        "paired_speedup_quartiles": _quartiles(paired),
        "ours_median_s": round(statistics.median(times["ours"]), 5),
        "torchtitan_median_s": round(statistics.median(times["torchtitan"]), 5),
        "minor_page_faults_per_step": faults,
    }


def _paired(times: dict[str, list[float]]) -> list[float]:
    """Each repetition ran both back to back: the ratios of those pairs, sorted. Their median is
    steadier than the ratio of the medians when the machine's speed drifts during the run."""
    return sorted(t / o for o, t in zip(times["ours"], times["torchtitan"]))


def _quartiles(values: list[float]) -> list[float]:
    return [round(values[len(values) // 4], 3), round(values[(3 * len(values)) // 4], 3)]


def _keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (no returning it to the kernel, no fresh mappings for
    blocks up to 32 MiB, its ceiling): freshly mapped memory page-faults on first touch, once per
    4 KiB. For this process, for good: the comparison runs it last. False where it cannot."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.compare else "float32")
    args.repeat = args.repeat if args.repeat is not None else (15 if args.compare else 5)
    problems = _argument_problems(args)
    if problems:
        ap.error("; ".join(problems))  # exit 2
    if args.dtype == "bfloat16" and not args.allow_emulated_bf16 and not cpu_has_native_bf16():
        # A fact of this machine, not a bad flag: one line, before minutes of emulated bf16 (issue 41 item 7).
        instead = "--allow-emulated-bf16" if args.compare else "--dtype float32 (or --allow-emulated-bf16)"
        print(
            "error: --dtype bfloat16: this CPU has no native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo), "
            f"so torch emulates it and the run takes many minutes; use {instead}",
            file=sys.stderr,
        )
        return 2
    if args.compare:
        return _run_comparison(args)
    print(json.dumps(layer_throughput(args)), flush=True)
    for ep in args.ep:
        print(json.dumps(all_to_all_bytes(args, ep)), flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="supernode bench moe", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512, help="expert hidden size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--shared", type=int, default=0, help="shared experts (0: none)")
    ap.add_argument("--score", choices=("softmax", "sigmoid"), default="softmax", help="router score function")
    ap.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="default float32; bfloat16 with --compare (torchtitan's experts compute in bf16 only)",
    )
    ap.add_argument(
        "--allow-emulated-bf16", action="store_true", help="run bf16 on a CPU without native bf16 (very slow)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=None, help="default 5; 15 with --compare")
    ap.add_argument(
        "--ep", type=int, nargs="*", default=[2, 4], help="expert-parallel sizes for all-to-all (none: skip)"
    )
    ap.add_argument(
        "--compare",
        choices=("torchtitan",),
        default=None,
        help="only the side-by-side comparison with torchtitan's MoE layer (see above)",
    )
    ap.add_argument(
        "--torchtitan-path",
        default=os.environ.get("SUPERNODE_TORCHTITAN_PATH"),
        help="directory holding torchtitan and its imports (default: $SUPERNODE_TORCHTITAN_PATH)",
    )
    return ap


def _argument_problems(args: argparse.Namespace) -> list[str]:
    """Every bad flag (its dtype and repeat defaults already resolved), in one list: one error for all."""
    problems = [
        f"--{k} must be >= 1 (got {getattr(args, k)})"
        for k in ("tokens", "dim", "hidden", "experts", "topk", "threads", "repeat")
        if getattr(args, k) < 1
    ]
    if args.shared < 0:
        problems.append(f"--shared must be >= 0 (got {args.shared})")
    if args.topk > args.experts:
        problems.append(f"--topk must be at most --experts ({args.experts}) (got {args.topk})")
    if not args.compare:
        problems += [
            f"--ep {ep} must be >= 2 and divide --experts ({args.experts})"
            for ep in args.ep
            if ep < 2 or args.experts % ep
        ]
    elif args.dtype != "bfloat16":
        problems.append(
            f"--compare torchtitan needs --dtype bfloat16 (got {args.dtype}): torchtitan's experts "
            "always compute in bf16, so another dtype would not be the same function"
        )
    if args.compare:  # torchtitan's experts always take torch._grouped_mm: rows of a multiple of 16 bytes
        problems += [
            f"--compare torchtitan needs --{k} to be a multiple of 8 (got {getattr(args, k)}): torchtitan's "
            "experts use torch._grouped_mm, which needs bf16 rows of a multiple of 16 bytes"
            for k in ("dim", "hidden")
            if getattr(args, k) % 8
        ]
    return problems


def _run_comparison(args: argparse.Namespace) -> int:
    """`--compare torchtitan`: its line, and exit 1 when the two layers do not compute the same function."""
    try:
        tt = import_torchtitan(args.torchtitan_path)
    except ImportError as e:  # ModuleNotFoundError included: torchtitan or one of its imports
        print(
            f"error: --compare torchtitan: torchtitan's MoE is not importable ({e}). It is not a project "
            f"dependency: {TORCHTITAN_INSTALL}",
            file=sys.stderr,
        )
        return 2
    version = _version("torchtitan")
    if version != TORCHTITAN_VERSION:
        print(
            f"warning: torchtitan {version} found; the comparison was written for {TORCHTITAN_VERSION}",
            file=sys.stderr,
        )
    line = compare_torchtitan(args, tt)
    print(json.dumps(line), flush=True)
    if not line["same_function"]:
        print(
            "error: the two layers do not compute the same function on these weights (see routing_agreement "
            "and max_abs_diff_same_routing); the speed comparison is void",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
