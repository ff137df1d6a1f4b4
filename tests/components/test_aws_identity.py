"""IAM and KMS: no wildcard actions, `*` resources only where AWS requires them, the node role's
managed policies, and a trainer role that reaches only its prefixes and key."""

from __future__ import annotations

import json
from fnmatch import fnmatchcase

from aws_preview import Stack, as_list, policy, preview, statements

from supernode.components.aws.identity import NODE_MANAGED_POLICIES
from supernode.core import resource_types as T
from supernode.core import teams as team_names

ROLE = T.IAM_ROLE
ROLE_POLICY = T.IAM_ROLE_POLICY
KEY = T.KMS_KEY
# Documents by type and input key: identity policies, trust policies, key and bucket policies.
DOCUMENTS = {
    ROLE_POLICY: "policy",
    T.IAM_POLICY: "policy",
    ROLE: "assumeRolePolicy",
    KEY: "policy",
    T.BUCKET_POLICY: "policy",
    T.SNS_TOPIC_POLICY: "policy",
}


def documents(stack: Stack):
    for typ, key in DOCUMENTS.items():
        for r in stack.all(typ):
            yield typ, r, policy(r, key)


def test_no_document_allows_a_wildcard_action(stack: Stack):
    seen = set()
    for typ, r, doc in documents(stack):
        seen.add(typ)
        for s in statements(doc):
            assert "NotAction" not in s and "NotResource" not in s, r.name
            if s["Effect"] == "Allow":
                assert all("*" not in a for a in as_list(s["Action"])), (r.name, s["Action"])
            else:  # a Deny only removes access; the one we use is the TLS-only bucket rule
                assert typ == T.BUCKET_POLICY and s["Sid"] == "DenyInsecureTransport"
    assert seen >= {ROLE, ROLE_POLICY, KEY, T.BUCKET_POLICY}


def test_star_resource_only_in_key_policies(stack: Stack):
    for typ, r, doc in documents(stack):
        for s in statements(doc):
            if "Resource" in s and "*" in as_list(s["Resource"]):
                assert typ == KEY, f"{r.name}: '*' resource outside a key policy"


def test_keys_rotate_and_logs_may_use_the_ops_key(stack: Stack):
    keys = {r.name: r for r in stack.all(KEY)}
    assert set(keys) == {"keys-eks", "keys-data", "keys-ops"}
    assert all(k.inputs["enableKeyRotation"] is True for k in keys.values())
    ops = statements(policy(keys["keys-ops"]))
    principals = {json.dumps(s["Principal"], sort_keys=True) for s in ops}
    assert json.dumps({"Service": f"logs.{stack.cfg.region}.amazonaws.com"}) in principals
    assert json.dumps({"Service": "cloudwatch.amazonaws.com"}) in principals  # alarms -> encrypted SNS
    assert set(stack.outputs["kms_key_arns"].values()) == {k.outputs["arn"] for k in keys.values()}


