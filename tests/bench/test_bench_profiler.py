"""`supernode bench profiler`: a trainer step under torch.profiler vs the same step without, paired."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supernode.bench import profiler
from supernode.core.observability import PROFILE_EVERY

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_profiler_pairs_profiled_and_plain_steps(capsys) -> None:
    assert profiler.main(["--stack", "dev", "--root", str(ROOT), "--reps", "2"]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert line["measurement"] == "profiler_overhead" and line["world_size"] == 2 and line["reps"] == 2
    assert line["step_s_plain"] > 0 and line["step_s_profiled"] > 0
    ratio = line["ratio_profiled_vs_not"]
    assert ratio > 1  # tracing every op costs the step something; the note has the measured figure
    assert line["run_overhead_at_profile_every"] == {"1": ratio - 1, str(PROFILE_EVERY): (ratio - 1) / PROFILE_EVERY}


def test_bench_profiler_refuses_no_repetitions(capsys) -> None:
    assert profiler.main(["--stack", "dev", "--root", str(ROOT), "--reps", "0"]) == 2
    assert "--reps must be at least 1 (got 0)" in capsys.readouterr().err
