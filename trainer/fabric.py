"""Fabric check: all_reduce and all_to_all bus bandwidth over message sizes, gated by a threshold.

    torchrun --nproc-per-node N -m trainer.fabric --plan /etc/supernode/plan.json [--sizes 1M,16M,256M]
    torchrun --nproc-per-node N -m trainer.fabric --min-busbw-gbytes-s 240        # a manual run

Bus bandwidth follows nccl-tests (doc/PERFORMANCE.md): algbw = bytes / time, and
busbw = algbw x 2(n-1)/n for all_reduce, algbw x (n-1)/n for all_to_all, so the figure is comparable
to the hardware's link bandwidth whatever the rank count. Units are GB/s (10^9 bytes/s), as
nccl-tests prints them. Rank 0 prints one JSON line per (op, size) and a final gate line; the gate
compares the best all_reduce busbw (reached at large messages) with the floor: the plan's
`gate_floor_gbytes_s` (--plan, as the gate Job runs it) or an explicit --min-busbw-gbytes-s.

Exit codes: 0 passed, 1 below the threshold, 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from pydantic import ValidationError

from supernode.core.errors import EXIT_BAD_INPUT, BadInput
from supernode.core.plan import Plan

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    unit = t[-1] if t and t[-1] in UNITS else ""
    try:
        value = int(float(t[:len(t) - len(unit)]) * UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: {text!r} is not a size such as 4096, 64K, 16M or 1G") from None
    if value < 4:
        raise argparse.ArgumentTypeError(f"--sizes: {text!r} is below 4 bytes (one float32)")
    return value


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def _op(name: str, buf: torch.Tensor, out: torch.Tensor) -> None:
    if name == "all_reduce":
        dist.all_reduce(buf)
    else:
        dist.all_to_all_single(out, buf)


def measure(op: str, nbytes: int, device: torch.device, warmup: int, iters: int) -> dict:
    """One (op, size) point: mean time per call over `iters` after `warmup`, and the bandwidths."""
    n = dist.get_world_size()
    elems = max(n, nbytes // 4 // n * n)  # float32, divisible by n for all_to_all's equal splits
    buf = torch.ones(elems, dtype=torch.float32, device=device)
    out = torch.empty_like(buf)
    for _ in range(warmup):
        _op(op, buf, out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        _op(op, buf, out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace, as in nccl-tests
    size = elems * 4
    algbw = size / elapsed.item() / 1e9
    return {"op": op, "bytes": size, "world_size": n, "time_us": round(elapsed.item() * 1e6, 2),
            "algbw_gb_s": round(algbw, 4), "busbw_gb_s": round(algbw * BUSBW_FACTOR[op](n), 4)}


def plan_floor(path: str) -> float:
    """The gate floor (GB/s) of a plan file, as `supernode plan --json --full` or the plan ConfigMap holds it."""
    try:
        plan = Plan.read(path)
    except UnicodeDecodeError as e:
        raise BadInput(f"--plan {path}: not UTF-8 text (byte {e.start}); give the JSON of `supernode plan --json --full`") from None
    except OSError as e:
        raise BadInput(f"--plan {path}: cannot be read ({e.strerror})") from None
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        raise BadInput(f"--plan {path}: not a valid plan: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if plan.gate_floor_gbytes_s is None:
        raise BadInput(f"--plan {path}: the plan has no interconnect gate floor (gate_floor_gbytes_s is null: the "
                       f"catalog publishes no all_reduce baseline for {plan.instance_type}); pass --min-busbw-gbytes-s")
    return plan.gate_floor_gbytes_s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.fabric", description=__doc__.split("\n")[0])
    floor = p.add_mutually_exclusive_group(required=True)
    floor.add_argument("--plan", metavar="PATH",
                       help="gate on the plan's floor (gate_floor_gbytes_s): how the interconnect gate Job runs it")
    floor.add_argument("--min-busbw-gbytes-s", type=float, metavar="GB_S",
                       help="gate on this floor instead (a manual run): the best all_reduce bus bandwidth must "
                            "reach this many GB/s (10^9 bytes/s)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="comma-separated message sizes (default: 1M..1G on GPU, 64K..16M on CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout-s", type=int, default=600, help="collective timeout")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed the problem
        return EXIT_BAD_INPUT if e.code else 0
    try:
        floor = plan_floor(args.plan) if args.plan is not None else args.min_busbw_gbytes_s
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if floor < 0 or args.iters < 1 or args.warmup < 0:
        print("error: the bus-bandwidth floor must be >= 0, --iters >= 1, --warmup >= 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    sizes = args.sizes or ([2**k for k in range(20, 31, 2)] if gpu else [2**k for k in range(16, 25, 4)])
    dist.init_process_group("nccl" if gpu else "gloo", timeout=timedelta(seconds=args.timeout_s))
    try:
        rank, best = dist.get_rank(), 0.0
        for op in ("all_reduce", "all_to_all"):
            for size in sizes:
                point = measure(op, size, device, args.warmup, args.iters)
                if op == "all_reduce":
                    best = max(best, point["busbw_gb_s"])
                if rank == 0:
                    print(json.dumps(point), flush=True)
        passed = best >= floor
        if rank == 0:
            print(json.dumps({"gate": "all_reduce_busbw", "best_busbw_gb_s": best,
                              "min_busbw_gb_s": floor, "passed": passed}), flush=True)
        return 0 if passed else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