def test_node_role_has_only_the_node_managed_policies(stack: Stack):
    role = stack.one(ROLE, "node-role")
    assert statements(policy(role, "assumeRolePolicy"))[0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    attached = [a.inputs["policyArn"] for a in stack.all(T.IAM_ATTACHMENT) if a.inputs["role"] == role.outputs["name"]]
    assert sorted(attached) == sorted(f"arn:aws:iam::aws:policy/{p}" for p in NODE_MANAGED_POLICIES)
    assert not [p for p in stack.all(ROLE_POLICY) if p.inputs["role"] == role.id]


def _allowed(doc: dict, action: str, resource: str) -> bool:
    return any(
        s["Effect"] == "Allow"
        and action in as_list(s["Action"])
        and any(fnmatchcase(resource, pattern) for pattern in as_list(s["Resource"]))
        for s in statements(doc)
    )


def test_trainer_role_reaches_only_its_prefixes(stack: Stack):
    doc = policy(stack.one(ROLE_POLICY, "trainer-role-data"))
    bucket = f"arn:aws:s3:::{stack.outputs['bucket_name']}"
    s, key = stack.cfg.storage, stack.outputs["kms_key_arns"]["data"]
    ds, ck = f"{bucket}/{s.dataset_prefix}shard-0.bin", f"{bucket}/{s.checkpoint_prefix}step-100/rank0.distcp"
    assert _allowed(doc, "s3:GetObject", ds) and not _allowed(doc, "s3:PutObject", ds)
    assert not _allowed(doc, "s3:DeleteObject", ds)
    assert (
        _allowed(doc, "s3:GetObject", ck) and _allowed(doc, "s3:PutObject", ck) and _allowed(doc, "s3:DeleteObject", ck)
    )
    for elsewhere in (f"{bucket}/{s.log_prefix}x", f"{bucket}/other/x", "arn:aws:s3:::another-bucket/x"):
        assert not any(_allowed(doc, a, elsewhere) for a in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"))
    listing = [st for st in statements(doc) if "s3:ListBucket" in as_list(st["Action"])]
    assert listing and all(st["Resource"] == bucket for st in listing)
    assert set(listing[0]["Condition"]["StringLike"]["s3:prefix"]) == {
        s.dataset_prefix,
        s.dataset_prefix + "*",
        s.checkpoint_prefix,
        s.checkpoint_prefix + "*",
    }
    kms = [st for st in statements(doc) if any(a.startswith("kms:") for a in as_list(st["Action"]))]
    assert [st["Resource"] for st in kms] == [key]
    resources = {r for st in statements(doc) for r in as_list(st["Resource"])}
    assert all(
        r == bucket
        or r.startswith(f"{bucket}/{s.dataset_prefix}")
        or r.startswith(f"{bucket}/{s.checkpoint_prefix}")
        or r == key
        for r in resources
    )


def test_trainer_irsa_trust_is_the_trainer_account_only(stack: Stack):
    role = stack.one(ROLE, "trainer-role")
    (trust,) = statements(policy(role, "assumeRolePolicy"))
    host = stack.outputs["oidc_issuer_url"].removeprefix("https://")
    w = stack.cfg.workload
    assert trust["Principal"] == {"Federated": stack.outputs["oidc_provider_arn"]}
    assert trust["Action"] == "sts:AssumeRoleWithWebIdentity"
    # the trainer's account in the training namespace and, with teams, in each team's (their jobs' pods)
    accounts = [
        f"system:serviceaccount:{ns}:{w.service_account}"
        for ns in (w.namespace, *(team_names.namespace(t.name) for t in stack.cfg.teams))
    ]
    assert trust["Condition"]["StringEquals"] == {
        f"{host}:sub": accounts[0] if len(accounts) == 1 else accounts,
        f"{host}:aud": "sts.amazonaws.com",
    }
    assert len(accounts) == 1 + len(stack.cfg.teams)
    assert stack.outputs["trainer_role_arn"] == role.outputs["arn"]


def test_trainer_pod_identity_variant():
    def change(data: dict) -> None:
        data["identity"]["podIdentity"] = "pod-identity"

    s = preview("dev", "pod-identity", change)
    (trust,) = statements(policy(s.one(ROLE, "trainer-role"), "assumeRolePolicy"))
    assert trust["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    assoc = s.one(T.POD_IDENTITY_ASSOCIATION).inputs
    assert (assoc["namespace"], assoc["serviceAccount"], assoc["roleArn"]) == (
        s.cfg.workload.namespace,
        s.cfg.workload.service_account,
        s.outputs["trainer_role_arn"],
    )


def test_cloudwatch_agent_role_is_scoped_to_its_service_account(stack: Stack):
    (trust,) = statements(policy(stack.one(ROLE, "monitoring-cloudwatch-agent"), "assumeRolePolicy"))
    assert (
        list(trust["Condition"]["StringEquals"].values())[0]
        == "system:serviceaccount:amazon-cloudwatch:cloudwatch-agent"
    )


def test_an_existing_data_key_is_used_not_created():
    arn = "arn:aws:kms:us-east-1:123456789012:key/0f1e2d3c-4b5a-4978-8877-665544332211"

    def change(data: dict) -> None:
        data["identity"]["kmsKeyArn"] = arn

    s = preview("dev", "existing-key", change)
    assert sorted(k.name for k in s.all(KEY)) == ["keys-eks", "keys-ops"]
    assert s.outputs["kms_key_arns"]["data"] == arn
    assert s.one(T.FSX_LUSTRE).inputs["kmsKeyId"] == arn
    assert [st["Resource"] for st in statements(policy(s.one(ROLE_POLICY, "trainer-role-data")))][-1] == arn


def test_node_health_agent_may_only_replace_this_clusters_gpu_nodes(stack: Stack):
    """TerminateInstanceInAutoScalingGroup and nothing else, on the GPU node groups' Auto Scaling groups
    (EKS names them eks-<node group>-<uuid> and tags them eks:cluster-name and eks:nodegroup-name)."""
    groups = sorted(g.name for g in stack.cfg.accelerator_node_groups)
    (st,) = statements(policy(stack.one(ROLE_POLICY, "node-health-role"), "policy"))
    assert st["Effect"] == "Allow" and as_list(st["Action"]) == ["autoscaling:TerminateInstanceInAutoScalingGroup"]
    resources = as_list(st["Resource"])
    assert len(resources) == len(groups) and "*" not in resources
    account = resources[0].split(":")[4]
    arn = f"arn:aws:autoscaling:{stack.cfg.region}:{account}:autoScalingGroup:0a1b:autoScalingGroupName/eks-"
    for group in groups:
        assert any(fnmatchcase(f"{arn}{group}-9c", r) for r in resources), group
    assert not any(fnmatchcase(f"{arn}system-9c", r) for r in resources)  # the system node group's
    tags = st["Condition"]["StringEquals"]
    assert tags["aws:ResourceTag/eks:cluster-name"] == stack.outputs["cluster_name"]
    assert sorted(as_list(tags["aws:ResourceTag/eks:nodegroup-name"])) == groups
    (trust,) = statements(policy(stack.one(ROLE, "node-health-role"), "assumeRolePolicy"))
    assert (
        list(trust["Condition"]["StringEquals"].values())[0]
        == "system:serviceaccount:supernode-node-health:node-health"
    )
