"""The fabric check measures real gloo collectives and gates on bus bandwidth."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer import fabric


def torchrun_fabric(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "trainer.fabric", "--sizes", "64K,1M", "--iters", "2", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_passes_and_fails_against_the_threshold():
    ok = torchrun_fabric("--min-busbw-gbps", "0.0001")
    assert ok.returncode == 0, ok.stderr
    lines = [json.loads(line) for line in ok.stdout.splitlines() if line.startswith("{")]
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

    too_high = torchrun_fabric("--min-busbw-gbps", "100000")
    assert too_high.returncode != 0
    assert '"passed": false' in too_high.stdout


@pytest.mark.parametrize("sizes", ["12Q", "2", "-1M"])
def test_bad_sizes_exit_2(sizes, capsys):
    assert fabric.main(["--min-busbw-gbps", "1", "--sizes", sizes]) == 2
    assert "--sizes" in capsys.readouterr().err


def test_sizes_parse_with_units():
    assert fabric.parse_sizes("4096,64K,16M,1G") == [4096, 65536, 16 << 20, 1 << 30]
