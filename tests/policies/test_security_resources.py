"""The container-resources policy (issue 19): CPU and memory requests and limits on every container."""

from __future__ import annotations

import pytest
from policy_resources import mutate

from supernode.core import resource_types as T
from supernode.tools.policycheck import check


@pytest.mark.parametrize(
    "kind,resource", [("limits", "cpu"), ("limits", "memory"), ("requests", "cpu"), ("requests", "memory")]
)
def test_a_container_missing_one_bound_fails(stack, kind, resource):
    bad = mutate(
        stack, T.DAEMON_SET, lambda i: i["spec"]["template"]["spec"]["containers"][0]["resources"][kind].pop(resource)
    )
    found = check(bad).violations
    assert [(v.policy, v.enforcement) for v in found] == [("container-resources", "mandatory")]
    assert f"{kind}.{resource}" in found[0].message and "dcgm-exporter" in found[0].message
