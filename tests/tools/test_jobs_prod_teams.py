"""Issue 36's end to end, on the prod stack with its two teams (research, platform), without `pulumi up`:
a second and a third job planned (one refused by memory, one by its team's quota), two submitted into
their teams' namespaces, listed with their queue positions and waits, and cancelled, through the CLI
against the in-process API double (tests/kube_api.py: no real API server runs here)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from supernode.cli import main
from supernode.core import teams as names
from supernode.core.config import load_stack
from tests.kube_api import KubeApi, stamp

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "jobs"


@pytest.fixture
def api():
    a = KubeApi()
    yield a
    a.close()


def test_prod_teams_plan_refuse_submit_list_and_cancel_jobs(api, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    cfg = load_stack("prod", ROOT)
    assert [t.name for t in cfg.teams] == ["research", "platform"]
    common = ["--stack", "prod", "--root", str(ROOT)]
    cluster = [*common, "--kubeconfig", str(api.kubeconfig(tmp_path / "kubeconfig"))]

    # planned: the sweep fits research's share; the long context does not fit the HBM
    assert main(["job", "plan", str(JOBS / "moe-lr-sweep.yaml"), *common]) == 0
    capsys.readouterr()
    assert main(["job", "plan", str(JOBS / "moe-long-context.yaml"), *common, "--json"]) == 1
    refused = json.loads(capsys.readouterr().out)
    assert not refused["submittable"] and refused["refusals"][0].startswith("memory: ")
    # a platform job on all 16 nodes: more than platform may ever hold (its nominal + borrowing limit)
    greedy = tmp_path / "greedy.yaml"
    greedy.write_text(yaml.safe_dump({"name": "platform-full", "team": "platform", "nodes": {"max": 16}}))
    assert main(["job", "submit", str(greedy), *cluster]) == 1
    assert "team quota: the job asks 128 GPUs" in capsys.readouterr().out
    # a team the stack does not have: bad input at `team`
    stranger = tmp_path / "stranger.yaml"
    stranger.write_text(yaml.safe_dump({"name": "x", "team": "marketing"}))
    assert main(["job", "plan", str(stranger), *common]) == 2
    assert "team" in capsys.readouterr().err
    assert not api.requests("PATCH")  # nothing refused reached the cluster

    # submitted: the sweep (research) and an evaluation on 8 nodes (platform: 9 at most), each in its team's namespace
    evaluation = tmp_path / "eval.yaml"
    evaluation.write_text(
        yaml.safe_dump({"name": "platform-eval", "team": "platform", "priority": "high", "nodes": {"max": 8}})
    )
    for path in (JOBS / "moe-lr-sweep.yaml", evaluation):
        assert main(["job", "submit", str(path), *cluster, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == "queued"
    jobs = {(ns, name) for kind, ns, name in api.objects if kind == "pytorchjobs"}
    assert jobs == {(names.namespace("research"), "moe-lr-sweep"), (names.namespace("platform"), "platform-eval")}

    # what Kueue would say: both pending, the sweep behind the stack's own job in research's queue
    now = time.time()
    for team, job, position in (("research", "moe-lr-sweep", 1), ("platform", "platform-eval", 0)):
        ns = names.namespace(team)
        api.objects[("pytorchjobs", ns, job)]["metadata"]["creationTimestamp"] = stamp(now - 90)  # submitted then
        workload = api.add_workload(ns, job, created=now - 90)
        api.set_pending(ns, "gpu-h100", [("stack-job", 0)] * position + [(workload["metadata"]["name"], position)])
    assert main(["job", "list", *cluster, "--json"]) == 0
    listed = {j["name"]: j for j in json.loads(capsys.readouterr().out)}
    assert {n: (j["team"], j["state"], j["queue_position"]) for n, j in listed.items()} == {
        "moe-lr-sweep": ("research", "queued", 2),
        "platform-eval": ("platform", "queued", 1),
    }
    assert all(89 <= j["waited_s"] <= 120 for j in listed.values()), listed  # since they were submitted
    # each team's namespace read on its own (the people of one team see only theirs)
    assert main(["job", "list", *cluster, "--team", "platform", "--json"]) == 0
    assert [j["name"] for j in json.loads(capsys.readouterr().out)] == ["platform-eval"]

    # cancelled: nothing runs, so nothing to checkpoint; deleted, and gone once the garbage collector
    # (the double's finish_deletions) has removed what depends on them
    for name in ("moe-lr-sweep", "platform-eval"):
        assert main(["job", "cancel", name, *cluster]) == 0
        assert "cancelled" in capsys.readouterr().out
    assert all(api.objects[k]["metadata"].get("deletionTimestamp") for k in api.objects if k[0] == "pytorchjobs")
    api.finish_deletions()
    assert not [k for k in api.objects if k[0] == "pytorchjobs"]
