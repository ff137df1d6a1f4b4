"""Checklist item 10 for the management page (issue 37, item 2; components/aws/management.py and
components/k8s/management_ui.py): its load balancer is internal and admits only the configured ranges,
its listeners are HTTPS with authentication (a plain-HTTP listener only as a redirect to HTTPS), and its
identities, IAM and Kubernetes, have least privilege.

The checks read every load balancer and listener of the stack, not only the page's: any other load
balancer would have to meet the same bar. `allowedCidrs` comes from supernode:management.allowedCidrs
(`supernode preview` passes it, as a `--policy-pack-config` file would).
"""

from __future__ import annotations

import ipaddress
import re

from pydantic import Field

from supernode.core.resource_types import (
    CLUSTER_ROLE,
    CLUSTER_ROLE_BINDING,
    IAM_ROLE,
    IAM_ROLE_POLICY,
    LB_LISTENER,
    LOAD_BALANCER,
    ROLE_BINDING,
    SECURITY_GROUP,
    SG_INGRESS,
    SG_RULE,
)
from supernode.core.teams import NAMESPACE_PREFIX as TEAM_PREFIX

from .base import Registry, Report
from .settings import PolicySettings
from .view import OPEN_CIDRS, Res, Stack, as_list, get, is_true, items, json_doc, statements

POLICIES = Registry()

# TLS 1.2 and newer only (ELB's predefined policies); anything older admits TLS 1.0/1.1.
TLS_POLICIES = (
    "ELBSecurityPolicy-TLS13-1-2-2021-06",
    "ELBSecurityPolicy-TLS13-1-2-Res-2021-06",
    "ELBSecurityPolicy-TLS13-1-3-2021-06",
    "ELBSecurityPolicy-TLS-1-2-2017-01",
    "ELBSecurityPolicy-TLS-1-2-Ext-2018-06",
)
AUTHENTICATE = ("authenticate-oidc", "authenticate-cognito")
UI_SUBJECT = "system:serviceaccount:supernode-management:management-ui"  # components/k8s/management_ui.py
UI_ACTIONS = {"logs:CreateLogStream", "logs:PutLogEvents"}
UI_CLUSTER_ROLE = "supernode-management-ui"
UI_NODES_ROLE = "supernode-management-ui-nodes"  # its nodes page: exactly `list nodes`, cluster-wide
UI_NODES_GRANT = {("", "nodes", "list")}
# One named log group, or its streams: never a wildcard in the group's name.
AUDIT_RESOURCE = re.compile(r"^arn:aws[a-z-]*:logs:[a-z0-9-]+:\d{12}:log-group:[^*:]+(:log-stream:\*)?$")


class ManagementRanges(PolicySettings):
    allowed_cidrs: list[str] = Field(
        default=[],
        description="the ranges a load balancer may admit (supernode:management.allowedCidrs); none: every "
        "CIDR ingress to a load balancer fails",
    )


def _within(cidr: str, allowed: list[str]) -> bool:
    try:
        net = ipaddress.ip_network(cidr, strict=False)
        return any(net.version == a.version and net.subnet_of(a) for a in (ipaddress.ip_network(x) for x in allowed))
    except ValueError:
        return False


def _ingress_sources(stack: Stack, sg: Res) -> list[tuple[Res, str | None, object]]:
    """(resource, CIDR or None, port) of every ingress to `sg`: its inline rules and the rule resources on it."""
    out: list[tuple[Res, str | None, object]] = []
    for rule in items(sg.get("ingress")):
        for cidr in items(get(rule, "cidrBlocks")) + items(get(rule, "ipv6CidrBlocks")):
            out.append((sg, cidr, get(rule, "fromPort")))
    for r in stack.attached(sg, (SG_INGRESS, SG_RULE)):
        if r.type == SG_RULE and r.get("type") != "ingress":
            continue
        # A rule that only references `sg` as its source (the nodes' rule admitting the load balancer)
        # sits on another group: its CIDR fields are empty and it says nothing of who reaches `sg`.
        cidrs = [r.get("cidrIpv4"), r.get("cidrIpv6"), *items(r.get("cidrBlocks")), *items(r.get("ipv6CidrBlocks"))]
        for cidr in (c for c in cidrs if c):
            out.append((r, cidr, r.get("fromPort")))
        if r.get("prefixListId"):
            out.append((r, f"prefix list {r.get('prefixListId')}", r.get("fromPort")))
    return out


@POLICIES.stack(
    "lb-ingress-allowed-cidrs",
    10,
    "Every load balancer is internal and its security groups admit only management.allowedCidrs.",
    settings=ManagementRanges,
)
def _lb_ingress(stack: Stack, conf: ManagementRanges, report: Report) -> None:
    groups = stack.of(SECURITY_GROUP)
    for lb in stack.of(LOAD_BALANCER):
        if not is_true(lb.get("internal")):
            report(
                lb, f"{lb.label} is internet-facing. Fix: internal true (the page is reached from the VPC's ranges)."
            )
        mine = [sg for sg in groups if stack.depends_on(lb, sg)]
        if not mine:
            report(lb, f"{lb.label} has no security group of the stack: its ingress is unchecked. Fix: securityGroups.")
        for sg in mine:
            for res, cidr, port in _ingress_sources(stack, sg):
                if cidr in OPEN_CIDRS or not _within(str(cidr), conf.allowed_cidrs):
                    report(
                        res,
                        f"{res.label} admits {cidr} (port {port}) to {lb.label}, outside management.allowedCidrs "
                        f"{conf.allowed_cidrs}. Fix: admit only supernode:management.allowedCidrs (never 0.0.0.0/0 "
                        "or ::/0).",
                    )


