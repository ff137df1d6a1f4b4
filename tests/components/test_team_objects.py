"""Teams on the cluster (issue 36, item 4), through the real program on prod's two teams: each team's
namespace, quota, queues and RBAC; the admin group; the EKS access entries; serving's share unchanged;
every object valid against Kubernetes and the shipped Kueue CRD schemas."""

from __future__ import annotations

import copy

import pytest
import yaml
from aws_preview import ROOT, preview

from supernode.components.k8s import queues as q
from supernode.components.k8s import teams as kt
from supernode.core import resource_types as T
from supernode.core import teams as names
from supernode.core.config import from_mapping, load_stack
from supernode.core.plan import build_plan
from supernode.tools import manifests as mf

pytestmark = pytest.mark.slow  # the Pulumi program under the mock engine

TEAMS = ("research", "platform")


@pytest.fixture(scope="module")
def prod():
    return preview("prod")


@pytest.fixture(scope="module")
def manifests(prod):
    return mf.from_resources(prod.result.resources)


def kind(manifests: list[dict], k: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == k]


def named(manifests: list[dict], k: str, name: str, namespace: str | None = None) -> dict:
    [m] = [
        m for m in kind(manifests, k) if m["metadata"]["name"] == name and m["metadata"].get("namespace") == namespace
    ]
    return m


