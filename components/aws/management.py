"""The management page's AWS side (issue 37, item 2): an internal Application Load Balancer in the private
subnets, reachable only from `management.allowedCidrs`, HTTPS only with the ACM certificate, people
authenticated by the organisation's OIDC provider (the listener's authenticate-oidc action) before any
request reaches the page; the audit log group of every submit and cancel, and the page's IRSA policy.

Why an ALB declared here rather than an Ingress: the stack installs no AWS Load Balancer Controller
(components/addons/ has none), and a controller would need broad EC2/ELB rights of its own; the ALB,
its security group, listener and target group are a handful of resources the policy pack reads
directly (policies/management.py). The targets are the system nodes (their Auto Scaling group is
attached to the target group) on the page Service's fixed NodePort; `externalTrafficPolicy: Local`
keeps the load balancer's address as the source the page's NetworkPolicy admits.

Why OIDC at the load balancer: the ALB does the login (code flow, session cookie) and hands the page
the person's claims in `x-amzn-oidc-data`, a JWT it signs (ES256) with a key published per region; the
page verifies that signature and the signer (this ALB's ARN), so a request that did not pass the
listener carries no identity it can forge (supernode.tools.ui_auth). The groups claim holds the same
groups the CLI's access entries map to (supernode:team:<name>, supernode:admins).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from supernode.core.config import ManagementConfig

from ..context import StackContext
from .identity import policy_document

HTTPS_PORT = 443
# The page Service's NodePort on the system nodes (components/k8s/management_ui.py): fixed, because the
# target group names it.
NODE_PORT = 30443
TLS_POLICY = "ELBSecurityPolicy-TLS13-1-2-2021-06"  # TLS 1.2 and 1.3 only
HEALTH_PATH = "/healthz"  # answered without an identity (the load balancer's health check)


def audit_writer_policy(log_group_arn: str) -> dict[str, Any]:
    """The page's IRSA role: one JSON record per submit or cancel into the audit log group, nothing else
    (no CreateLogGroup: the stack creates the group with its retention and key)."""
    return policy_document(
        {
            "Sid": "WriteAuditRecords",
            "Effect": "Allow",
            "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
            "Resource": [log_group_arn, f"{log_group_arn}:log-stream:*"],
        }
    )


@dataclass
class ManagementLbArgs:
    ctx: StackContext
    management: ManagementConfig  # its ui is set
    vpc_id: pulumi.Input[str]
    subnet_ids: Sequence[pulumi.Input[str]]  # the private subnets
    node_security_group_id: pulumi.Input[str]  # the system nodes' (the cluster security group)
    node_autoscaling_group: pulumi.Input[str]  # the system node group's Auto Scaling group
    logs_kms_key_arn: pulumi.Input[str]


class ManagementLb(pulumi.ComponentResource):
    """The internal ALB in front of the page, its security group, HTTPS listener and targets, and the audit
    log group."""

    def __init__(self, name: str, args: ManagementLbArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:management:ManagementLb", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        ui, tags = args.management.ui, args.ctx.tagged()
        assert ui is not None, "ManagementLb needs management.ui"
        self.security_group = self._security_group(name, args, child)
        self.load_balancer = aws.lb.LoadBalancer(
            name,
            internal=True,
            load_balancer_type="application",
            subnets=list(args.subnet_ids),
            security_groups=[self.security_group.id],
            drop_invalid_header_fields=True,  # a header the page reads cannot be smuggled past the ALB
            tags=tags,
            opts=child,
        )
        self.target_group = aws.lb.TargetGroup(
            name,
            port=NODE_PORT,
            protocol="HTTP",
            target_type="instance",
            vpc_id=args.vpc_id,
            health_check=aws.lb.TargetGroupHealthCheckArgs(path=HEALTH_PATH, port=str(NODE_PORT), matcher="200"),
            tags=tags,
            opts=child,
        )
        aws.autoscaling.Attachment(
            name,
            autoscaling_group_name=args.node_autoscaling_group,
            lb_target_group_arn=self.target_group.arn,
            opts=child,
        )
        self.listener = self._listener(name, args, child)
        self.audit_log_group = aws.cloudwatch.LogGroup(
            f"{name}-audit",
            name=f"/supernode/{args.ctx.stack}/management-audit",
            retention_in_days=ui.audit_retention_days,
            kms_key_id=args.logs_kms_key_arn,
            tags=tags,
            opts=child,
        )
        self.arn, self.dns_name = self.load_balancer.arn, self.load_balancer.dns_name
        self.register_outputs(
            {"arn": self.arn, "dns_name": self.dns_name, "audit_log_group": self.audit_log_group.name}
        )

    def _security_group(
        self, name: str, args: ManagementLbArgs, child: pulumi.ResourceOptions
    ) -> aws.ec2.SecurityGroup:
        """HTTPS in from each allowed range only; out to the nodes' NodePort and to the identity provider
        (its token and user info endpoints, over HTTPS)."""
        sg = aws.ec2.SecurityGroup(
            f"{name}-sg",
            vpc_id=args.vpc_id,
            description="supernode management page: HTTPS from management.allowedCidrs only",
            tags=args.ctx.tagged(),
            opts=child,
        )
        for i, cidr in enumerate(args.management.allowed_cidrs):
            v6 = ":" in cidr
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-https-{i}",
                security_group_id=sg.id,
                ip_protocol="tcp",
                from_port=HTTPS_PORT,
                to_port=HTTPS_PORT,
                cidr_ipv4=None if v6 else cidr,
                cidr_ipv6=cidr if v6 else None,
                description="management.allowedCidrs",
                opts=child,
            )
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-to-nodes",
            security_group_id=sg.id,
            ip_protocol="tcp",
            from_port=NODE_PORT,
            to_port=NODE_PORT,
            referenced_security_group_id=args.node_security_group_id,
            opts=child,
        )
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-to-idp",
            security_group_id=sg.id,
            ip_protocol="tcp",
            from_port=HTTPS_PORT,
            to_port=HTTPS_PORT,
            cidr_ipv4="0.0.0.0/0",
            description="the OIDC provider's token and user info endpoints",
            opts=child,
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-nodes-from-lb",
            security_group_id=args.node_security_group_id,
            ip_protocol="tcp",
            from_port=NODE_PORT,
            to_port=NODE_PORT,
            referenced_security_group_id=sg.id,
            description="the management page's NodePort, from its load balancer only",
            opts=child,
        )
        return sg

    def _listener(self, name: str, args: ManagementLbArgs, child: pulumi.ResourceOptions) -> aws.lb.Listener:
        """HTTPS only (no port 80 listener at all): log in with the provider, then forward to the page."""
        ui = args.management.ui
        oidc = ui.oidc
        secret = aws.ssm.get_parameter_output(name=oidc.client_secret_parameter, with_decryption=True)
        return aws.lb.Listener(
            f"{name}-https",
            load_balancer_arn=self.load_balancer.arn,
            port=HTTPS_PORT,
            protocol="HTTPS",
            ssl_policy=TLS_POLICY,
            certificate_arn=ui.certificate_arn,
            default_actions=[
                aws.lb.ListenerDefaultActionArgs(
                    type="authenticate-oidc",
                    order=1,
                    authenticate_oidc=aws.lb.ListenerDefaultActionAuthenticateOidcArgs(
                        issuer=oidc.issuer,
                        authorization_endpoint=oidc.authorization_endpoint,
                        token_endpoint=oidc.token_endpoint,
                        user_info_endpoint=oidc.user_info_endpoint,
                        client_id=oidc.client_id,
                        client_secret=pulumi.Output.secret(secret.value),
                        scope=oidc.scope,
                        on_unauthenticated_request="authenticate",
                    ),
                ),
                aws.lb.ListenerDefaultActionArgs(type="forward", order=2, target_group_arn=self.target_group.arn),
            ],
            tags=args.ctx.tagged(),
            opts=child,
        )
