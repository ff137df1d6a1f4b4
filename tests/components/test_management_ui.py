"""The management page's cluster objects through the real prod program (issue 37, item 2): valid against the
Kubernetes schemas like every manifest; the RBAC exactly the requests the cluster backend makes, bound in
the teams' namespaces only; the Service's NodePort the target group's; the NetworkPolicy admitting the
load balancer's subnets only; the Deployment trusting this stack's load balancer; the IRSA role writing
the audit log group only. A stack without management.ui has none of it."""

from __future__ import annotations

import json

import pytest
from aws_preview import policy, preview, statements

from supernode.components.aws import management as lb
from supernode.components.k8s import management_ui as mui
from supernode.core import resource_types as T
from supernode.tools import manifests as mf

pytestmark = pytest.mark.slow  # the Pulumi program under the mock engine


@pytest.fixture(scope="module")
def prod():
    return preview("prod")


@pytest.fixture(scope="module")
def objects(prod):
    return [m for m in mf.from_resources(prod.result.resources) if _is_ui(m)]


def _is_ui(m: dict) -> bool:
    md = m["metadata"]
    return md.get("namespace") == mui.NAMESPACE or md["name"] in (
        mui.NAMESPACE,
        f"supernode-{mui.NAME}",
        mui.NODES_ROLE,
    )


def one(objects: list[dict], kind: str) -> dict:
    [m] = [m for m in objects if m["kind"] == kind]
    return m


def test_the_page_objects_validate_and_a_bad_one_is_caught(prod, objects):
    kinds = sorted({m["kind"] for m in objects})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "Deployment",
        "Namespace",
        "NetworkPolicy",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    version = prod.cfg.cluster.kubernetes_version
    assert mf.validate(objects, version) == []
    bad = json.loads(json.dumps(one(objects, "Service")))
    bad["spec"]["ports"][0]["nodePort"] = "30443"  # a string where the schema wants an integer
    assert mf.validate([bad], version) != []


def test_rbac_is_the_cluster_backends_requests_in_the_team_namespaces_only(objects):
    [role] = [m for m in objects if m["kind"] == "ClusterRole" and m["metadata"]["name"] == f"supernode-{mui.NAME}"]
    granted = {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    # supernode.tools.jobs_cluster: apply (PATCH) the job, its ConfigMap and NetworkPolicy; GET/LIST jobs;
    # LIST workloads and pods; GET pending workloads and rank 0's log; DELETE the job and its pods.
    assert granted == {
        ("kubeflow.org", "pytorchjobs", "get"),
        ("kubeflow.org", "pytorchjobs", "list"),
        ("kubeflow.org", "pytorchjobs", "patch"),
        ("kubeflow.org", "pytorchjobs", "delete"),
        ("", "configmaps", "patch"),
        ("networking.k8s.io", "networkpolicies", "patch"),
        ("", "pods", "list"),
        ("", "pods", "delete"),
        ("", "pods/log", "get"),
        ("kueue.x-k8s.io", "workloads", "list"),
        ("visibility.kueue.x-k8s.io", "localqueues/pendingworkloads", "get"),
    }
    bindings = [m for m in objects if m["kind"].endswith("Binding")]
    assert sorted((b["kind"], b["metadata"].get("namespace", "")) for b in bindings) == [
        ("ClusterRoleBinding", ""),  # the nodes page's role only (below)
        ("RoleBinding", "team-platform"),
        ("RoleBinding", "team-research"),
    ]
    assert all(
        b["subjects"] == [{"kind": "ServiceAccount", "name": mui.NAME, "namespace": mui.NAMESPACE}] for b in bindings
    )
    # Nodes are cluster-scoped (ClusterBackend.nodes lists them): a role granting exactly that, bound cluster-wide
    [wide] = [b for b in bindings if b["kind"] == "ClusterRoleBinding"]
    assert wide["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": mui.NODES_ROLE}
    [nodes] = [m for m in objects if m["kind"] == "ClusterRole" and m["metadata"]["name"] == mui.NODES_ROLE]
    assert nodes["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]


def test_the_service_and_network_policy_admit_only_the_load_balancer(prod, objects):
    svc = one(objects, "Service")["spec"]
    assert svc["type"] == "NodePort" and svc["externalTrafficPolicy"] == "Local"
    [port] = svc["ports"]
    target_group = prod.one(T.LB_TARGET_GROUP).inputs
    assert port["nodePort"] == target_group["port"] == lb.NODE_PORT and port["targetPort"] == mui.PORT
    assert target_group["healthCheck"]["path"] == lb.HEALTH_PATH
    netpol = one(objects, "NetworkPolicy")["spec"]
    [ingress] = netpol["ingress"]
    assert [b["ipBlock"]["cidr"] for b in ingress["from"]] == prod.cfg.network.private_subnet_cidrs
    assert ingress["ports"] == [{"port": mui.PORT}]
    assert netpol["podSelector"]["matchLabels"] == one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]


def test_the_deployment_runs_the_cluster_mode_trusting_this_stacks_load_balancer(prod, objects):
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["image"] == prod.cfg.images.trainer and c["command"][:3] == ["supernode", "ui", "--cluster"]
    args = dict(zip(c["args"][::2], c["args"][1::2]))
    assert args["--signer"] == prod.one(T.LOAD_BALANCER).outputs["arn"]
    assert args["--audit-log-group"] == "/supernode/prod/management-audit"
    assert c["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
    sa = one(objects, "ServiceAccount")
    role = next(r for r in prod.all(T.IAM_ROLE) if r.name == "management-ui-role")
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == role.outputs["arn"]
    trust = json.loads(role.inputs["assumeRolePolicy"])["Statement"][0]["Condition"]["StringEquals"]
    assert f"system:serviceaccount:{mui.NAMESPACE}:{mui.NAME}" in trust.values()
    [st] = statements(policy(next(r for r in prod.all(T.IAM_ROLE_POLICY) if r.name == "management-ui-role")))
    audit_arn = next(r for r in prod.all(T.LOG_GROUP) if r.name == "management-audit").outputs["arn"]
    assert st["Action"] == ["logs:CreateLogStream", "logs:PutLogEvents"]
    assert st["Resource"] == [audit_arn, f"{audit_arn}:log-stream:*"]


def test_a_stack_without_the_page_has_none_of_it():
    dev = preview("dev")
    assert dev.cfg.management.ui is None
    assert not dev.all(T.LOAD_BALANCER) and not dev.all(T.LB_LISTENER)
    assert not [m for m in mf.from_resources(dev.result.resources) if _is_ui(m)]
