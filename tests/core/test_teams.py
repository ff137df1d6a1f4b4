"""Teams in the stack config (issue 36, item 4): supernode:teams validated with the key of every problem,
the teams' shares computed once in the Plan (Plan.teams), `supernode plan` printing each team's share,
and a job of a team that is not the stack's, or that asks more than its team may ever get, refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from supernode.cli import main
from supernode.core.config import from_mapping, load_stack
from supernode.core.errors import ConfigError
from supernode.core.jobs import job_config, job_from_mapping, job_plan, refusals
from supernode.core.plan import Plan, build_plan
from supernode.core.teams import cluster_queue, namespace

ROOT = Path(__file__).resolve().parents[2]
ROLE = "arn:aws:iam::123456789012:role/"


@pytest.fixture(scope="module")
def prod():
    return load_stack("prod", ROOT)


def with_teams(stack: str, teams: list[dict]):
    data = copy.deepcopy(load_stack(stack, ROOT).to_mapping())
    data["teams"] = teams
    return from_mapping(data, f"{stack} with teams")


def team(name: str, quota: int, **keys) -> dict:
    return {"name": name, "nominalQuota": quota, "principal": ROLE + name, **keys}


def issues(stack: str, teams: list[dict]) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        with_teams(stack, teams)
    return {i.path: i.message for i in e.value.issues}


def test_every_teams_problem_is_named_by_its_key():
    found = issues(
        "prod",
        [
            team("research", 96, lendingLimit=104, borrowingLimit=4),  # lends more than its own; half a node
            team("research", 40, principal=ROLE + "research"),  # the same name and the same IAM role
        ],
    )
    assert "must be at most the team's nominalQuota (96)" in found["supernode:teams[0].lendingLimit"]
    assert "multiple of a training node's 8 devices" in found["supernode:teams[0].borrowingLimit"]
    assert found["supernode:teams[1].name"] == "team names must be unique"
    assert "one role maps to one Kubernetes group" in found["supernode:teams[1].principal"]
    assert len(found) == 6, found  # both duplicates are named at each of the two teams
    # the schema's own problems, each at its key: the name pattern, a negative quota, a principal that is
    # no role ARN, a misspelt key
    found = issues("prod", [{"name": "Bad_Name", "nominalQuota": -8, "principal": "research", "weigth": 2}])
    assert set(found) == {f"supernode:teams[0].{k}" for k in ("name", "nominalQuota", "principal", "weigth")}
    assert "greater than or equal to 0" in found["supernode:teams[0].nominalQuota"]
    assert "did you mean 'weight'" in found["supernode:teams[0].weigth"]


def test_a_team_namespace_cannot_be_the_stacks_own():
    data = copy.deepcopy(load_stack("dev", ROOT).to_mapping())
    data["workload"]["namespace"] = "team-ml"
    data["teams"] = [team("ml", 16)]
    with pytest.raises(ConfigError) as e:
        from_mapping(data, "dev")
    [issue] = e.value.issues
    assert issue.path == "supernode:teams[0].name" and "team-ml is the stack's own" in issue.message


@pytest.mark.parametrize("name", ["serving", "llm-serving"])
def test_a_team_whose_queue_would_read_as_servings_is_refused(name):
    data = copy.deepcopy(load_stack("dev", ROOT).to_mapping())
    data["teams"] = [team(name, 16)]
    with pytest.raises(ConfigError) as e:
        from_mapping(data, "dev")
    [issue] = e.value.issues
    assert issue.path == "supernode:teams[0].name" and "would end like serving's queue" in issue.message


def test_a_stack_without_teams_plans_and_serialises_as_before(prod):
    dev = load_stack("dev", ROOT)
    assert dev.teams == [] and "teams" not in dev.to_mapping()  # the ops ConfigMap's stack file unchanged
    plan = build_plan("dev", dev, root=ROOT)
    assert plan.teams == [] and plan.team is None
    text = plan.to_json()
    assert '"teams"' not in text and '"team"' not in text  # the plan ConfigMap and its hash unchanged
    assert Plan.from_json(text) == plan


def test_prods_teams_split_training_share_exactly(prod):
    plan = build_plan("prod", prod, root=ROOT)
    [pool], [teams] = plan.pools, plan.teams
    assert teams.accelerator == pool.accelerator and teams.training_devices == pool.training_devices == 136
    research, platform = teams.teams
    assert (research.name, research.nominal, research.max_devices, research.nodes) == ("research", 96, 136, 12)
    assert (platform.name, platform.nominal, platform.max_devices, platform.max_nodes) == ("platform", 40, 72, 9)
    assert research.nominal + platform.nominal == pool.training_devices
    assert research.training_percent == round(100 * 96 / 136, 1) and research.pool_percent == round(100 * 96 / 168, 1)
    # together they lend what training may (its share less its spare and the job's 8-node minimum)
    assert teams.lending_total == pool.training_lending_limit == 64
    # research's queue admits the stack's own 128-GPU job: 96 + 40 reaches it
    assert teams.stack_job_team == "research" and teams.stack_job_devices == pool.training_max == 128
    assert teams.adds_up, teams.reason
    # the plan carries the figures through its JSON (the ConfigMap the policies read)
    assert Plan.from_json(plan.to_json()).teams == plan.teams


@pytest.mark.parametrize(
    "teams, wrong",
    [
        # 96 + 32 = 128: the spare node's 8 GPUs belong to no team
        ([team("research", 96, borrowingLimit=40), team("platform", 32)], "= 128 != training's share 136 GPUs"),
        # 144: the cohort would admit more than the nodes
        ([team("research", 104, borrowingLimit=24), team("platform", 40)], "the cohort would admit more"),
        # lending 72 > the 64 training may lend: serving could take the spare or the job's minimum
        (
            [team("research", 96, borrowingLimit=40, lendingLimit=40), team("platform", 40, lendingLimit=32)],
            "teams lend 72 > the 64 training may lend",
        ),
        # the stack's job (128) in research's queue cannot reach 96 + 24
        ([team("research", 96, borrowingLimit=24), team("platform", 40)], "the stack's own job asks 128 GPUs > team"),
    ],
)
def test_teams_that_do_not_add_up_are_named_with_the_numbers(teams, wrong):
    plan = build_plan("prod", with_teams("prod", teams), root=ROOT)
    [shares] = plan.teams
    assert not shares.adds_up and wrong in shares.reason


def test_plan_prints_each_teams_share(capsys):
    assert main(["plan", "--stack", "prod", "--root", str(ROOT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    [teams] = out["teams"]
    assert [(t["name"], t["nominal"], t["training_percent"]) for t in teams["teams"]] == [
        ("research", 96, 70.6),
        ("platform", 40, 29.4),
    ]
    assert teams["adds_up"] is True
    assert main(["plan", "--stack", "prod", "--root", str(ROOT)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("team research", "70.6% of training's share", "team platform", "29.4% of training's share"):
        assert phrase in text, phrase
    assert main(["plan", "--stack", "dev", "--root", str(ROOT), "--json"]) == 0
    assert "teams" not in json.loads(capsys.readouterr().out)  # dev has none: its output is as before


def test_names_are_valid_kubernetes_names():
    assert cluster_queue("research", "H100") == "gpu-h100-research"  # the pool's label is upper-case
    assert namespace("research") == "team-research"


# -- jobs ---------------------------------------------------------------------------------------------


def job(**keys):
    return job_from_mapping({"name": "exp", "team": "research", **keys})


def test_a_job_of_no_team_of_the_stack_is_bad_input_at_team(prod):
    with pytest.raises(ConfigError) as e:
        job_config(prod, job(team="vision"))
    [issue] = e.value.issues
    assert (issue.path, issue.value) == ("team", "vision") and "research, platform" in issue.message
    # a stack without teams has no team to check against
    job_config(load_stack("dev", ROOT), job(team="vision"))


def test_a_job_asking_more_than_its_team_may_ever_get_is_refused_with_the_figures(prod):
    # platform may hold 40 + 32 = 72 GPUs (9 nodes): 8 nodes fit, the stack's 16 do not
    fits = job_plan("prod", prod, job(team="platform", nodes={"max": 8}), ROOT)
    assert fits.team == "platform" and refusals(fits) == []
    big = job_plan("prod", prod, job(team="platform"), ROOT)
    [refusal] = [r for r in refusals(big) if r.startswith("team quota")]
    assert refusal == (
        "team quota: the job asks 128 GPUs (16 nodes), more than team platform may ever get: its nominal 40 + "
        "borrowing limit 32 = 72 GPUs (9 nodes)"
    )
    # research may hold 136: the same job is not refused for its quota
    assert not [r for r in refusals(job_plan("prod", prod, job(), ROOT)) if r.startswith("team quota")]
