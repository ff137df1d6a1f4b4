"""EKS cluster: pinned version, endpoint access per config, KMS secrets encryption, control-plane
logging, IRSA OIDC provider, pinned core add-ons (issue 3, part 2)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from supernode.core import teams as team_names
from supernode.core.catalog import EKS_ADDON_VERSIONS
from supernode.core.config import ClusterConfig, Team

from ..context import StackContext
from .identity import assume_role_policy, managed_policy_arn

CONTROL_PLANE_LOGS = ["api", "audit", "authenticator", "controllerManager", "scheduler"]
# Pinned core add-ons in two waves: nodes need the first to join and get pod networking; the
# second runs pods, so it waits for the node groups. amazon-cloudwatch-observability is monitoring's.
NODE_ADDONS = ("vpc-cni", "kube-proxy", "eks-pod-identity-agent")
WORKLOAD_ADDONS = ("coredns", "aws-fsx-csi-driver", "eks-node-monitoring-agent")
SERVICE_CIDR = "172.20.0.0/16"  # fixed so nodeadm's NodeConfig can state it


def kubeconfig(name: str, endpoint: str, ca_data: str, region: str) -> str:
    """A kubeconfig (JSON is valid YAML) that authenticates with `aws eks get-token`."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": name,
            "clusters": [{"name": name, "cluster": {"server": endpoint, "certificate-authority-data": ca_data}}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
            "users": [
                {
                    "name": name,
                    "user": {
                        "exec": {
                            "apiVersion": "client.authentication.k8s.io/v1beta1",
                            "command": "aws",
                            "args": [
                                "eks",
                                "get-token",
                                "--cluster-name",
                                name,
                                "--region",
                                region,
                                "--output",
                                "json",
                            ],
                        }
                    },
                }
            ],
        }
    )


@dataclass
class ClusterArgs:
    ctx: StackContext
    cluster_name: str
    cluster: ClusterConfig
    subnet_ids: Sequence[pulumi.Input[str]]
    secrets_kms_key_arn: pulumi.Input[str]
    logs_kms_key_arn: pulumi.Input[str]
    log_retention_days: int


