"""Issue 30 #14: public bucket policies and ACLs fail, a weakened public-access block fails a check
(it is only remediated where the Pulumi CLI applies the pack to an update), and an AWS resource of a
type no security policy reads fails instead of passing silently."""

from __future__ import annotations

import json

import pytest
from policy_resources import find, mutate, res

from supernode.core import resource_types as T
from supernode.tools.policycheck import check, config_from_stack

PUBLIC_READ = {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"}


def with_statement(stack, statement):
    def add(inputs):
        policy = json.loads(inputs["policy"])
        policy["Statement"].append(statement)
        inputs["policy"] = json.dumps(policy)

    return mutate(stack, T.BUCKET_POLICY, add)


@pytest.mark.parametrize(
    "principal",
    [
        {"Principal": "*"},
        {"Principal": {"AWS": "*"}},
        {"Principal": {"AWS": ["*"]}},
        {"NotPrincipal": {"AWS": "arn:aws:iam::1:root"}},
    ],
)
def test_a_bucket_policy_that_allows_anyone_fails(stack, principal):
    found = check(with_statement(stack, {**PUBLIC_READ, **principal})).violations
    assert [(v.policy, v.enforcement) for v in found] == [("s3-no-public-policy", "mandatory")]
    assert "statement 1 allows ['s3:GetObject'] to anyone" in found[0].message


def test_anyone_confined_by_a_vpc_endpoint_or_the_organisation_is_not_public(stack):
    for condition in ({"StringEquals": {"aws:SourceVpce": "vpce-1"}}, {"StringEquals": {"aws:PrincipalOrgID": "o-1"}}):
        assert check(with_statement(stack, {**PUBLIC_READ, "Principal": "*", "Condition": condition})).violations == []
    # A condition that confines nothing (the TLS flag) leaves it public.
    tls = {"Bool": {"aws:SecureTransport": "true"}}
    found = check(with_statement(stack, {**PUBLIC_READ, "Principal": "*", "Condition": tls})).violations
    assert [v.policy for v in found] == ["s3-no-public-policy"]


def test_a_public_acl_on_the_bucket_or_in_an_acl_resource_fails(stack):
    found = check(mutate(stack, T.BUCKET, lambda i: i.update(acl="public-read"))).violations
    assert [(v.policy, v.enforcement) for v in found] == [("s3-no-public-acl", "mandatory")]
    assert "acl 'public-read'" in found[0].message
    grant = {
        "grantee": {"type": "Group", "uri": "http://acs.amazonaws.com/groups/global/AllUsers"},
        "permission": "READ",
    }
    acl = res(
        T.BUCKET_ACL_V2, "data", {"bucket": "b", "accessControlPolicy": {"grants": [grant], "owner": {"id": "o"}}}
    )
    found = check([*stack, acl]).violations
    assert [(v.policy, v.urn) for v in found] == [("s3-no-public-acl", acl["urn"])]
    assert "a grant to AllUsers" in found[0].message
    assert check(mutate(stack, T.BUCKET, lambda i: i.update(acl="private"))).violations == []


def test_a_weakened_public_access_block_fails_a_check_and_is_remediated_only_by_the_pack_itself(stack, dev_cfg):
    weakened = mutate(stack, T.BUCKET_PAB, lambda i: i.update(blockPublicPolicy=False))
    as_checked = check(weakened, config_from_stack(dev_cfg))  # preview, `policy check`, the PR check
    assert as_checked.remediations == []
    assert [(v.policy, v.enforcement) for v in as_checked.mandatory] == [("s3-public-access-block", "mandatory")]
    assert "blockPublicPolicy" in as_checked.mandatory[0].message
    assert [r.policy for r in check(weakened).remediations] == ["s3-public-access-block"]  # the pack's default
    assert config_from_stack(dev_cfg)["ec2-imdsv2"] == {"enforcementLevel": "mandatory"}


def test_an_aws_resource_of_a_type_no_policy_reads_fails(stack):
    unknown = res("aws:s3/bucketV2:BucketV2", "legacy", {"bucket": "legacy"})
    found = check([*stack, unknown]).violations
    assert [(v.policy, v.enforcement, v.urn) for v in found] == [("aws-types-reviewed", "mandatory", unknown["urn"])]
    assert "aws:s3/bucketV2:BucketV2" in found[0].message
    assert find(stack, T.BUCKET)  # the reviewed types of the compliant stack pass (no other violation above)
