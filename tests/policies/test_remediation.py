"""Remediations (IMDSv2, S3 public-access block) return the fixed properties and keep everything else."""

from __future__ import annotations

from policy_resources import find, mutate

from supernode.core import resource_types as T
from supernode.tools.policycheck import check

LT = T.LAUNCH_TEMPLATE
PAB = T.BUCKET_PAB


def test_imdsv2_is_remediated_like_the_engine_does(stack):
    broken = mutate(stack, LT, lambda i: i["metadataOptions"].update(httpTokens="optional"))
    report = check(broken)
    (rem,) = report.remediations
    assert rem.policy == "ec2-imdsv2" and rem.urn == find(stack, LT)["urn"]
    original = find(stack, LT)["inputs"]
    assert rem.properties["metadataOptions"] == {**original["metadataOptions"], "httpTokens": "required"}
    assert rem.properties["instanceType"] == original["instanceType"]
    assert len(rem.properties["networkInterfaces"]) == len(original["networkInterfaces"])
    assert report.violations == [] and report.passed  # analyzed after the fix, as `pulumi preview` does


def test_imdsv2_without_metadata_options_gets_them(stack):
    report = check(mutate(stack, LT, lambda i: i.pop("metadataOptions")))
    assert report.remediations[0].properties["metadataOptions"] == {"httpTokens": "required"}


def test_public_access_block_is_remediated(stack):
    report = check(mutate(stack, PAB, lambda i: i.update(blockPublicPolicy=False, restrictPublicBuckets=False)))
    (rem,) = report.remediations
    assert rem.policy == "s3-public-access-block"
    assert rem.properties == {**find(stack, PAB)["inputs"], "blockPublicPolicy": True, "restrictPublicBuckets": True}


def test_compliant_resources_are_not_rewritten(stack):
    assert check(stack).remediations == []


def test_remediation_can_be_turned_into_a_mandatory_check(stack):
    report = check(
        mutate(stack, LT, lambda i: i["metadataOptions"].update(httpTokens="optional")), {"ec2-imdsv2": "mandatory"}
    )
    assert report.remediations == []
    (v,) = report.violations
    assert (v.policy, v.enforcement) == ("ec2-imdsv2", "mandatory") and "httpTokens" in v.message
