"""IMDS hop limit 1 on every launch template (issue 19): the policy, with its failing cases."""

from __future__ import annotations

import pytest
from policy_resources import mutate

from supernode.core import resource_types as T
from supernode.tools.policycheck import check


def test_compliant_launch_template_keeps_imds_on_the_node(stack):
    lt = next(r for r in stack if r["type"] == T.LAUNCH_TEMPLATE)
    assert lt["inputs"]["metadataOptions"]["httpPutResponseHopLimit"] == 1
    assert not [v for v in check(stack).violations if v.policy == "ec2-imds-hop-limit"]


@pytest.mark.parametrize("hops", [2, 3, None])
def test_a_hop_limit_other_than_1_fails(stack, hops):
    def change(i: dict) -> None:
        i["metadataOptions"].pop("httpPutResponseHopLimit")
        if hops is not None:
            i["metadataOptions"]["httpPutResponseHopLimit"] = hops

    found = check(mutate(stack, T.LAUNCH_TEMPLATE, change)).violations
    assert [(v.policy, v.enforcement) for v in found] == [("ec2-imds-hop-limit", "mandatory")]
    assert "httpPutResponseHopLimit 1" in found[0].message and "IRSA" in found[0].message
