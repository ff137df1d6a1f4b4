"""`supernode bench NAME [args...]`: run a benchmark from bench/ (one JSON line per measurement)."""

from __future__ import annotations

import importlib

from ...core.errors import BadInput

BENCHES = {
    "preview": "bench.preview",  # offline preview cost: prod vs a 4x larger stack
    "moe": "bench.moe",  # MoE layer throughput and all-to-all volume
    "checkpoint": "bench.checkpoint",  # async vs sync checkpoint stall
    "data": "bench.data",  # loader tokens/s vs the plan's need; resident memory at 0.5 vs 2 GB
    "memory": "bench.memory",  # the planner's memory per rank against a real build and step
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
