"""The fabric check measures real gloo collectives and gates on bus bandwidth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supernode.core.config import load_stack
from supernode.core.plan import Plan, build_plan
from supernode.trainer.node import fabric

ROOT = Path(__file__).resolve().parents[2]


def torchrun_fabric(*flags: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "supernode.trainer.node.fabric",
        "--sizes",
        "64K,1M",
        "--iters",
        "2",
        *flags,
    ]
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
        ("all_reduce", 65536),
        ("all_reduce", 1 << 20),
        ("all_to_all", 65536),
        ("all_to_all", 1 << 20),
    ]
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


def test_outside_torchrun_exits_2_with_one_line(tmp_path: Path):
    """Issue 30 #11: run by hand, without torchrun, it ended in init_process_group's traceback (exit 1)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "supernode.trainer.node.fabric", "--min-busbw-gbytes-s", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "error: supernode.trainer.node.fabric runs under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set): "
        "torchrun --nproc-per-node N -m supernode.trainer.node.fabric ..."
    ]


def test_sizes_parse_with_units():
    assert fabric.parse_sizes("4096,64K,16M,1G") == [4096, 65536, 16 << 20, 1 << 30]


# -- the node-pair matrix -------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 18))
def test_pair_rounds_cover_every_pair_exactly_once_in_o_n_rounds(n):
    rounds = fabric.pair_rounds(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]  # each pair once
    for r in rounds:  # a node is in at most one pair per round: the pairs of a round run at once
        busy = [u for p in r for u in p]
        assert len(busy) == len(set(busy))
    assert len(rounds) == (0 if n == 1 else n - 1 if n % 2 == 0 else n)


def pair(a: str, b: str, gb_s: float, latency_us: float = 50.0) -> dict:
    return {"pair": [a, b], "gb_s": gb_s, "latency_us": latency_us}


def test_a_node_with_most_pairs_slow_is_named_a_bad_link_names_none():
    healthy = [pair(a, b, 100.0) for a, b in [("n0", "n1"), ("n0", "n3"), ("n1", "n3")]]
    slow_node = [pair(a, "n2", 40.0) for a in ("n0", "n1")] + [pair("n2", "n3", 100.0, latency_us=400.0)]
    found = fabric.compare(healthy + slow_node, threshold=0.2)
    assert found["reference"] == "typical-node" and found["suspect_nodes"] == ["n2"]
    assert found["fabric_regressed_node_count"] == 1 and len(found["regressed_pairs"]) == 3
    one_link = healthy + [pair("n0", "n2", 40.0), pair("n1", "n2", 100.0), pair("n2", "n3", 100.0)]
    found = fabric.compare(one_link, threshold=0.2)
    assert [p["pair"] for p in found["regressed_pairs"]] == [["n0", "n2"]] and found["suspect_nodes"] == []


def test_baseline_compare_matches_pairs_by_node_names_not_order():
    baseline = [pair("a", "b", 100.0), pair("a", "c", 100.0), pair("b", "c", 100.0)]
    now = [pair("b", "a", 95.0), pair("c", "a", 70.0), pair("c", "b", 70.0), pair("a", "d", 100.0)]
    found = fabric.compare(now, threshold=0.2, baseline=baseline)
    assert found["reference"] == "baseline" and found["suspect_nodes"] == ["c"]
    assert found["compared_pairs"] == 4 and found["unbaselined_pairs"] == 0  # node d is new: held to the fleet
    assert found["new_nodes"] == ["d"]
    assert found["regressed_pairs"][0]["reference_gb_s"] == 100.0
    # Within the threshold is no finding; two nodes alone cannot be told apart: both are named.
    assert fabric.compare(now[:1], threshold=0.2, baseline=baseline)["suspect_nodes"] == []
    assert fabric.compare([pair("a", "b", 10.0)], 0.2, baseline)["suspect_nodes"] == ["a", "b"]


