"""`bench data` and `bench checkpoint` run as a user runs them, from a project directory (`--root`
defaults to `.`): both once looked for the stack files inside the package and exited 2, and the
checkpoint bench's hash part passed a keyword the Checkpointer no longer takes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench(module: str, *flags: str) -> list[dict]:
    r = subprocess.run(
        [sys.executable, "-m", f"supernode.bench.{module}", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_bench_data_projects_the_loader_onto_the_stacks():
    lines = bench("data", "--sizes-gb", "0.01", "--steps", "5")
    throughput = {x["stack"]: x for x in lines if x["measure"] == "throughput"}
    assert set(throughput) == {"dev", "prod"} and all(x["headroom_x"] > 0 for x in throughput.values())


@pytest.mark.slow
def test_bench_checkpoint_hash_part_splits_the_checksum_over_ranks():
    lines = bench("checkpoint", "--part", "hash", "--ranks", "2", "--dim", "64", "--layers", "2", "--experts", "4")
    split = next(x for x in lines if x["measure"] == "hash_split")
    assert split["ranks"] == 2 and len(split["rank_mb"]) == 2 and sum(split["rank_mb"]) > 0
    projection = next(x for x in lines if x["measure"] == "projection")
    assert projection["stack"] == "prod" and projection["ranks"] == 128
