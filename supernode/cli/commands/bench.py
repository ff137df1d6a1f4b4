"""`supernode bench NAME [args...]`: run a benchmark from supernode.bench/ (one JSON line per measurement)."""

from __future__ import annotations

import importlib

from ...core.errors import BadInput

BENCHES = {
    "preview": "supernode.bench.preview",  # offline preview cost: prod vs a 4x larger stack
    "moe": "supernode.bench.moe",  # MoE layer throughput and all-to-all volume; --compare torchtitan: side by side
    "checkpoint": "supernode.bench.checkpoint",  # async vs sync checkpoint stall; per-rank vs rank-0 sha256
    "data": "supernode.bench.data",  # loader tokens/s vs the plan's need; resident memory at 0.5 vs 2 GB
    "memory": "supernode.bench.memory",  # the planner's memory per rank against a real build and step
    "gpu": "supernode.bench.gpu",  # on a GPU machine: MoE layer (NCCL EP), bench memory vs the planner, model MFU
    "overlap": "supernode.bench.overlap",  # EP all-to-all chunked overlap on vs off (CPU gloo): step time, exposed comm
    "profiler": "supernode.bench.profiler",  # a trainer step under torch.profiler vs not: the sampled-profiling cost
    "pipeline": "supernode.bench.pipeline",  # 1F1B vs interleaved 1F1B on CPU: step time, measured vs planned bubble
    "jobs": "supernode.bench.jobs",  # local job queue: submit -> admitted latency; job list at 1,000 vs 10 jobs
    "ui": "supernode.bench.ui",  # the management page: time to first byte and payload of the job list, 1,000 vs 10 jobs
    "serve": "supernode.bench.serve",  # vLLM continuous batching vs sequential: TTFT, inter-token latency, tokens/s
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("args", nargs="...", help="arguments for the benchmark (see supernode bench NAME --help)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        module = importlib.import_module(BENCHES[args.name])
    except ModuleNotFoundError as e:
        raise BadInput(f"benchmark {args.name!r} is not available: {e}") from None
    return int(module.main(args.args) or 0)
