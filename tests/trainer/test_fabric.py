"""The fabric check measures real gloo collectives and gates on bus bandwidth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from supernode.core.config import load_stack
from supernode.core.plan import Plan, build_plan
from trainer import fabric

ROOT = Path(__file__).resolve().parents[2]


def torchrun_fabric(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "trainer.fabric", "--sizes", "64K,1M", "--iters", "2", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def json_lines(proc: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def write_plan(path: Path, **changes) -> Plan:
    plan = build_plan("dev", load_stack("dev", ROOT)).model_copy(update=changes)
    path.write_text(plan.to_json(), encoding="utf-8")
    return plan


@pytest.mark.slow
def test_passes_and_fails_against_the_threshold():
    ok = torchrun_fabric("--min-busbw-gbytes-s", "0.0001")
    assert ok.returncode == 0, ok.stderr
    lines = json_lines(ok)
    points = [p for p in lines if "op" in p]
    assert [(p["op"], p["bytes"]) for p in points] == [
        ("all_reduce", 65536), ("all_reduce", 1 << 20), ("all_to_all", 65536), ("all_to_all", 1 << 20)]
    for p in points:
        algbw = p["bytes"] / (p["time_us"] * 1e-6) / 1e9
        factor = 1.0 if p["op"] == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n at n = 2
        assert p["world_size"] == 2 and p["busbw_gb_s"] == pytest.approx(algbw * factor, rel=0.01)
    gate = lines[-1]
    assert gate["passed"] is True
    assert gate["best_busbw_gb_s"] == max(p["busbw_gb_s"] for p in points if p["op"] == "all_reduce")

    too_high = torchrun_fabric("--min-busbw-gbytes-s", "100000")
    assert too_high.returncode != 0
    assert '"passed": false' in too_high.stdout


@pytest.mark.slow
def test_plan_gives_the_floor(tmp_path: Path):
    """As the gate Job runs it: the floor is the plan's gate_floor_gbytes_s (the dev stack's p5 floor,
    far above what gloo on CPU reaches), not a number on the command line."""
    plan = write_plan(tmp_path / "plan.json")
    assert plan.gate_floor_gbytes_s
    run = torchrun_fabric("--plan", str(tmp_path / "plan.json"))
    assert run.returncode == 1, run.stderr
    gate = json_lines(run)[-1]
    assert gate["min_busbw_gb_s"] == plan.gate_floor_gbytes_s and gate["passed"] is False


def test_plan_floor_is_read_from_the_file(tmp_path: Path):
    path = tmp_path / "plan.json"
    write_plan(path, gate_floor_gbytes_s=123.5)
    assert fabric.plan_floor(str(path)) == 123.5


def test_plan_without_a_floor_exits_2(tmp_path: Path, capsys):
    path = tmp_path / "plan.json"
    write_plan(path, gate_floor_gbytes_s=None)
    assert fabric.main(["--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "gate_floor_gbytes_s" in err and "--min-busbw-gbytes-s" in err and "Traceback" not in err


@pytest.mark.parametrize("content", [None, "not json", "{}"])
def test_unreadable_or_invalid_plan_exits_2(tmp_path: Path, capsys, content):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    assert fabric.main(["--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--plan {path}" in err and "Traceback" not in err


@pytest.mark.parametrize("flags", [[], ["--plan", "p.json", "--min-busbw-gbytes-s", "1"]])
def test_exactly_one_floor_is_required(flags, capsys):
    assert fabric.main(flags) == 2
    assert "--min-busbw-gbytes-s" in capsys.readouterr().err


@pytest.mark.parametrize("sizes", ["12Q", "2", "-1M"])
def test_bad_sizes_exit_2(sizes, capsys):
    assert fabric.main(["--min-busbw-gbytes-s", "1", "--sizes", sizes]) == 2
    assert "--sizes" in capsys.readouterr().err


def test_sizes_parse_with_units():
    assert fabric.parse_sizes("4096,64K,16M,1G") == [4096, 65536, 16 << 20, 1 << 30]
