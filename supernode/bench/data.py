"""The data loader against what training consumes, and its resident memory as the dataset grows.

    python -m supernode.bench.data [--sizes-gb 0.5 2 --steps 200 --dir DIR]

Writes synthetic uint16 shards (random ids of a 32 768-token vocabulary, through the same shard
writer and manifest as `supernode data prepare`) of each size, then for each size in a fresh
process: the loader's resident memory (anonymous and file-backed, kB from /proc) after start-up and
`--steps` steps of the prod plan's rank-0 batch. For the dev and prod plans, on the first dataset:
the loader's tokens/s for one data-parallel rank against what that rank consumes (the plan's tokens
per step / dp / its estimated step time). On the largest dataset: `data verify`'s pass over the shards
(sha256 and the largest id, read once) against a sha256 alone, alternated, best of three each. One
JSON line per measurement; the memory lines are side by side in one run, and a summary line gives the
growth between the smallest and largest set.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from supernode.core.config import load_stack
from supernode.core.files import sha256_file
from supernode.core.plan import Plan, build_plan
from supernode.trainer.data.manifest import read_manifest, scan_shard
from supernode.trainer.data.prepare import write_synthetic

VOCAB = 32768


def synthetic(out: Path, gb: float, shard_tokens: int = 1 << 27) -> Path:
    """A dataset of `gb` GB of uint16 ids, kept between runs (`--dir`)."""
    if (out / "manifest.json").is_file():
        return out
    return write_synthetic(out, int(gb * 1e9) // 2, VOCAB, shard_tokens=shard_tokens)


def _status() -> dict:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0])
    return fields


def measure(data: str, plan_path: str, steps: int) -> dict:
    """In a fresh process: resident memory after the loader's start-up and `steps` steps, and its rate."""
    from supernode.trainer.data.loader import TokenLoader

    plan = Plan.read(plan_path)
    t, dp = plan.training, plan.degrees.dp_replicate * plan.degrees.dp_shard
    before = _status()
    loader = TokenLoader(data, plan.model.seq_len, t.global_batch, t.micro_batch, 0, dp, t.seed, vocab=plan.model.vocab)
    t0 = time.perf_counter()
    for _ in range(steps):
        loader.next_step()
    seconds = time.perf_counter() - t0
    after = _status()
    per_rank_tokens = t.global_batch // dp * plan.model.seq_len
    return {"kb": {k: after[k] - before[k] for k in after}, "tokens_per_s": per_rank_tokens * steps / seconds}


def _child(data: Path, plan: Plan, steps: int, scratch: Path) -> dict:
    plan_path = scratch / f"plan-{plan.stack}.json"
    plan_path.write_text(plan.to_json())
    r = subprocess.run(
        [sys.executable, "-m", "supernode.bench.data", "--measure", str(data), str(plan_path), str(steps)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(r.stdout)


def verify_cost(data: Path, repeats: int = 3) -> dict:
    """Seconds to read every shard for its sha256 alone, and for its sha256 and largest id (what
    `data verify` does), alternated so both see the same page cache and machine noise."""
    m = read_manifest(data)
    shards = [data / s["file"] for s in m["shards"]]
    size = sum(f.stat().st_size for f in shards)
    best = {"sha256": float("inf"), "sha256_and_max_id": float("inf")}
    for _ in range(repeats):
        for kind in best:
            t0 = time.perf_counter()
            for f in shards:
                sha256_file(f) if kind == "sha256" else scan_shard(f, m["dtype"])
            best[kind] = min(best[kind], time.perf_counter() - t0)
    return {
        "bench": "data",
        "measure": "verify",
        "dataset_gb": round(size / 1e9, 2),
        **{f"{k}_gb_per_s": round(size / 1e9 / v, 2) for k, v in best.items()},
        "max_id_cost_ratio": round(best["sha256_and_max_id"] / best["sha256"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supernode.bench.data", description=__doc__.split("\n")[0])
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[0.5, 2.0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dir", type=Path, default=None, help="keep the synthetic datasets here (default: temporary)")
    p.add_argument("--root", type=Path, default=Path("."), help="directory holding Pulumi.<stack>.yaml (default: .)")
    p.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)  # the child process
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], int(args.measure[2]))))
        return 0
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        plans = {s: build_plan(s, load_stack(s, args.root)) for s in ("dev", "prod")}
        sets = {gb: synthetic(scratch / f"{gb:g}gb", gb) for gb in args.sizes_gb}
        for stack, plan in plans.items():
            t, dp = plan.training, plan.degrees.dp
            need = t.global_batch * plan.model.seq_len / dp / plan.step.step_s
            got = _child(sets[args.sizes_gb[0]], plan, args.steps, scratch)["tokens_per_s"]
            print(
                json.dumps(
                    {
                        "bench": "data",
                        "measure": "throughput",
                        "stack": stack,
                        "seq_len": plan.model.seq_len,
                        "per_rank_batch": t.global_batch // dp,
                        "loader_tokens_per_s": round(got),
                        "needed_tokens_per_s": round(need),
                        "headroom_x": round(got / need, 1),
                    }
                ),
                flush=True,
            )
        memory = {}
        for gb, data in sets.items():
            memory[gb] = _child(data, plans["prod"], args.steps, scratch)["kb"]
            print(
                json.dumps(
                    {
                        "bench": "data",
                        "measure": "resident_memory",
                        "dataset_gb": gb,
                        "steps": args.steps,
                        **{f"{k}_kb": v for k, v in memory[gb].items()},
                    }
                ),
                flush=True,
            )
        print(json.dumps(verify_cost(sets[max(sets)])), flush=True)
        lo, hi = memory[min(memory)], memory[max(memory)]
        print(
            json.dumps(
                {
                    "bench": "data",
                    "measure": "memory_growth",
                    "datasets_gb": [min(memory), max(memory)],
                    "anon_growth_kb": hi["RssAnon"] - lo["RssAnon"],
                    "rss_growth_kb": hi["VmRSS"] - lo["VmRSS"],
                    "goal": "a few MB at most",
                }
            ),
            flush=True,
        )
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