class Cluster(pulumi.ComponentResource):
    name: str
    endpoint: pulumi.Output[str]
    certificate_authority: pulumi.Output[str]
    oidc_issuer_url: pulumi.Output[str]
    oidc_provider_arn: pulumi.Output[str]
    security_group_id: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]  # secret

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:cluster:Cluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        cfg, tags = args.cluster, args.ctx.tagged()
        self.name, self.version, self._addon_prefix = args.cluster_name, cfg.kubernetes_version, name
        self.addon_versions = EKS_ADDON_VERSIONS[cfg.kubernetes_version]

        role = aws.iam.Role(
            f"{name}-control-plane", assume_role_policy=assume_role_policy("eks.amazonaws.com"), tags=tags, opts=child
        )
        attachment = aws.iam.RolePolicyAttachment(
            f"{name}-control-plane", role=role.name, policy_arn=managed_policy_arn("AmazonEKSClusterPolicy"), opts=child
        )
        # EKS writes control-plane logs to this fixed name; creating it first sets retention and KMS.
        log_group = aws.cloudwatch.LogGroup(
            f"{name}-control-plane",
            name=f"/aws/eks/{args.cluster_name}/cluster",
            retention_in_days=args.log_retention_days,
            kms_key_id=args.logs_kms_key_arn,
            tags=tags,
            opts=child,
        )
        self.log_group_name = log_group.name
        self.cluster = aws.eks.Cluster(
            name,
            name=args.cluster_name,
            version=cfg.kubernetes_version,
            role_arn=role.arn,
            vpc_config=aws.eks.ClusterVpcConfigArgs(
                subnet_ids=list(args.subnet_ids),
                endpoint_private_access=cfg.endpoint_private_access,
                endpoint_public_access=cfg.endpoint_public_access,
                public_access_cidrs=cfg.public_access_cidrs if cfg.endpoint_public_access else None,
            ),
            encryption_config=aws.eks.ClusterEncryptionConfigArgs(
                resources=["secrets"],
                provider=aws.eks.ClusterEncryptionConfigProviderArgs(key_arn=args.secrets_kms_key_arn),
            ),
            enabled_cluster_log_types=CONTROL_PLANE_LOGS,
            access_config=aws.eks.ClusterAccessConfigArgs(
                authentication_mode="API", bootstrap_cluster_creator_admin_permissions=True
            ),
            kubernetes_network_config=aws.eks.ClusterKubernetesNetworkConfigArgs(service_ipv4_cidr=SERVICE_CIDR),
            # Add-ons are installed below at pinned versions, not the unmanaged defaults.
            bootstrap_self_managed_addons=False,
            upgrade_policy=aws.eks.ClusterUpgradePolicyArgs(support_type="STANDARD"),
            tags=tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[attachment, log_group]),
        )

        self.endpoint = self.cluster.endpoint
        self.certificate_authority = self.cluster.certificate_authority.data
        self.security_group_id = self.cluster.vpc_config.cluster_security_group_id
        self.oidc_issuer_url = self.cluster.identities[0].oidcs[0].issuer
        oidc = aws.iam.OpenIdConnectProvider(
            name, url=self.oidc_issuer_url, client_id_lists=["sts.amazonaws.com"], tags=tags, opts=child
        )
        self.oidc_provider_arn = oidc.arn
        self.kubeconfig = pulumi.Output.secret(
            pulumi.Output.all(self.cluster.name, self.endpoint, self.certificate_authority).apply(
                lambda a: kubeconfig(a[0], a[1], a[2], args.ctx.region)
            )
        )
        self.register_outputs(
            {"name": self.cluster.name, "endpoint": self.endpoint, "oidc_provider_arn": self.oidc_provider_arn}
        )

    def install_addons(self, names: Sequence[str], depends_on: Sequence[pulumi.Resource] = ()) -> list[aws.eks.Addon]:
        return [self.addon(addon, depends_on=depends_on) for addon in names]

    def addon(
        self,
        addon: str,
        service_account_role_arn: pulumi.Input[str] | None = None,
        depends_on: Sequence[pulumi.Resource] = (),
        parent: pulumi.Resource | None = None,
        configuration_values: str | None = None,
    ) -> aws.eks.Addon:
        return aws.eks.Addon(
            f"{self._addon_prefix}-{addon}",
            cluster_name=self.cluster.name,
            addon_name=addon,
            addon_version=self.addon_versions[addon],
            service_account_role_arn=service_account_role_arn,
            configuration_values=configuration_values,
            resolve_conflicts_on_create="OVERWRITE",
            resolve_conflicts_on_update="PRESERVE",
            opts=pulumi.ResourceOptions(parent=parent or self, depends_on=list(depends_on)),
        )


@dataclass
class TeamAccessArgs:
    ctx: StackContext
    cluster_name: pulumi.Input[str]
    teams: Sequence[Team]  # supernode:teams: each one's IAM role (principal)


class TeamAccess(pulumi.ComponentResource):
    """Each team's IAM role reaches the cluster as the team's Kubernetes group (supernode.core.teams.group)
    and nothing more: an EKS access entry of type STANDARD with that group and no access policy, so what
    the group may do is exactly the RBAC bound to it (components/k8s/teams.py: its own namespace only)."""

    def __init__(self, name: str, args: TeamAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:cluster:TeamAccess", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.entries = [
            aws.eks.AccessEntry(
                f"{name}-{t.name}",
                cluster_name=args.cluster_name,
                principal_arn=t.principal,
                kubernetes_groups=[team_names.group(t.name)],
                type="STANDARD",
                tags=args.ctx.tagged(),
                opts=child,
            )
            for t in args.teams
        ]
        self.register_outputs({"groups": {t.principal: team_names.group(t.name) for t in args.teams}})