def _redirects_to_https(actions: list) -> bool:
    return bool(actions) and all(
        get(a, "type") == "redirect" and get(a, "redirect", "protocol") == "HTTPS" for a in actions
    )


@POLICIES.resource(
    "lb-listener-https-authenticated",
    10,
    "Load balancer listeners are HTTPS (TLS 1.2+, a certificate) and authenticate before forwarding; "
    "plain HTTP only redirects to HTTPS.",
    (LB_LISTENER,),
)
def _listener(res: Res, _conf: None, report: Report) -> None:
    actions = sorted(items(res.get("defaultActions")), key=lambda a: get(a, "order", default=0) or 0)
    protocol = res.get("protocol")
    if protocol == "HTTP" and _redirects_to_https(actions):
        return
    if protocol != "HTTPS":
        report(res, f"{res.label} listens on {protocol}: not TLS. Fix: protocol HTTPS (or an HTTP redirect to HTTPS).")
        return
    if not res.get("certificateArn"):
        report(res, f"{res.label} has no certificate. Fix: certificateArn (management.ui.certificateArn).")
    if res.get("sslPolicy") not in TLS_POLICIES:
        report(
            res, f"{res.label} ssl policy {res.get('sslPolicy')!r} admits TLS below 1.2. Fix: one of {TLS_POLICIES}."
        )
    kinds = [get(a, "type") for a in actions]
    forwards = [i for i, k in enumerate(kinds) if k == "forward"]
    if forwards and not any(k in AUTHENTICATE for k in kinds[: forwards[0]]):
        report(
            res,
            f"{res.label} forwards without authenticating first (actions {kinds}). Fix: an authenticate-oidc "
            "action (management.ui.oidc) before the forward.",
        )


def _is_ui_role(role: Res) -> bool:
    trust = statements(json_doc(role.get("assumeRolePolicy")))
    return any(UI_SUBJECT in as_list(v) for st in trust for v in (get(st, "Condition", "StringEquals") or {}).values())


def _rbac_problems(stack: Stack) -> list[tuple[Res, str]]:
    """The page's ClusterRole: no wildcard, no secrets; bound only by RoleBindings in team namespaces."""
    out = []
    for role in (r for r in stack.of(CLUSTER_ROLE) if r.get("metadata", "name") == UI_CLUSTER_ROLE):
        for rule in items(role.get("rules")):
            verbs, resources = items(get(rule, "verbs")), items(get(rule, "resources"))
            if "*" in verbs or "*" in resources or "secrets" in resources:
                out.append((role, f"{role.label} grants {verbs} on {resources}: a wildcard or secrets"))
    for b in stack.of(ROLE_BINDING, CLUSTER_ROLE_BINDING):
        if b.get("roleRef", "name") != UI_CLUSTER_ROLE:
            continue
        ns = str(b.get("metadata", "namespace", default=""))
        if b.type == CLUSTER_ROLE_BINDING or not ns.startswith(TEAM_PREFIX):
            out.append((b, f"{b.label} binds {UI_CLUSTER_ROLE} beyond the team namespaces ({ns or 'cluster-wide'})"))
    return out + _nodes_role_problems(stack)


def _nodes_role_problems(stack: Stack) -> list[tuple[Res, str]]:
    """The nodes page's ClusterRole grants `list nodes` and nothing else (it is bound cluster-wide)."""
    out = []
    for role in (r for r in stack.of(CLUSTER_ROLE) if r.get("metadata", "name") == UI_NODES_ROLE):
        granted = {
            (g, r, v)
            for rule in items(role.get("rules"))
            for g in items(get(rule, "apiGroups"))
            for r in items(get(rule, "resources"))
            for v in items(get(rule, "verbs"))
        }
        if granted - UI_NODES_GRANT:
            out.append((role, f"{role.label} grants {sorted(granted - UI_NODES_GRANT)}: more than listing the nodes"))
    return out


@POLICIES.stack(
    "management-ui-least-privilege",
    10,
    "The management page's IAM role only writes its audit log group; its Kubernetes role reaches only the "
    "teams' namespaces, without wildcards or secrets; its nodes role only lists the nodes.",
)
def _ui_role(stack: Stack, _conf: None, report: Report) -> None:
    for role in (r for r in stack.of(IAM_ROLE) if _is_ui_role(r)):
        for policy in stack.attached(role, (IAM_ROLE_POLICY,)):
            for st in statements(json_doc(policy.get("policy"))):
                if st.get("Effect") != "Allow":
                    continue
                actions, resources = as_list(st.get("Action")), as_list(st.get("Resource"))
                extra = sorted(set(actions) - UI_ACTIONS) + (["NotAction"] if st.get("NotAction") else [])
                wide = [r for r in resources if not AUDIT_RESOURCE.fullmatch(str(r))]
                if extra or wide or st.get("NotResource"):
                    report(
                        policy,
                        f"{policy.label} of the management page's role allows {actions} on {resources}: more "
                        f"than writing its audit log group. Fix: only {sorted(UI_ACTIONS)} on the audit log group "
                        "and its streams (components/aws/management.py).",
                    )
    for res, problem in _rbac_problems(stack):
        fix = "the verbs ClusterBackend calls (components/k8s/management_ui.py UI_RULES, NODE_RULES)"
        report(res, f"{problem}. Fix: {fix}.")