def test_a_node_absent_from_the_baseline_is_held_to_the_baselines_fleet_figures():
    """A replaced node (d for c) has no baseline pairs: its pairs are compared with the baseline's
    typical node (the median of medians: 100 GB/s, 50 us here; one slow old pair cannot move it)."""
    old = [
        pair("a", "b", 100.0),
        pair("a", "c", 100.0),
        pair("b", "c", 100.0),
        pair("a", "e", 100.0),
        pair("b", "e", 100.0),
        pair("c", "e", 30.0),
    ]
    base = {"pairs": old, "nodes": [{"node": n} for n in "abce"]}
    healthy = [
        pair("a", "b", 98.0),
        pair("a", "e", 99.0),
        pair("b", "e", 97.0),
        pair("a", "d", 90.0),
        pair("b", "d", 85.0),
        pair("d", "e", 95.0),
    ]
    found = fabric.compare(healthy, 0.2, old)
    assert found["new_nodes"] == ["d"] and found["suspect_nodes"] == [] and found["compared_pairs"] == 6
    matrix = {"pairs": healthy, "nodes": [{"node": n, "instance_id": f"i-{n}"} for n in "abde"]}
    grown = fabric.extend_baseline(base, matrix, found, when=1234.5)
    assert grown["pairs"][: len(old)] == old  # the old nodes' pairs (the departed c's too) kept as recorded
    assert {tuple(p["pair"]) for p in grown["pairs"][len(old) :]} == {("a", "d"), ("b", "d"), ("d", "e")}
    assert grown["nodes"][-1] == {"node": "d", "instance_id": "i-d"} and len(grown["nodes"]) == 5
    assert grown["rebaselined"] == [{"time": 1234.5, "nodes": ["d"], "pairs": 3}]
    # Next time d is known: its pairs have their own baseline figures.
    assert fabric.compare(healthy, 0.2, grown["pairs"])["new_nodes"] == []

    # The same new node, slow (60-70 GB/s against the fleet's 100): named, and not added.
    slow = healthy[:3] + [pair("a", "d", 60.0), pair("b", "d", 65.0), pair("d", "e", 70.0, latency_us=400.0)]
    found = fabric.compare(slow, 0.2, old)
    assert found["suspect_nodes"] == ["d"] and found["fabric_regressed_node_count"] == 1
    assert {p["reference_gb_s"] for p in found["regressed_pairs"]} == {100.0}
    assert fabric.extend_baseline(base, {**matrix, "pairs": slow}, found, when=1.0) is None
    # A healthy new node keeps out its pair with a bad old node (that pair stays held to the fleet).
    with_bad_e = healthy[:3] + [pair("a", "d", 95.0), pair("b", "d", 96.0), pair("d", "e", 20.0)]
    found = fabric.compare(with_bad_e, 0.2, old)
    grown = fabric.extend_baseline(base, {**matrix, "pairs": with_bad_e}, found, when=2.0)
    assert found["suspect_nodes"] == [] and {tuple(p["pair"]) for p in grown["pairs"][len(old) :]} == {
        ("a", "d"),
        ("b", "d"),
    }


def test_an_empty_baseline_judges_no_pair():
    found = fabric.compare([pair("a", "b", 1.0)], 0.2, [])
    assert found["compared_pairs"] == 0 and found["unbaselined_pairs"] == 1 and found["suspect_nodes"] == []


