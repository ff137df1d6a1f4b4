"""A job file and its own plan (issue 36, items 1 and 2): validated by the stack's schema and rules with
the job file's keys, planned by the stack's planner on the stack's hardware, refused by figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supernode.cli import main
from supernode.core.config import load_stack
from supernode.core.errors import ConfigError
from supernode.core.jobs import job_config, job_from_mapping, job_plan, read_job, refusals
from supernode.core.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "jobs" / "moe-lr-sweep.yaml"


@pytest.fixture(scope="module")
def prod():
    return load_stack("prod", ROOT)


def job(**keys):
    return job_from_mapping({"name": "exp", "team": "research", **keys})


def test_the_shipped_job_plans_on_prods_hardware_with_its_overrides(prod):
    spec = read_job(SWEEP)
    plan = job_plan("prod", prod, spec, ROOT)
    # half of prod's 16 nodes, elastic down to 4: dpShard rescaled to the world, the other degrees kept
    assert (plan.nodes, plan.world_size, plan.min_nodes, plan.instance_type) == (8, 64, 4, "p5.48xlarge")
    assert plan.degrees.dp_replicate == prod.parallel.dp_replicate and plan.degrees.world_size == 64
    assert [e.nodes for e in plan.layouts] == [4, 5, 6, 7, 8]
    assert plan.training.lr == 0.0006 != prod.training.lr  # the job's key; the rest the stack's
    assert plan.training.global_batch == prod.training.global_batch and plan.model == prod.model
    assert plan.fits and refusals(plan) == []
    # the same planner: the job's plan is the stack's plan of the job's config, marked with its team
    assert plan.team == "research"
    assert plan == build_plan("prod", job_config(prod, spec), root=ROOT).model_copy(update={"team": "research"})
    # fewer ranks, the same global batch: each rank holds more and the step is longer
    full = build_plan("prod", prod, root=ROOT)
    assert plan.memory.params_per_rank > full.memory.params_per_rank and plan.step.step_s > full.step.step_s


def test_every_problem_of_a_job_file_at_once_named_by_its_key(prod):
    with pytest.raises(ConfigError) as e:
        job_from_mapping({"name": "Bad_Name", "team": "research", "priority": "urgent", "modle": {}})
    assert sorted(i.path for i in e.value.issues) == ["modle", "name", "priority"]
    with pytest.raises(ConfigError) as e:
        job_config(prod, job(nodes={"max": 17}))
    [issue] = e.value.issues
    assert (issue.path, issue.value) == ("nodes.max", 17) and "at most the stack's 16 training nodes" in issue.message
    # the stack's rules, reported with the job file's key (not supernode:model.heads)
    with pytest.raises(ConfigError) as e:
        job_config(prod, job(model={"heads": 7}, training={"warmupSteps": 10**9}))
    paths = {i.path for i in e.value.issues}
    assert "training.warmupSteps" in paths and any(p.startswith("model.") for p in paths)
    assert not any(p.startswith("supernode:") for p in paths)


def test_a_job_that_does_not_fit_is_refused_naming_the_figure(prod):
    big = job(parallel={"activationCheckpointing": "none"}, training={"microBatch": 8, "globalBatch": 8192})
    plan = job_plan("prod", prod, big, ROOT)
    memory = refusals(plan)[0]  # then each elastic world (prod's minNodes 8 to 16), none of which fits
    assert memory.startswith(f"memory: {plan.memory_per_rank_gib:.1f} GiB per rank is over the usable 72.0 GiB")


def test_an_elastic_minimum_with_no_layout_is_refused(prod):
    plan = job_plan("prod", prod, job(nodes={"max": 8, "min": 1}), ROOT)
    assert plan.fits and any(r.startswith("elastic: 1 nodes (world 8) has no layout") for r in refusals(plan))


def test_a_grace_period_shorter_than_a_step_and_a_checkpoint_is_refused(prod):
    short = prod.model_copy(update={"workload": prod.workload.model_copy(update={"termination_grace_s": 60})})
    plan = build_plan("prod", short, root=ROOT)
    [grace] = refusals(plan)
    assert grace.startswith("grace period: workload.terminationGraceS 60 s is below the")


def test_job_plan_cli_exit_codes(tmp_path, capsys):
    assert main(["job", "plan", "--stack", "prod", "--root", str(ROOT), str(SWEEP), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["submittable"] and out["refusals"] == [] and out["plan"]["world_size"] == 64
    assert out["job"] == {"name": "moe-lr-sweep", "team": "research", "priority": "low", "nodes": {"max": 8, "min": 4},
                          "training": {"lr": 0.0006}}  # fmt: skip
    refused = tmp_path / "big.yaml"
    refused.write_text("name: big\nteam: research\nnodes: {max: 8, min: 1}\n")
    assert main(["job", "plan", "--stack", "prod", "--root", str(ROOT), str(refused)]) == 1
    assert "refused: elastic: 1 nodes" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: big\nteam: research\nnodes: {max: 99}\nextra: 1\n")
    assert main(["job", "plan", "--stack", "prod", "--root", str(ROOT), str(bad)]) == 2
    err = capsys.readouterr().err
    assert "extra" in err and "Traceback" not in err
    assert main(["job", "plan", "--stack", "prod", "--root", str(ROOT), str(tmp_path / "missing.yaml")]) == 2
