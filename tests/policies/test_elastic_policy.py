"""Issue 26, items 2 and 3, through the real program and the pack: prod's elastic range fits at every
node count and its spare is deployed; a range reaching a node count that does not fit fails
`memory-fit-elastic` with the numbers, and node groups without the planned spare fail
`accelerators-match-world-size`."""

from __future__ import annotations

import copy

import pytest
from policy_resources import ROOT, built_images

from supernode.core import resource_types as T
from supernode.core.config import from_mapping, load_stack
from supernode.tools.policycheck import check, config_from_stack
from supernode.tools.preview import run_program

pytestmark = pytest.mark.slow  # runs the Pulumi program under the mock engine (seconds per stack)

ELASTIC, WORLD = "memory-fit-elastic", "accelerators-match-world-size"


def findings(resources: list[dict], cfg) -> tuple[dict[str, list[str]], list[str]]:
    report = check(resources, config_from_stack(cfg))
    out: dict[str, list[str]] = {}
    for v in report.mandatory:
        out.setdefault(v.policy, []).append(v.message)
    return out, report.policies


def prod(change=None):
    data = copy.deepcopy(load_stack("prod", ROOT).to_mapping())
    if change:
        change(data)
    cfg = built_images(from_mapping(data, "prod variant"))  # prod's placeholder images fail on purpose
    return cfg, [r.to_json() for r in run_program("prod", cfg).resources]


def test_prod_fits_at_every_node_count_and_deploys_its_spare():
    cfg, resources = prod()
    found, ran = findings(resources, cfg)
    assert {ELASTIC, WORLD} <= set(ran)
    assert ELASTIC not in found and WORLD not in found, found


def test_a_minimum_below_what_fits_fails_naming_each_node_count_and_why():
    cfg, resources = prod(lambda d: d["training"].update(minNodes=2))
    found, _ = findings(resources, cfg)
    messages = found[ELASTIC]
    assert len(messages) == 2  # 2 and 3 nodes; 4 to 16 fit (one replica, the state sharded over all)
    two, three = sorted(messages)
    assert "may run on 2 nodes (world 16; training.minNodes 2 to 16 nodes)" in two
    assert "may run on 3 nodes (world 24; training.minNodes 2 to 16 nodes)" in three
    assert "142.8 GiB per rank > the usable 72.0 GiB of 80 GiB HBM" in three
    assert "Fix: raise supernode:training.minNodes above 3" in three
    assert set(found) == {ELASTIC}, found  # nothing else in the stack is wrong


def test_node_groups_without_the_planned_spare_fail_the_world_size():
    cfg, resources = prod()
    [group] = [r for r in resources if r["type"] == T.NODE_GROUP and r["inputs"]["nodeGroupName"] == "gpu-p5-a"]
    group["inputs"]["scalingConfig"]["desiredSize"] = 8  # the spare not deployed
    found, _ = findings(resources, cfg)
    [message] = found[WORLD]
    assert "provide 128 accelerators (gpu-p5-a: 8 x 8, gpu-p5-b: 8 x 8)" in message
    assert "runs world size 128 and 8 spare accelerators" in message and ".spares" in message
