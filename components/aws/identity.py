"""Identity: KMS keys, the node role, the trainer pod role (issue 3, part 5) and the cluster agents'
service-account roles.

IAM documents are built here in Python (`policy_document`, `pulumi.Output.json_dumps`) rather
than through the getPolicyDocument invoke, so they are plain data a test or policy can read.
Rules kept throughout: no `*` action in any Allow statement; `*` as a resource only in key
policies, where AWS requires it (it means "this key").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from supernode.core.config import Identity, StorageConfig

from ..context import StackContext

# Managed policies an EKS node needs, and nothing more (no SSH: SSM core gives a shell).
NODE_MANAGED_POLICIES = (
    "AmazonEKSWorkerNodePolicy",
    "AmazonEKS_CNI_Policy",
    "AmazonEC2ContainerRegistryReadOnly",
    "AmazonSSMManagedInstanceCore",
)

# Key administration and use by the account (IAM policies then decide who); listed because a
# `kms:*` action is not allowed anywhere in this stack.
KMS_ACCOUNT_ACTIONS = (
    "kms:CancelKeyDeletion",
    "kms:CreateAlias",
    "kms:CreateGrant",
    "kms:Decrypt",
    "kms:DeleteAlias",
    "kms:DescribeKey",
    "kms:DisableKey",
    "kms:DisableKeyRotation",
    "kms:EnableKey",
    "kms:EnableKeyRotation",
    "kms:Encrypt",
    "kms:GenerateDataKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:GetKeyPolicy",
    "kms:GetKeyRotationStatus",
    "kms:ListAliases",
    "kms:ListGrants",
    "kms:ListKeyPolicies",
    "kms:ListKeyRotations",
    "kms:ListResourceTags",
    "kms:PutKeyPolicy",
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
    "kms:RetireGrant",
    "kms:RevokeGrant",
    "kms:RotateKeyOnDemand",
    "kms:ScheduleKeyDeletion",
    "kms:TagResource",
    "kms:UntagResource",
    "kms:UpdateAlias",
    "kms:UpdateKeyDescription",
)
KMS_USE_ACTIONS = (
    "kms:Decrypt",
    "kms:DescribeKey",
    "kms:Encrypt",
    "kms:GenerateDataKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
)


def policy_document(*statements: Mapping[str, Any]) -> dict[str, Any]:
    return {"Version": "2012-10-17", "Statement": list(statements)}


def assume_role_policy(service: str) -> str:
    return json.dumps(
        policy_document({"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"})
    )


def irsa_trust_policy(
    provider_arn: pulumi.Input[str],
    issuer_url: pulumi.Input[str],
    namespace: str | Sequence[str],
    service_account: str,
) -> pulumi.Output[str]:
    """Trust for one Kubernetes service account through the cluster's OIDC provider (IRSA); several
    namespaces: the account of that name in each (the trainer's, in the training and team namespaces)."""
    namespaces = [namespace] if isinstance(namespace, str) else namespace
    subjects = [f"system:serviceaccount:{ns}:{service_account}" for ns in namespaces]

    def doc(arn: str, issuer: str) -> str:
        host = issuer.removeprefix("https://")
        return json.dumps(
            policy_document(
                {
                    "Effect": "Allow",
                    "Principal": {"Federated": arn},
                    "Action": "sts:AssumeRoleWithWebIdentity",
                    "Condition": {
                        "StringEquals": {
                            f"{host}:sub": subjects[0] if len(subjects) == 1 else subjects,
                            f"{host}:aud": "sts.amazonaws.com",
                        }
                    },
                }
            )
        )

    return pulumi.Output.all(provider_arn, issuer_url).apply(lambda a: doc(a[0], a[1]))


POD_IDENTITY_TRUST = json.dumps(
    policy_document(
        {
            "Effect": "Allow",
            "Principal": {"Service": "pods.eks.amazonaws.com"},
            "Action": ["sts:AssumeRole", "sts:TagSession"],
        }
    )
)


def managed_policy_arn(name: str) -> str:
    return f"arn:aws:iam::aws:policy/{name}"


# -- KMS keys ---------------------------------------------------------------------------------


@dataclass
class KeysArgs:
    ctx: StackContext
    identity: Identity


class Keys(pulumi.ComponentResource):
    """Customer-managed keys, one per purpose so a grant on one never reaches the others:
    `eks` (Kubernetes secrets), `data` (S3 bucket, FSx), `ops` (CloudWatch Logs, SNS)."""

    eks: aws.kms.Key
    data_key_arn: pulumi.Output[str]
    ops: aws.kms.Key

    def __init__(self, name: str, args: KeysArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:identity:Keys", name, None, opts)
        self.args, self.prefix = args, name
        ctx = args.ctx
        self.eks = self._key("eks", "EKS secrets envelope encryption", [])
        self.ops = self._key(
            "ops",
            "CloudWatch Logs and SNS alarm topic",
            [
                {
                    "Sid": "CloudWatchLogs",
                    "Effect": "Allow",
                    "Principal": {"Service": f"logs.{ctx.region}.amazonaws.com"},
                    "Action": list(KMS_USE_ACTIONS),
                    "Resource": "*",
                    "Condition": {
                        "ArnLike": {
                            "kms:EncryptionContext:aws:logs:arn": pulumi.Output.concat(
                                "arn:aws:logs:", ctx.region, ":", ctx.account_id, ":log-group:*"
                            )
                        }
                    },
                },
                {
                    "Sid": "CloudWatchAlarmsToEncryptedTopic",
                    "Effect": "Allow",
                    "Principal": {"Service": "cloudwatch.amazonaws.com"},
                    "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
                    "Resource": "*",
                },
            ],
        )
        if args.identity.kms_key_arn:  # a key the organisation already manages
            self.data_key_arn = pulumi.Output.from_input(args.identity.kms_key_arn)
        else:
            self.data_key_arn = self._key("data", "Training data and checkpoints (S3, FSx)", []).arn
        self.arns = {"eks": self.eks.arn, "data": self.data_key_arn, "ops": self.ops.arn}
        self.register_outputs(dict(self.arns))

    def _key(self, purpose: str, description: str, service_statements: list[dict]) -> aws.kms.Key:
        a, ctx = self.args, self.args.ctx
        account_root = pulumi.Output.concat("arn:aws:iam::", ctx.account_id, ":root")
        policy = pulumi.Output.json_dumps(
            policy_document(
                # In a key policy the resource "*" is the key itself; AWS accepts nothing else there.
                {
                    "Sid": "AccountAdministersAndDelegatesToIam",
                    "Effect": "Allow",
                    "Principal": {"AWS": account_root},
                    "Action": list(KMS_ACCOUNT_ACTIONS),
                    "Resource": "*",
                },
                *service_statements,
            )
        )
        key = aws.kms.Key(
            f"{self.prefix}-{purpose}",
            description=f"supernode {ctx.stack}: {description}",
            enable_key_rotation=a.identity.kms_key_rotation,
            deletion_window_in_days=30,
            policy=policy,
            tags=ctx.tagged(),
            opts=pulumi.ResourceOptions(parent=self),
        )
        aws.kms.Alias(
            f"{self.prefix}-{purpose}",
            name=f"alias/supernode-{ctx.stack}-{purpose}",
            target_key_id=key.key_id,
            opts=pulumi.ResourceOptions(parent=self),
        )
        return key


# -- node role --------------------------------------------------------------------------------


class NodeRole(pulumi.ComponentResource):
    """The EC2 role of every node: the four managed policies EKS nodes need, nothing else."""

    def __init__(self, name: str, ctx: StackContext, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:identity:NodeRole", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.role = aws.iam.Role(
            name,
            assume_role_policy=assume_role_policy("ec2.amazonaws.com"),
            description="EKS worker nodes (GPU and system)",
            tags=ctx.tagged(),
            opts=child,
        )
        for policy in NODE_MANAGED_POLICIES:
            aws.iam.RolePolicyAttachment(
                f"{name}-{policy}", role=self.role.name, policy_arn=managed_policy_arn(policy), opts=child
            )
        self.arn = self.role.arn
        self.register_outputs({"arn": self.arn})


# -- trainer role -----------------------------------------------------------------------------


def pretrained_statements(init_from: str | None) -> list[dict[str, Any]]:
    """What the trainer pod's init container needs to fetch an s3:// `training.initFrom`
    (supernode.trainer.hf.fetch: one listing of the prefix, then its objects), in whichever bucket
    it is: list that bucket only under that prefix, read only that prefix's objects. None for a
    local or FSx path. A bucket encrypted with another account's key must also grant this role
    kms:Decrypt on that key: its owner's to give, not this stack's."""
    if not init_from or not init_from.startswith("s3://"):
        return []
    bucket, _, prefix = init_from.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""  # as fetch lists it
    return [
        {
            "Sid": "ListPretrained",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": f"arn:aws:s3:::{bucket}",
            "Condition": {"StringLike": {"s3:prefix": [prefix, f"{prefix}*"]}},
        },
        {
            "Sid": "ReadPretrained",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": f"arn:aws:s3:::{bucket}/{prefix}*",
        },
    ]


def trainer_policy(
    bucket_arn: str, storage: StorageConfig, data_key_arn: str, init_from: str | None = None
) -> dict[str, Any]:
    """Read the dataset prefix, read/write the checkpoint prefix, use the data key, read an s3://
    training.initFrom (`pretrained_statements`): nothing else."""
    ds, ck = storage.dataset_prefix, storage.checkpoint_prefix
    return policy_document(
        {
            "Sid": "ListOwnPrefixes",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": [ds, f"{ds}*", ck, f"{ck}*"]}},
        },
        {"Sid": "ReadDataset", "Effect": "Allow", "Action": "s3:GetObject", "Resource": f"{bucket_arn}/{ds}*"},
        {
            "Sid": "ReadWriteCheckpoints",
            "Effect": "Allow",
            "Action": [
                "s3:GetObject",
                "s3:PutObject",
                "s3:DeleteObject",
                "s3:AbortMultipartUpload",
                "s3:ListMultipartUploadParts",
            ],
            "Resource": f"{bucket_arn}/{ck}*",
        },
        {
            "Sid": "UseDataKey",
            "Effect": "Allow",
            "Action": ["kms:Decrypt", "kms:GenerateDataKey", "kms:DescribeKey"],
            "Resource": data_key_arn,
        },
        *pretrained_statements(init_from),
    )


def checkpoint_retention_policy(
    bucket_arn: str, checkpoint_prefix: str, data_key_arn: str, region: str
) -> dict[str, Any]:
    """`supernode checkpoints --retain` in the cluster (operations.py's CronJob): it lists the checkpoint
    prefix, reads each step's COMPLETE marker (is the step whole?) and each run's run.json (its
    identity), reads and writes the retention tag of the checkpoint objects, and nothing else: no
    GetObject on the checkpoints' data, no PutObject or DeleteObject (the lifecycle rules expire), and
    the data key only to decrypt those small files, only through S3."""
    ck = checkpoint_prefix
    return policy_document(
        {
            "Sid": "ListCheckpoints",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": [ck, f"{ck}*"]}},
        },
        {
            "Sid": "ReadMarkersAndRunIdentities",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": [f"{bucket_arn}/{ck}*/COMPLETE", f"{bucket_arn}/{ck}*/run.json"],
        },
        {
            "Sid": "TagCheckpoints",
            "Effect": "Allow",
            "Action": ["s3:GetObjectTagging", "s3:PutObjectTagging"],
            "Resource": f"{bucket_arn}/{ck}*",
        },
        {
            "Sid": "DecryptMarkersThroughS3",
            "Effect": "Allow",
            "Action": "kms:Decrypt",
            "Resource": data_key_arn,
            "Condition": {"StringEquals": {"kms:ViaService": f"s3.{region}.amazonaws.com"}},
        },
    )


@dataclass
class TrainerRoleArgs:
    ctx: StackContext
    identity: Identity
    storage: StorageConfig
    namespace: str
    service_account: str
    cluster_name: pulumi.Input[str]
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer_url: pulumi.Input[str]
    bucket_arn: pulumi.Input[str]
    data_key_arn: pulumi.Input[str]
    init_from: str | None = None  # training.initFrom: an s3:// one is read by the pods' init container
    # The teams' namespaces (supernode:teams): their jobs' pods run as the same account there.
    team_namespaces: Sequence[str] = ()


class TrainerRole(pulumi.ComponentResource):
    """The trainer pods' AWS identity: IRSA or EKS Pod Identity, per `identity.podIdentity`."""

    def __init__(self, name: str, args: TrainerRoleArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:identity:TrainerRole", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        pod_identity = args.identity.pod_identity == "pod-identity"
        trust = (
            POD_IDENTITY_TRUST
            if pod_identity
            else irsa_trust_policy(
                args.oidc_provider_arn,
                args.oidc_issuer_url,
                [args.namespace, *args.team_namespaces],
                args.service_account,
            )
        )
        self.role = aws.iam.Role(
            name,
            assume_role_policy=trust,
            tags=args.ctx.tagged(),
            description=f"supernode {args.ctx.stack} trainer pods",
            opts=child,
        )
        self.policy = pulumi.Output.all(args.bucket_arn, args.data_key_arn).apply(
            lambda a: json.dumps(trainer_policy(a[0], args.storage, a[1], args.init_from))
        )
        aws.iam.RolePolicy(f"{name}-data", role=self.role.id, policy=self.policy, opts=child)
        if pod_identity:
            for namespace in (args.namespace, *args.team_namespaces):
                aws.eks.PodIdentityAssociation(
                    name if namespace == args.namespace else f"{name}-{namespace}",
                    cluster_name=args.cluster_name,
                    namespace=namespace,
                    service_account=args.service_account,
                    role_arn=self.role.arn,
                    tags=args.ctx.tagged(),
                    opts=child,
                )
        self.arn = self.role.arn
        self.register_outputs({"arn": self.arn})


# -- service-account roles of the cluster's agents ---------------------------------------------


def metrics_agent_policy(log_group_arn: str) -> dict[str, Any]:
    """The CloudWatch agent's Prometheus scrape (cwagent-prometheus): it writes the scraped series as
    embedded-metric-format log events into the Prometheus log group and CloudWatch Logs extracts the
    metrics from them (the agent's awsemf exporter), so it creates streams and puts events there and
    nothing else: no cloudwatch:PutMetricData (no metric goes through that API), no CreateLogGroup
    (Monitoring creates the group, with its retention and key)."""
    return policy_document(
        {
            "Sid": "WriteEmfEvents",
            "Effect": "Allow",
            "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
            "Resource": [log_group_arn, f"{log_group_arn}:log-stream:*"],
        }
    )


def node_health_agent_policy(region: str, account_id: str, cluster_name: str, node_groups: list[str]) -> dict[str, Any]:
    """The node health agent (supernode.trainer.node.agent) replaces a broken GPU node: it terminates the
    instance in its Auto Scaling group without decrementing the desired capacity, so the group launches a
    new one. Only that action, only on the stack's GPU node groups' groups: EKS names a managed node
    group's Auto Scaling group eks-<node group>-<uuid> and tags it eks:cluster-name and
    eks:nodegroup-name, and the conditions hold even if a group of another cluster shares the name.
    No Describe call: the agent reads the instance id from the Node's spec.providerID."""
    return policy_document(
        {
            "Sid": "ReplaceGpuNodes",
            "Effect": "Allow",
            "Action": ["autoscaling:TerminateInstanceInAutoScalingGroup"],
            "Resource": [
                f"arn:aws:autoscaling:{region}:{account_id}:autoScalingGroup:*:autoScalingGroupName/eks-{group}-*"
                for group in node_groups
            ],
            "Condition": {
                "StringEquals": {
                    "aws:ResourceTag/eks:cluster-name": cluster_name,
                    "aws:ResourceTag/eks:nodegroup-name": node_groups,
                }
            },
        }
    )


@dataclass
class ServiceAccountRoleArgs:
    ctx: StackContext
    namespace: str
    service_account: str
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer_url: pulumi.Input[str]
    policy: pulumi.Input[str]  # the one inline policy (JSON)
    description: str


class ServiceAccountRole(pulumi.ComponentResource):
    """The IAM role of one Kubernetes service account (IRSA, as the CloudWatch add-on's agent), with
    one inline policy."""

    def __init__(self, name: str, args: ServiceAccountRoleArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:identity:ServiceAccountRole", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.role = aws.iam.Role(
            name,
            description=args.description,
            tags=args.ctx.tagged(),
            opts=child,
            assume_role_policy=irsa_trust_policy(
                args.oidc_provider_arn, args.oidc_issuer_url, args.namespace, args.service_account
            ),
        )
        aws.iam.RolePolicy(name, role=self.role.id, policy=args.policy, opts=child)
        self.arn = self.role.arn
        self.register_outputs({"arn": self.arn})
