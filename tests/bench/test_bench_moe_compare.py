"""`supernode bench moe --compare torchtitan`: a clear exit 2 without torchtitan; with it (outside the
project: $SUPERNODE_TORCHTITAN_PATH, see supernode/bench/moe.py), the same function and a measured ratio."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

import pytest

from supernode.bench import moe as bench_moe

TT_MODULES = ("torchtitan", "torchtitan.models", "torchtitan.models.common", "torchtitan.models.common.moe")
TINY = [
    "--tokens",
    "64",
    "--dim",
    "32",
    "--hidden",
    "64",
    "--experts",
    "4",
    "--topk",
    "2",
    "--threads",
    "1",
    "--repeat",
    "1",
]


@pytest.fixture(autouse=True)
def native_bf16(monkeypatch):
    """These tests are about flags and torchtitan, not the CPU: they must hold on an AVX2-only runner too
    (where --compare's bf16 is refused first); the refusal tests below set it False."""
    monkeypatch.setattr(bench_moe, "cpu_has_native_bf16", lambda: True)


def test_without_torchtitan_exit_2_says_how_to_install(capsys, monkeypatch) -> None:
    monkeypatch.delenv("SUPERNODE_TORCHTITAN_PATH", raising=False)
    with mock.patch.dict(sys.modules, {name: None for name in TT_MODULES}):  # import fails as if absent
        assert bench_moe.main(["--compare", "torchtitan", *TINY]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "torchtitan's MoE is not importable" in err and "pip install --target DIR --no-deps torchtitan==0.3.0" in err


def test_a_missing_torchtitan_path_is_exit_2(capsys, tmp_path) -> None:
    assert bench_moe.main(["--compare", "torchtitan", "--torchtitan-path", str(tmp_path / "nope"), *TINY]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_compare_refuses_float32(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(["--compare", "torchtitan", "--dtype", "float32", *TINY])
    assert exc.value.code == 2
    assert "needs --dtype bfloat16" in capsys.readouterr().err


def test_compare_refuses_rows_grouped_mm_cannot_take(capsys) -> None:
    # Refused before torchtitan is even imported: its experts would fail inside torch._grouped_mm.
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(["--compare", "torchtitan", *TINY, "--dim", "6", "--hidden", "20"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "needs --dim to be a multiple of 8 (got 6)" in err and "needs --hidden to be a multiple of 8 (got 20)" in err


def _torchtitan():
    try:
        return bench_moe.import_torchtitan(os.environ.get("SUPERNODE_TORCHTITAN_PATH"))
    except ImportError:
        pytest.skip("torchtitan not importable (set SUPERNODE_TORCHTITAN_PATH; see supernode/bench/moe.py)")


@pytest.mark.parametrize("extra", [[], ["--shared", "1", "--score", "sigmoid"]])
def test_side_by_side_is_the_same_function(capsys, extra) -> None:
    _torchtitan()
    # The second phase changes the C allocator for good: not in the test process.
    with mock.patch.object(bench_moe, "_keep_freed_memory", return_value=True):
        assert bench_moe.main(["--compare", "torchtitan", *TINY, *extra]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["measurement"] == "moe_layer_vs_torchtitan" and line["torchtitan_version"] == "0.3.0"
    assert line["same_function"] is True and line["routing_agreement"] >= 0.99
    assert line["other_routing_all_bf16_near_ties"] is True
    assert line["ours_tokens_per_s"] > 0 and line["torchtitan_tokens_per_s"] > 0 and line["speedup_vs_torchtitan"] > 0
    low, high = line["paired_speedup_quartiles"]
    assert 0 < low <= line["paired_speedup_median"] <= high
    kept = line["freed_memory_kept"]
    assert (
        0 < kept["paired_speedup_quartiles"][0] <= kept["paired_speedup_median"] <= kept["paired_speedup_quartiles"][1]
    )
    for faults in (line["minor_page_faults_per_step"], kept["minor_page_faults_per_step"]):
        assert set(faults) == {"ours", "torchtitan"} and min(faults.values()) >= 0


def test_keeping_freed_memory_stops_the_page_faults_of_reallocation() -> None:
    # In a child: it changes the process's allocator for good.
    code = """
import resource, torch
from supernode.bench.moe import _keep_freed_memory
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.empty(4 << 20).fill_(1)  # 16 MiB, freed at once
        torch.empty(2 << 20).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
default = faults()
assert _keep_freed_memory()
faults()  # the first round maps what is then kept
print(default, faults())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    default, kept = map(int, out.split())
    assert default > 5000 and kept < default / 20, (default, kept)  # a fault per 4 KiB: 6144 for 24 MiB


def test_different_weights_void_the_comparison(capsys) -> None:
    _torchtitan()
    real = bench_moe.build_torchtitan

    def one_expert_differs(tt, ours, args):
        layer = real(tt, ours, args)
        with __import__("torch").no_grad():
            layer.routed_experts.inner_experts.w2_EDF[0].mul_(2)
        return layer

    with mock.patch.object(bench_moe, "build_torchtitan", one_expert_differs):
        assert bench_moe.main(["--compare", "torchtitan", *TINY]) == 1
    assert json.loads(capsys.readouterr().out)["same_function"] is False


AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
NATIVE = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16\n"


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    from supernode.trainer.device import cpu_has_native_bf16

    assert not cpu_has_native_bf16(AVX2_ONLY)
    assert cpu_has_native_bf16(NATIVE)
    assert cpu_has_native_bf16("processor : 0\nfeatures : fp asimd bf16\n")  # no x86 flags line: not judged


def test_bf16_on_a_cpu_without_native_bf16_is_refused_in_one_line_before_it_runs(capsys, monkeypatch) -> None:
    """It used to print nothing for over ten minutes (issue 41 item 7)."""
    monkeypatch.setattr(bench_moe, "cpu_has_native_bf16", lambda: False)
    assert bench_moe.main([*TINY, "--dtype", "bfloat16", "--ep"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1  # one line, no usage dump
    assert "no native bf16" in err and "use --dtype float32" in err
    assert bench_moe.main([*TINY, "--dtype", "float32", "--ep"]) == 0  # fp32 is not refused
    assert json.loads(capsys.readouterr().out.splitlines()[0])["dtype"] == "float32"


def test_bf16_refusal_with_compare_offers_what_compare_accepts(capsys, monkeypatch) -> None:
    """--compare refuses float32, so the advice there is only the override; and the refusal comes
    through the CLI as exit 2 (supernode bench moe), before torchtitan is imported."""
    from supernode.cli import main as cli_main

    monkeypatch.setattr(bench_moe, "cpu_has_native_bf16", lambda: False)
    with mock.patch.dict(sys.modules, {name: None for name in TT_MODULES}):  # torchtitan would fail to import
        assert cli_main(["bench", "moe", "--compare", "torchtitan", *TINY]) == 2
    err = capsys.readouterr().err
    assert "no native bf16" in err and "use --allow-emulated-bf16" in err and "float32" not in err
