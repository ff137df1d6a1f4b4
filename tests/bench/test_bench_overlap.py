"""`supernode bench overlap`: EP all-to-all overlap on vs off, paired, on CPU gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from supernode.bench import overlap


@pytest.mark.slow
def test_bench_overlap_pairs_both_paths_at_each_ep(capsys) -> None:
    argv = ["--ep", "2", "4", "--tokens", "64", "--dim", "32", "--hidden", "16", "--chunks", "3", "--repeat", "3"]
    assert overlap.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["ep"] for line in lines] == [2, 4]
    for line in lines:
        assert line["measurement"] == "all_to_all_overlap" and line["chunks"] == 3
        assert line["same_outputs"] is True  # the chunked forward computes the unchunked one, bit for bit
        assert line["step_s_off"] > 0 and line["step_s_on"] > 0
        q1, median, q3 = line["ratio_quartiles"]
        assert q1 <= line["ratio_on_vs_off"] == median <= q3
        for mode in ("off", "on"):  # blocked time is part of the step
            assert 0 < line[f"exposed_comm_fraction_{mode}"] < 1


def test_blocked_time_counts_synchronous_calls_and_waits(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        clock = overlap._BlockedTime()
        x, out = torch.arange(4.0), torch.empty(4)
        assert clock(out, x) is None and clock.seconds > 0  # synchronous: no handle
        before = clock.seconds
        work = clock(out, x, async_op=True)
        assert clock.seconds > before
        before = clock.seconds
        assert work.wait() and clock.seconds > before and torch.equal(out, x)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--chunks", "0"], "--chunks must be >= 1 (got 0)"),
        (["--ep", "3"], "--ep 3 must be >= 2 and divide --experts (8)"),
        (["--topk", "9"], "--topk must be at most --experts (8) (got 9)"),
    ],
)
def test_bench_overlap_bad_flags_exit_2_with_one_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        overlap.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