def allows(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def test_a_teams_group_is_bound_in_its_own_namespace_only(manifests):
    bindings = kind(manifests, "RoleBinding") + kind(manifests, "ClusterRoleBinding")
    for team in TEAMS:
        group = names.group(team)
        bound = [b for b in bindings if any(s["name"] == group for s in b.get("subjects", []))]
        # two bindings name the team's group, both RoleBindings in its namespace: the team Role there, and
        # Kueue's viewer of its LocalQueue's pending workloads (the visibility API: where its jobs wait)
        assert [(b["kind"], b["metadata"].get("namespace")) for b in bound] == [
            ("RoleBinding", names.namespace(team))
        ] * 2
        for binding in bound:
            assert binding["subjects"] == [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": group}]
        assert sorted((b["roleRef"]["kind"], b["roleRef"]["name"]) for b in bound) == [
            ("ClusterRole", kt.QUEUE_VIEWER_ROLE),
            ("Role", kt.TEAM_ROLE),
        ]
        role = named(manifests, "Role", kt.TEAM_ROLE, names.namespace(team))
        for verb in ("create", "get", "list", "watch", "delete"):
            assert allows(role["rules"], "kubeflow.org", "pytorchjobs", verb), verb
            assert allows(role["rules"], "", "configmaps", verb), verb
        for resource in ("pods", "pods/log"):
            assert allows(role["rules"], "", resource, "get") and allows(role["rules"], "", resource, "list")
            assert not allows(role["rules"], "", resource, "delete")
        assert allows(role["rules"], "kueue.x-k8s.io", "workloads", "list")
        assert not any("secrets" in r["resources"] or "*" in r["verbs"] for r in role["rules"])
    # the other team's namespace binds nothing to this team: no RoleBinding there names another group
    for team in TEAMS:
        there = [b for b in kind(manifests, "RoleBinding") if b["metadata"]["namespace"] == names.namespace(team)]
        groups = {s["name"] for b in there for s in b["subjects"] if s["kind"] == "Group"}
        assert groups == {names.group(team)}  # (the management page's ServiceAccount is bound there too)


def test_the_admin_group_reads_every_teams_jobs_and_changes_nothing(manifests):
    bound = [
        b
        for b in kind(manifests, "ClusterRoleBinding")
        if any(s["name"] == names.ADMIN_GROUP for s in b.get("subjects", []))
    ]
    [binding] = bound
    assert binding["roleRef"]["kind"] == "ClusterRole" and binding["roleRef"]["name"] == kt.ADMIN_ROLE
    role = named(manifests, "ClusterRole", kt.ADMIN_ROLE)
    for group, resource in (("kubeflow.org", "pytorchjobs"), ("", "pods/log"), ("", "configmaps")):
        assert allows(role["rules"], group, resource, "list") and allows(role["rules"], group, resource, "get")
    assert allows(role["rules"], "kueue.x-k8s.io", "workloads", "watch")
    assert {v for r in role["rules"] for v in r["verbs"]} == {"get", "list", "watch"}  # reads only


def test_each_team_namespace_is_guarded_and_its_quota_is_what_the_team_may_ever_hold(prod, manifests):
    plan = build_plan("prod", prod.cfg, root=ROOT)
    [shares] = plan.teams
    training_ns = named(manifests, "Namespace", prod.cfg.workload.namespace)
    for t in shares.teams:
        ns = names.namespace(t.name)
        namespace = named(manifests, "Namespace", ns)
        assert namespace["metadata"]["labels"] == training_ns["metadata"]["labels"]  # Pod Security as training's
        guard = named(manifests, "ValidatingAdmissionPolicyBinding", f"{ns}-baseline-plus-efa")
        assert guard["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": ns
        }
        deny = named(manifests, "NetworkPolicy", "default-deny", ns)
        assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
        hard = named(manifests, "ResourceQuota", "team-quota", ns)["spec"]["hard"]
        assert hard["requests.nvidia.com/gpu"] == str(t.nominal + t.borrowing_limit) == str(t.max_devices)
        assert hard["requests.vpc.amazonaws.com/efa"] == str(t.max_nodes * plan.pod.efa)
        assert hard["requests.hugepages-2Mi"] == f"{t.max_nodes * plan.pod.hugepages_gib}Gi"
    assert {t.max_devices for t in shares.teams} == {136, 72}


def test_each_team_queues_in_its_own_cluster_queue_in_the_one_cohort(prod, manifests):
    plan = build_plan("prod", prod.cfg, root=ROOT)
    [shares] = plan.teams
    cqs = {m["metadata"]["name"]: m for m in kind(manifests, "ClusterQueue")}
    # training's share is the teams' queues: no gpu-h100 ClusterQueue beside them to count it twice
    assert set(cqs) == {"gpu-h100-research", "gpu-h100-platform", "gpu-h100-serving"}
    lqs = {m["metadata"]["namespace"]: m for m in kind(manifests, "LocalQueue")}
    for i, t in enumerate(shares.teams):
        cq = cqs[names.cluster_queue(t.name, "H100")]["spec"]
        assert cq["cohort"] == q.COHORT and cq["fairSharing"] == {"weight": f"{t.weight:g}"}
        flavor, borrowed = cq["resourceGroups"][0]["flavors"]
        assert flavor["name"] == "gpu-h100"  # training's nodes
        # and, like training's queue, serving's idle share at nominal 0 (prod's serving runs its whole share)
        borrowed_gpu = {r["name"]: r for r in borrowed["resources"]}["nvidia.com/gpu"]
        assert borrowed["name"] == "gpu-h100-serving"
        assert (borrowed_gpu["nominalQuota"], borrowed_gpu["borrowingLimit"]) == ("0", 0)
        assert plan.pools[0].training_borrowing_limit == 0
        gpu = {r["name"]: r for r in flavor["resources"]}["nvidia.com/gpu"]
        assert (gpu["nominalQuota"], gpu["borrowingLimit"], gpu["lendingLimit"]) == (
            str(t.nominal),
            str(t.borrowing_limit),
            str(t.lending_limit),
        )
        served = cq["namespaceSelector"]["matchExpressions"][0]["values"]
        # the first team's queue also admits the stack's own job (the training namespace)
        assert served == sorted([names.namespace(t.name), *([prod.cfg.workload.namespace] if i == 0 else [])])
        lq = lqs[names.namespace(t.name)]
        assert lq["metadata"]["name"] == q.queue_name("H100") == "gpu-h100"  # the job client's label
        assert lq["spec"]["clusterQueue"] == names.cluster_queue(t.name, "H100")
    assert lqs[prod.cfg.workload.namespace]["spec"]["clusterQueue"] == "gpu-h100-research"
    nominal = sum(
        int(r["nominalQuota"])
        for name in ("gpu-h100-research", "gpu-h100-platform")
        for r in cqs[name]["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
        if r["name"] == "nvidia.com/gpu"
    )
    assert nominal == plan.pools[0].training_devices  # the cohort holds exactly the nodes
    # fair sharing on in the controller's configuration; the jobs of the teams' namespaces are managed
    # Kueue's (the LeaderWorkerSet controller's ConfigMap has the same key)
    [config_map] = [
        m
        for m in kind(manifests, "ConfigMap")
        if q.CONFIG_KEY in m.get("data", {}) and m["metadata"].get("namespace") == q.CONTROLLER_NAMESPACE
    ]
    config = yaml.safe_load(config_map["data"][q.CONFIG_KEY])
    assert config["fairSharing"]["enable"] is True
    managed = config["managedJobsNamespaceSelector"]["matchExpressions"][0]["values"]
    assert {"team-research", "team-platform"} <= set(managed)


def test_the_high_priority_sits_between_training_and_serving(manifests):
    values = {m["metadata"]["name"]: m["value"] for m in kind(manifests, "WorkloadPriorityClass")}
    assert values[q.SERVING] > values[names.WORKLOAD_PRIORITY["high"]] > values[q.TRAINING] > values[q.EXPERIMENTS]
    assert set(names.WORKLOAD_PRIORITY.values()) <= set(values)  # every job priority names a class that exists


def test_serving_keeps_its_queue_and_quota():
    with_teams = preview("prod")
    data = copy.deepcopy(load_stack("prod", ROOT).to_mapping())
    data.pop("teams")
    data.pop("management")  # the page maps people to teams
    without = preview("prod", "no-teams", lambda d: (d.pop("teams"), d.pop("management")))
    assert without.cfg.teams == [] and from_mapping(data, "x").teams == []

    def serving_cq(stack):
        [cq] = [r for r in stack.all(T.CLUSTER_QUEUE) if r.inputs["metadata"]["name"] == "gpu-h100-serving"]
        return cq.inputs["spec"]

    assert serving_cq(with_teams) == serving_cq(without)
    # and without teams the stack keeps training's one ClusterQueue, and no team object
    names_without = {r.inputs["metadata"]["name"] for r in without.all(T.CLUSTER_QUEUE)}
    assert names_without == {"gpu-h100", "gpu-h100-serving"}
    assert not without.all(T.ACCESS_ENTRY)


def test_each_teams_role_reaches_the_cluster_as_its_group(prod):
    entries = {r.inputs["principalArn"]: r.inputs for r in prod.all(T.ACCESS_ENTRY)}
    assert set(entries) == {t.principal for t in prod.cfg.teams}
    for t in prod.cfg.teams:
        entry = entries[t.principal]
        assert entry["kubernetesGroups"] == [names.group(t.name)] and entry["type"] == "STANDARD"


def test_every_team_object_validates_and_the_schemas_catch_a_bad_one(prod, manifests):
    assert mf.validate(manifests, prod.cfg.cluster.kubernetes_version) == []
    crds = kind(manifests, "CustomResourceDefinition")
    cq = copy.deepcopy(named(manifests, "ClusterQueue", "gpu-h100-research"))
    cq["spec"]["fairSharing"]["wieght"] = cq["spec"]["fairSharing"].pop("weight")
    problems = mf.validate([*crds, cq], prod.cfg.cluster.kubernetes_version)
    assert [p.path for p in problems] == ["spec.fairSharing"]


def test_fair_sharing_is_on_only_where_teams_share_the_pool():
    assert "fairSharing" not in q.controller_configuration(["training"])  # a stack without teams: as shipped
    on = q.controller_configuration(["training", "team-a"], fair_sharing=True)
    assert on["fairSharing"] == {
        "enable": True,
        "preemptionStrategies": ["LessThanOrEqualToFinalShare", "LessThanInitialShare"],
    }
    dev = preview("dev")  # and dev, without teams, has no team object and no high priority class
    assert not dev.all(T.ACCESS_ENTRY)
    classes = {r.inputs["metadata"]["name"] for r in dev.all("kubernetes:kueue.x-k8s.io/v1beta1:WorkloadPriorityClass")}
    assert names.WORKLOAD_PRIORITY["high"] not in classes


def test_a_teams_namespace_holds_what_a_submitted_job_needs(prod, manifests):
    """The cluster backend renders a team's job as the stack's own (supernode.tools.jobs_cluster): the
    trainer's service account (the trainer role, IRSA) and the FSx claim must be there, by those names."""
    from supernode.components.k8s.namespace import PVC_NAME

    w = prod.cfg.workload
    training_account = named(manifests, "ServiceAccount", w.service_account, w.namespace)
    training_volume = named(manifests, "PersistentVolume", f"{w.namespace}-fsx", None)
    for team in TEAMS:
        ns = names.namespace(team)
        account = named(manifests, "ServiceAccount", w.service_account, ns)
        assert account["metadata"]["annotations"] == training_account["metadata"]["annotations"]  # the trainer role
        assert account["automountServiceAccountToken"] is False
        claim = named(manifests, "PersistentVolumeClaim", PVC_NAME, ns)
        volume = named(manifests, "PersistentVolume", claim["spec"]["volumeName"], None)
        assert volume["metadata"]["name"] == f"{ns}-fsx" != training_volume["metadata"]["name"]  # a PV binds one claim
        assert volume["spec"]["csi"] == training_volume["spec"]["csi"]  # the same file system
        assert volume["spec"]["claimRef"] == {"namespace": ns, "name": PVC_NAME}
