"""Expert-parallel all-to-all overlap: step time with the chunked, asynchronous dispatch against the
synchronous one, on CPU gloo ranks (whose collectives run on their own threads, as NCCL's run on
their own streams).

For each EP size, EP gloo ranks each build the same stack of MoE layers (residual, shared expert)
and keep their slice of the experts; every repetition runs one forward+backward with
`AllToAllDispatcher(overlap=False)` (every all-to-all waits, one piece) and one with
`overlap=True, chunks=K` (the trainer's default), in alternating order so machine noise hits both
alike, after checking both compute the same outputs. Per run: the step time (slowest rank) and the
time the ranks spent blocked on all-to-all (a synchronous call's duration, an asynchronous one's
wait): the exposed communication, as a fraction of the step. One JSON line per EP size:
`ratio_on_vs_off` is the median of the repetition-by-repetition ratios of step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from supernode.core.config import Parallel
from supernode.trainer.dispatcher import AllToAllDispatcher
from supernode.trainer.moe import MoE

DEFAULT_CHUNKS = Parallel.model_fields["all_to_all_chunks"].default


class _BlockedTime:
    """Wraps dist.all_to_all_single: adds the time this rank is blocked on it to `seconds`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.real = dist.all_to_all_single

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        start = time.perf_counter()
        work = self.real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        self.seconds += time.perf_counter() - start
        return _TimedWait(work, self) if async_op else work


class _TimedWait:
    def __init__(self, work, clock: _BlockedTime) -> None:
        self.work, self.clock = work, clock

    def wait(self) -> bool:
        start = time.perf_counter()
        done = self.work.wait()
        self.clock.seconds += time.perf_counter() - start
        return done


def _stack(args: argparse.Namespace, rank: int, ep: int) -> nn.ModuleList:
    """The same layers on every rank (one seed), each keeping its 1/ep of the routed experts."""
    gen = torch.Generator().manual_seed(0)
    layers = nn.ModuleList()
    per = args.experts // ep
    for _ in range(args.layers):
        layer = MoE(args.dim, args.experts, args.topk, args.hidden, shared_experts=args.shared)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-2] ** 0.5)
        for name in ("w1", "w2", "w3"):
            full = getattr(layer.experts, name).detach()
            setattr(layer.experts, name, nn.Parameter(full[rank * per : (rank + 1) * per].clone()))
        layers.append(layer)
    return layers


def _forward(layers: nn.ModuleList, x: Tensor) -> Tensor:
    for layer in layers:
        x = x + layer(x)
    return x


def _worker(rank: int, ep: int, workdir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=ep)
    layers = _stack(args, rank, ep)
    dispatchers = {
        "off": AllToAllDispatcher(dist.group.WORLD, overlap=False),
        "on": AllToAllDispatcher(dist.group.WORLD, overlap=True, chunks=args.chunks),
    }
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(args.tokens, args.dim, generator=gen).requires_grad_()
    upstream = torch.randn(args.tokens, args.dim, generator=gen)
    clock = _BlockedTime()
    dist.all_to_all_single = clock

    def step(mode: str) -> tuple[float, float, Tensor]:
        for layer in layers:
            layer.dispatcher = dispatchers[mode]
        layers.zero_grad(set_to_none=True)
        dist.barrier()
        clock.seconds = 0.0
        start = time.perf_counter()
        out = _forward(layers, x)
        (out * upstream).sum().backward()
        elapsed = time.perf_counter() - start
        figures = torch.tensor([elapsed, clock.seconds], dtype=torch.float64)
        slowest, blocked = figures.clone(), figures.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(blocked)
        return slowest[0].item(), blocked[1].item() / ep, out.detach()

    try:
        _, _, off = step("off")  # also the warm-up of both
        _, _, on = step("on")
        same = torch.equal(on, off)
        runs: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        for i in range(args.repeat):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                runs[mode].append(step(mode)[:2])
    finally:
        dist.all_to_all_single = clock.real
    if rank == 0:
        Path(workdir, "result.json").write_text(json.dumps({"same_outputs": same, "runs": runs}))
    dist.destroy_process_group()


def measure(args: argparse.Namespace, ep: int) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(_worker, args=(ep, workdir, args), nprocs=ep, start_method="spawn", join=True)
        result = json.loads(Path(workdir, "result.json").read_text())
    off, on = result["runs"]["off"], result["runs"]["on"]
    ratios = [a[0] / b[0] for a, b in zip(on, off)]
    return {
        "measurement": "all_to_all_overlap",
        "ep": ep,
        "chunks": args.chunks,
        "layers": args.layers,
        "tokens_per_rank": args.tokens,
        "same_outputs": result["same_outputs"],
        "step_s_off": round(statistics.median(s for s, _ in off), 5),
        "step_s_on": round(statistics.median(s for s, _ in on), 5),
        "ratio_on_vs_off": round(statistics.median(ratios), 4),
        "ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)] if len(ratios) > 1 else None,
        "exposed_comm_fraction_off": round(statistics.median(b / s for s, b in off), 4),
        "exposed_comm_fraction_on": round(statistics.median(b / s for s, b in on), 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="supernode bench overlap", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512, help="expert hidden size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--shared", type=int, default=1, help="shared experts (0: none)")
    ap.add_argument("--layers", type=int, default=2, help="MoE layers in the stack")
    ap.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS, help="pieces with overlap on (parallel default)")
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="expert-parallel sizes")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    ap.add_argument("--repeat", type=int, default=6, help="paired repetitions")
    args = ap.parse_args(argv)
    problems = [
        f"--{k} must be >= 1 (got {getattr(args, k)})"
        for k in ("tokens", "dim", "hidden", "experts", "topk", "layers", "chunks", "threads", "repeat")
        if getattr(args, k) < 1
    ]
    if args.shared < 0:
        problems.append(f"--shared must be >= 0 (got {args.shared})")
    if args.topk > args.experts:
        problems.append(f"--topk must be at most --experts ({args.experts}) (got {args.topk})")
    problems += [
        f"--ep {ep} must be >= 2 and divide --experts ({args.experts})" for ep in args.ep if ep < 2 or args.experts % ep
    ]
    if problems:
        ap.error("; ".join(problems))  # exit 2
    for ep in args.ep:
        print(json.dumps(measure(args, ep)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
