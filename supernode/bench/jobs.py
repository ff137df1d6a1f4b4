"""The local job queue (supernode.tools.jobs_local): how fast a job is admitted, how `job list` scales.

    python -m supernode.bench.jobs [--jobs 10,1000] [--repeats 5] [--stack dev]

"admission": submit -> the store says `running` (the runner has started the job's process), for a
runner that the submit starts ("cold": a Python start and the store) and one already running
("warm": its 0.2 s tick); each job is cancelled as soon as it is admitted (nothing trains).
"list": `LocalBackend.list()` over a store of N jobs (queued, running, succeeded alike), in-process
time (median of --repeats) and peak Python memory (tracemalloc), side by side with the smallest N,
and the ratios; the CLI's `supernode job list --local --json` wall time for each N too.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from supernode.core.config import load_stack
from supernode.core.jobs import job_from_mapping
from supernode.tools.jobs_local import LocalBackend, local_job_plan

ROOT = Path(__file__).resolve().parents[2]


def _job(name: str):
    return job_from_mapping({"name": name, "team": "bench", "priority": "low", "training": {"steps": 20}})


def admission(stack: str, work: Path) -> list[dict]:
    cfg = load_stack(stack, ROOT)
    backend = LocalBackend(work / "admission")
    out = []
    for kind in ("cold", "warm"):
        spec = _job(f"admit-{kind}")
        plan = local_job_plan(stack, cfg, spec)
        t0 = time.perf_counter()
        backend.submit(spec, plan, Path("bench"), ["--stack", stack, "--root", str(ROOT)])
        while backend.describe(spec.name).state == "queued":
            time.sleep(0.005)
        latency = time.perf_counter() - t0
        backend.cancel(spec.name)
        while backend.describe(spec.name).state != "cancelled":
            time.sleep(0.05)
        out.append({"bench": "jobs", "measure": "submit_to_admitted_s", "runner": kind, "seconds": round(latency, 3)})
    return out


def _store(home: Path, n: int, plan, stack: str) -> LocalBackend:
    backend = LocalBackend(home, start_runner=False)
    for i in range(n):
        backend.submit(_job(f"job-{i:05d}"), plan, Path("bench"), ["--stack", stack])
    with sqlite3.connect(home / "jobs.db") as con:  # a realistic mix: mostly ended, a few queued, one running
        con.execute(
            "UPDATE jobs SET state = 'succeeded', step = 20, loss = 2.5, last_checkpoint = 20 WHERE seq % 10 != 0"
        )
        con.execute("UPDATE jobs SET state = 'running' WHERE seq = 10")
    return backend


def listing(stack: str, sizes: list[int], repeats: int, work: Path) -> list[dict]:
    cfg = load_stack(stack, ROOT)
    plan = local_job_plan(stack, cfg, _job("plan"))
    rows = []
    for n in sizes:
        backend = _store(work / f"list-{n}", n, plan, stack)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            statuses = backend.list()
            times.append(time.perf_counter() - t0)
        assert len(statuses) == n
        tracemalloc.start()
        backend.list()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "supernode", "job", "list", "--local", "--json", "--home", str(backend.home)],
            check=True,
            capture_output=True,
        )
        cli_s = time.perf_counter() - t0
        rows.append({"n": n, "list_s": statistics.median(times), "peak_bytes": peak, "cli_s": cli_s})
    base = rows[0]
    return [
        {
            "bench": "jobs",
            "measure": "list",
            "jobs": r["n"],
            "list_ms": round(r["list_s"] * 1e3, 2),
            "peak_mib": round(r["peak_bytes"] / 2**20, 2),
            "cli_s": round(r["cli_s"], 2),
            "time_ratio": round(r["list_s"] / base["list_s"], 1),
            "memory_ratio": round(r["peak_bytes"] / base["peak_bytes"], 1),
            "jobs_ratio": r["n"] // base["n"],
        }
        for r in rows
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="supernode bench jobs", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="10,1000", help="store sizes for the list measurement (comma-separated)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stack", default="dev")
    args = p.parse_args(argv)
    sizes = sorted(int(x) for x in args.jobs.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-jobs-") as tmp:
        for line in admission(args.stack, Path(tmp)) + listing(args.stack, sizes, args.repeats, Path(tmp)):
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