@pytest.mark.parametrize("content", ["not json", '{"pairs": [{"gb_s": 1}]}', "[]"])
def test_unreadable_baseline_exits_2_before_any_collective(tmp_path: Path, capsys, content):
    path = tmp_path / "baseline.json"
    path.write_text(content, encoding="utf-8")
    assert fabric.main(["--min-busbw-gbytes-s", "1", "--baseline", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--baseline {path}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags", [["--regression", "1.5"], ["--ranks-per-node", "3"], ["--verdict-configmap", "fabric-verdict"]]
)
def test_bad_matrix_flags_exit_2(flags, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert fabric.main(["--min-busbw-gbytes-s", "1", *flags]) == 2
    assert flags[0] in capsys.readouterr().err


@pytest.mark.slow
def test_four_rank_pair_matrix_names_the_injected_slow_rank_and_records_the_baseline(tmp_path: Path):
    """The issue's acceptance run: 4 CPU ranks, each its own "node"; rank 2 waits before every send
    (SUPERNODE_INJECT_FAULT=slow-rank@2). A 20x regression threshold keeps a shared CI host's noise
    out of the finding; the injected fault is ~50x."""
    baseline, report = tmp_path / "fabric" / "baseline.json", tmp_path / "last.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "supernode.trainer.node.fabric",
        "--min-busbw-gbytes-s",
        "0.0001",
        "--sizes",
        "64K",
        "--warmup",
        "1",
        "--iters",
        "3",
        "--ranks-per-node",
        "1",
        "--pair-bytes",
        "4M",
        "--regression",
        "0.95",
        "--baseline",
        str(baseline),
        "--report",
        str(report),
    ]
    env = {**os.environ, "SUPERNODE_INJECT_FAULT": "slow-rank@2", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 1, run.stderr[-2000:]  # a named node fails the check
    lines = json_lines(run)
    matrix = [p for p in lines if "pair" in p and "round" in p]
    assert len(matrix) == 6 and len({p["round"] for p in matrix}) == 3  # 6 pairs in 3 rounds
    check = next(p for p in lines if p.get("fabric_check") == "pairs")
    assert len(check["suspect_nodes"]) == 1 and check["suspect_nodes"][0].endswith("#2")
    assert check["fabric_regressed_node_count"] == 1
    assert {tuple(p["pair"]) for p in check["regressed_pairs"]} == {
        p for p in (tuple(m["pair"]) for m in matrix) if p[0].endswith("#2") or p[1].endswith("#2")
    }
    assert any(p.get("latency") == "all_reduce" and p["time_us"] > 0 for p in lines)
    assert lines[-1]["gate"] == "all_reduce_busbw" and lines[-1]["passed"] is False
    saved = json.loads(baseline.read_text(encoding="utf-8"))
    assert saved == json.loads(report.read_text(encoding="utf-8"))  # the first run is the baseline
    assert [n["node"] for n in saved["nodes"]] == sorted({n for p in matrix for n in p["pair"]}, key=lambda n: n[-1])
    assert {"instance_id", "gpus", "efa"} <= set(saved["nodes"][0]) and len(saved["pairs"]) == 6


def four_rank_pairs(*flags: str, fault: str = "", regression: str = "0.95") -> subprocess.CompletedProcess:
    """4 CPU ranks, each its own "node" (names end in #0..#3); a 20x regression threshold keeps a
    shared CI host's noise out of the finding (an injected slow rank is ~50x)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "supernode.trainer.node.fabric",
        "--min-busbw-gbytes-s",
        "0.0001",
        "--sizes",
        "64K",
        "--warmup",
        "1",
        "--iters",
        "3",
        "--ranks-per-node",
        "1",
        "--pair-bytes",
        "4M",
        "--regression",
        regression,
        *flags,
    ]
    env = {**os.environ, "SUPERNODE_INJECT_FAULT": fault, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def failure(run: subprocess.CompletedProcess) -> str:
    """What a failed run said: rank 0's verdict lines (stdout) first, then the end of stderr."""
    return "\n".join(run.stdout.splitlines()[-4:]) + "\n" + run.stderr[-1500:]


@pytest.mark.slow
def test_a_replaced_node_is_judged_against_the_fleet_then_added_to_the_baseline(tmp_path: Path):
    """The baseline was recorded before node #3 replaced a failed node: it has the failed node's
    pairs, none of #3's. Slow, #3 is named and the baseline is left alone; healthy, its pairs join it."""
    recorded = tmp_path / "recorded.json"
    # The recording run has no baseline, so it is judged against its own typical node, latency
    # included: on a loaded 2-core CI host one node's gloo latency went past 20x of that once (CI,
    # stop 32). Recording is not what this test checks, so it runs at 100x.
    first = four_rank_pairs("--baseline", str(recorded), regression="0.99")
    assert first.returncode == 0, failure(first)
    doc = json.loads(recorded.read_text(encoding="utf-8"))
    new = next(n["node"] for n in doc["nodes"] if n["node"].endswith("#3"))

    def renamed(name: str) -> str:
        return "failed-node" if name == new else name

    # On this shared host a gloo pair's latency varies >10x between runs (143-1,775 us in one healthy
    # run, measured), so an old pair could pass the 20x threshold by load alone: the recorded
    # latencies are made 10x more lenient (200x). Bandwidth is steadier (0.6-1.1 GB/s) and the
    # injected slow rank is 50-60x off in it (0.016 GB/s), so the new node is still found.
    doc["pairs"] = [
        {**p, "pair": [renamed(n) for n in p["pair"]], "latency_us": p["latency_us"] * 10} for p in doc["pairs"]
    ]
    doc["nodes"] = [{**n, "node": renamed(n["node"])} for n in doc["nodes"]]
    before = json.dumps(doc, indent=1, sort_keys=True) + "\n"

    baseline = tmp_path / "baseline.json"
    baseline.write_text(before, encoding="utf-8")
    slow = four_rank_pairs("--baseline", str(baseline), fault="slow-rank@3")
    assert slow.returncode == 1, failure(slow)
    check = next(p for p in json_lines(slow) if p.get("fabric_check") == "pairs")
    assert check["new_nodes"] == [new] and check["suspect_nodes"] == [new] and check["compared_pairs"] == 6
    assert {p["reference_gb_s"] for p in check["regressed_pairs"] if new in p["pair"]} == {
        fabric.typical(doc["pairs"])["gb_s"]
    }
    assert baseline.read_text(encoding="utf-8") == before  # a regressed node is not baselined

    healthy = four_rank_pairs("--baseline", str(baseline))
    assert healthy.returncode == 0, failure(healthy)
    lines = json_lines(healthy)
    check = next(p for p in lines if p.get("fabric_check") == "pairs")
    assert check["new_nodes"] == [new] and check["suspect_nodes"] == []
    said = next(p for p in lines if p.get("fabric_baseline") == "extended")
    assert said["nodes"] == [new] and said["pairs"] == 3
    grown = json.loads(baseline.read_text(encoding="utf-8"))
    assert grown["pairs"][:6] == doc["pairs"]  # the old nodes' pairs kept as recorded
    assert sorted(new in p["pair"] for p in grown["pairs"]) == [False] * 6 + [True] * 3
    assert [n["node"] for n in grown["nodes"]][-1] == new and len(grown["nodes"]) == 5
    assert grown["rebaselined"][0]["nodes"] == [new] and grown["rebaselined"][0]["time"] > doc["time"]
    assert not (tmp_path / "baseline.json.tmp").exists()  # written through a temporary file, renamed


@pytest.mark.slow
def test_a_verdict_that_cannot_be_recorded_fails_the_check(tmp_path: Path):
    """Outside a pod there is no API to record the verdict in: the check says so once and fails (the
    nodes' agents would otherwise act on an old verdict); the report is still written."""
    report = tmp_path / "last.json"
    run = four_rank_pairs("--report", str(report), "--verdict-configmap", "supernode-node-health/fabric-verdict")
    assert run.returncode == 1, failure(run)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: verdict not recorded in supernode-node-health/fabric-verdict: "
        "the Kubernetes API is reached from a pod: KUBERNETES_SERVICE_HOST is not set"
    ]
    assert json_lines(run)[-1]["passed"] is False and report.exists()
