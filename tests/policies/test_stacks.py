"""The real dev and prod stacks (offline preview of the program) pass, and the policies really see them.

prod is previewed as deployed, with its images built and pinned (`make image`, `make addon-digests`):
the repository's Pulumi.prod.yaml carries the placeholder trainer digest and add-on tags, which prod's
image policies fail on purpose (tests/policies/test_security_images.py)."""

from __future__ import annotations

import copy
import json

import pytest
from policy_resources import ROOT, built_images

from supernode.core import resource_types as T
from supernode.core.config import load_stack
from supernode.core.plan import build_plan
from supernode.policies.view import Stack
from supernode.tools.policycheck import check, config_from_stack
from supernode.tools.preview import run_program

pytestmark = pytest.mark.slow  # runs the Pulumi program under the mock engine (seconds per stack)


@pytest.fixture(scope="module", params=["dev", "prod"])
def real(request, saved_dev_preview):
    name = request.param
    cfg = load_stack(name, ROOT)
    if name == "dev":  # reuse the CLI's saved preview rather than running the program again
        resources = json.loads(saved_dev_preview[1].read_text())["resources"]
    else:
        cfg = built_images(cfg)
        resources = [r.to_json() for r in run_program(name, cfg).resources]
    return name, cfg, resources


def test_zero_mandatory_violations(real):
    name, cfg, resources = real
    report = check(resources, config_from_stack(cfg))
    assert report.mandatory == [], "\n".join(f"{v.policy}: {v.message}" for v in report.mandatory)
    assert not [v for v in report.violations if "can't run policy" in v.message]


def test_policies_see_the_real_resources_and_the_plan(real):
    """Guards against passing vacuously: what each anchored check looks for is present."""
    name, cfg, resources = real
    stack = Stack.from_json(resources)
    assert len(stack.gpu_node_groups()) == len(cfg.accelerator_node_groups)
    assert len(stack.gpu_launch_templates()) == len(cfg.accelerator_node_groups)
    assert stack.plan() == build_plan(name, cfg)  # the plan reaches the policies through the ConfigMap
    assert len(stack.trainer_jobs()) == 1 and len(stack.gates()) == 1
    assert stack.of(T.BUCKET) and stack.of(T.FSX_LUSTRE)


def _gpu_group(resources: list[dict]) -> dict:
    gpu = Stack.from_json(resources).gpu_node_groups()[0]
    return next(r for r in resources if r["urn"] == gpu.urn)


def test_breaking_the_real_stack_fails_the_right_policies(real):
    name, cfg, resources = real
    broken = copy.deepcopy(resources)
    _gpu_group(broken)["inputs"]["scalingConfig"]["desiredSize"] += 1
    broken = [r for r in broken if r["type"] != T.SG_INGRESS]
    job = next(r for r in broken if r["type"] == T.PYTORCH_JOB)
    job["dependencies"] = [d for d in job["dependencies"] if T.K8S_JOB not in d]
    failed = {v.policy for v in check(broken, config_from_stack(cfg)).mandatory}
    assert {"accelerators-match-world-size", "interconnect-efa-security-group", "interconnect-gate"} <= failed
