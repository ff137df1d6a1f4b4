"""The trn2 stack (one Trn2 UltraServer, 4 x trn2u.48xlarge) through the real program and the pack:
zero mandatory violations and valid manifests; pods ask for Neuron devices and EFA (never nvidia.com/gpu);
the Neuron device plugin and neuron-monitor run instead of NVIDIA's plugin and DCGM; no ComputeDomain.
And no checklist policy silently skips a Trainium stack: each one that reads accelerators fails on the
trn2 preview with its one mistake, naming the fix."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from test_supernode_stacks import MANIFESTS, mandatory, previewed, with_plan

from supernode.core import resource_types as T
from supernode.core.plan import PLAN_CONFIGMAP_KEY
from supernode.tools import manifests as mf
from supernode.tools.policycheck import check, config_from_stack

pytestmark = pytest.mark.slow  # runs the Pulumi program under the mock engine

NEURON = "aws.amazon.com/neurondevice"
EFA = "vpc.amazonaws.com/efa"


@pytest.fixture(scope="module")
def trn2():
    return previewed("trn2")


def of_kind(kind: str) -> list[dict]:
    return [m for m in MANIFESTS["trn2"] if m["kind"] == kind]


def named(kind: str, name: str) -> dict:
    return next(m for m in of_kind(kind) if m["metadata"]["name"] == name)


def test_zero_mandatory_violations_and_valid_manifests(trn2):
    cfg, resources = trn2
    assert mandatory(resources, cfg) == {}
    assert mf.validate(MANIFESTS["trn2"], cfg.cluster.kubernetes_version) == []


def test_pods_request_every_neuron_device_and_efa_of_their_node(trn2):
    job = of_kind("PyTorchJob")[0]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
    for side in ("requests", "limits"):
        assert c["resources"][side][NEURON] == "16" and c["resources"][side][EFA] == "16"
        assert "nvidia.com/gpu" not in c["resources"][side]
    assert {"key": "aws.amazon.com/neuron", "operator": "Equal", "value": "true", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert "resourceClaims" not in pod  # NeuronLink needs no IMEX channel
    gate = of_kind("Job")[0]["spec"]["template"]["spec"]["containers"][0]
    assert gate["resources"]["requests"][NEURON] == "16"
    quota = of_kind("ResourceQuota")
    assert any(q["spec"]["hard"].get(f"requests.{NEURON}") == "64" for q in quota)  # 4 nodes x 16
    queues = [q for q in of_kind("ClusterQueue") if q["spec"]["resourceGroups"][0]["coveredResources"]]
    assert queues and all(NEURON in q["spec"]["resourceGroups"][0]["coveredResources"] for q in queues)


def test_neuron_add_ons_replace_nvidias(trn2):
    cfg, resources = trn2
    daemon_sets = {m["metadata"]["name"] for m in of_kind("DaemonSet")}
    assert {"neuron-device-plugin", "neuron-monitor"} <= daemon_sets
    # the node health agent reads NVIDIA's tools: not on Neuron nodes, which join without the unchecked taint
    assert not {"nvidia-device-plugin", "dcgm-exporter", "node-health"} & daemon_sets
    assert not [r for r in resources if r["type"] == T.COMPUTE_DOMAIN]
    plugin = named("DaemonSet", "neuron-device-plugin")["spec"]["template"]["spec"]
    (c,) = plugin["containers"]
    assert c["image"] == "public.ecr.aws/neuron/neuron-device-plugin:2.24.23.0"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert plugin["tolerations"][0]["key"] == "aws.amazon.com/neuron"
    # the plugin runs as its own account, bound to the file's ClusterRole and nothing more
    (binding,) = [b for b in of_kind("ClusterRoleBinding") if b["roleRef"]["name"] == "neuron-device-plugin"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": plugin["serviceAccountName"], "namespace": "supernode-system"}
    ]
    rules = named("ClusterRole", "neuron-device-plugin")["rules"]
    assert {(tuple(r["resources"]), tuple(r["verbs"])) for r in rules} == {
        (("nodes",), ("get", "list", "watch")),
        (("events",), ("create", "patch")),
        (("pods",), ("get", "list", "watch", "update", "patch")),
        (("nodes/status",), ("patch", "update")),
    }
    monitor = named("DaemonSet", "neuron-monitor")["spec"]["template"]
    assert monitor["metadata"]["annotations"]["prometheus.io/port"] == "8000"


def test_the_cloudwatch_agent_scrapes_neuron_monitor(trn2):
    scrape = yaml.safe_load(named("ConfigMap", "prometheus-config")["data"]["prometheus.yaml"])
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    assert "neuron-monitor" in jobs and "dcgm-exporter" not in jobs
    keep = jobs["neuron-monitor"]["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["regex"] == "neuron-monitor"


def test_node_groups_run_the_neuron_ami_with_the_catalog_card_layout(trn2):
    _, resources = trn2
    (lt,) = [r for r in resources if r["type"] == T.LAUNCH_TEMPLATE and r["inputs"].get("instanceType")]
    slots = {
        (int(n["networkCardIndex"]), int(n["deviceIndex"])): n["interfaceType"]
        for n in lt["inputs"]["networkInterfaces"]
    }
    assert slots == {(0, 0): "interface", (0, 1): "efa-only", **{(c, 0): "efa-only" for c in range(1, 16)}}
    assert lt["inputs"]["instanceMarketOptions"]["marketType"] == "capacity-block"
    assert lt["inputs"]["capacityReservationSpecification"]["capacityReservationTarget"]["capacityReservationId"] == (
        "cr-0a64a64a64a64a640"
    )
    (ng,) = [
        r
        for r in resources
        if r["type"] == T.NODE_GROUP and r["inputs"].get("labels", {}).get("supernode.io/ultraserver")
    ]
    assert ng["inputs"]["labels"]["aws.amazon.com/neuron.present"] == "true"
    assert ng["inputs"]["taints"] == [{"key": "aws.amazon.com/neuron", "value": "true", "effect": "NO_SCHEDULE"}]


def plan_doc(resources: list[dict]) -> dict:
    cm = next(
        r for r in resources if r["type"] == T.CONFIG_MAP and PLAN_CONFIGMAP_KEY in (r["inputs"].get("data") or {})
    )
    return json.loads(cm["inputs"]["data"][PLAN_CONFIGMAP_KEY])


def plan_edit(edit):
    def apply(resources: list[dict]) -> list[dict]:
        doc = plan_doc(resources)
        edit(doc)
        return with_plan(resources, json.dumps(doc))

    return apply


def elastic_from_two_nodes(doc: dict) -> None:
    """training.minNodes 2 of the 4 trn2u nodes, whose layout does not fit the Trainium2 HBM."""
    reason = "30.0 GiB per rank > the usable 21.6 GiB of 24 GiB HBM"
    doc["layouts"][:0] = [
        planned(doc) | {"nodes": n, "world_size": 64 * n, "fits": False, "reason": reason} for n in (2, 3)
    ]


def drop(kind: str, name: str):
    def apply(resources: list[dict]) -> list[dict]:
        return [r for r in resources if not (r["type"] == kind and r["inputs"]["metadata"]["name"] == name)]

    return apply


def edit_first(kind: str, edit):
    def apply(resources: list[dict]) -> list[dict]:
        out = copy.deepcopy(resources)
        edit(
            next(r for r in out if r["type"] == kind and (kind != T.LAUNCH_TEMPLATE or r["inputs"].get("instanceType")))
        )
        return out

    return apply


def planned(doc: dict) -> dict:
    """The plan's own layout in its JSON (the one its world_size selects: the last)."""
    return doc["layouts"][-1]


def world_128(doc: dict) -> None:
    """A plan laid out for 128 ranks (2 nodes) on the stack's 256."""
    doc["layouts"].insert(0, planned(doc) | {"nodes": 2, "world_size": 128})
    doc["world_size"] = 128


def ep_across_domains(doc: dict) -> None:
    ep = next(g for g in planned(doc)["placement"] if g["dim"] == "ep")
    ep.update(domains=2, per_domain=128)


def trainer_efa(n: str):
    def edit(job: dict) -> None:
        for side in ("requests", "limits"):
            job["inputs"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"][
                side
            ][EFA] = n

    return edit


def trainer_image(job: dict) -> None:
    job["inputs"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["image"] = "trainer:1"


def unreserved(lt: dict) -> None:
    """An on-demand launch template without a placement group: nodes may land far apart."""
    lt["inputs"].pop("capacityReservationSpecification")
    lt["inputs"].pop("instanceMarketOptions")


# Each checklist policy that reads the accelerators, with a mistake on the trn2 preview it must catch.
MISTAKES = [
    ("accelerators-match-world-size", plan_edit(world_128), "256 accelerators"),
    (
        "accelerators-pools-add-up",
        plan_edit(lambda d: d["pools"][0].update(serving_devices=16)),
        "pool Trainium2: the serving node groups give 0 devices",
    ),
    ("accelerators-device-plugin", drop(T.DAEMON_SET, "neuron-device-plugin"), "requests aws.amazon.com/neurondevice"),
    ("memory-fit", plan_edit(lambda d: planned(d).update(fits=False, over_by_gib=3.0)), "has 24.0 GiB"),
    ("memory-fit-elastic", plan_edit(elastic_from_two_nodes), "may run on 2 nodes (world 128"),
    (
        "memory-fit",
        plan_edit(lambda d: planned(d).update(replica_fits=False)),
        "256 shard-group logical NeuronCores (1 NeuronLink domain(s) of 256 logical NeuronCores",
    ),
    (
        "interconnect-efa-interfaces",
        edit_first(T.LAUNCH_TEMPLATE, lambda lt: lt["inputs"]["networkInterfaces"].pop()),
        "trn2u.48xlarge",
    ),
    (
        "interconnect-nvlink-domain",
        plan_edit(ep_across_domains),
        "each ep group of 64 logical NeuronCores across 2 NeuronLink domains of 256 (u-trn2x64)",
    ),
    ("interconnect-trainer-efa", edit_first(T.PYTORCH_JOB, trainer_efa("8")), "it needs 16"),
    ("images-pinned", edit_first(T.PYTORCH_JOB, trainer_image), "not pinned by digest"),
    ("monitoring-dcgm", drop(T.DAEMON_SET, "neuron-monitor"), "no neuron-monitor exporter DaemonSet"),
    (
        "interconnect-placement",
        edit_first(T.LAUNCH_TEMPLATE, unreserved),
        "placement group",
    ),
    ("interconnect-gate", lambda rs: [r for r in rs if r["type"] != T.K8S_JOB], "has no interconnect gate"),
    ("versions-consistent", edit_first(T.LAUNCH_TEMPLATE, lambda lt: lt["inputs"].pop("imageId")), "does not pin"),
    ("monitoring-alarms", lambda rs: [r for r in rs if r["type"] != T.METRIC_ALARM], "no CloudWatch alarm"),
]
# The checklist policies that look at nothing an accelerator vendor changes, and why.
VENDOR_AGNOSTIC = {
    "accelerators-approved-instance-types": "an allow-list of names (test_approved_instance_types_...)",
    "interconnect-efa-security-group": "the EFA security group's rules",
    "code-config-ready": "the plan ConfigMap mount",
    "data-ready": "IAM and the FSx data repository association",
    "weights-verified": "weights URIs and their sha256",
    "checkpoint-throughput": "FSx throughput against the plan's checkpoint size",
    "checkpoint-lifecycle": "S3 lifecycle rules",
    "checkpoint-termination-grace": "the trainer pod's grace period against the plan's step and checkpoint write",
    "monitoring-log-retention": "log groups",
}


@pytest.mark.parametrize("policy,mistake,says", MISTAKES, ids=[f"{m[0]}: {m[2][:40]}" for m in MISTAKES])
def test_each_accelerator_policy_evaluates_the_trainium_stack(trn2, policy, mistake, says):
    cfg, resources = trn2
    found = mandatory(mistake(copy.deepcopy(resources)), cfg)
    assert policy in found, f"{policy} passed a Trainium stack with its mistake: {sorted(found)}"
    assert any(says in m and "Fix:" in m for m in found[policy]), found[policy]


def test_approved_instance_types_are_read_on_trainium(trn2):
    cfg, resources = trn2
    config = config_from_stack(cfg) | {
        "accelerators-approved-instance-types": {"approvedInstanceTypes": ["p5.48xlarge"]}
    }
    found = {v.policy for v in check(resources, config).mandatory}
    assert "accelerators-approved-instance-types" in found


def test_no_checklist_policy_skips_the_trainium_stack(trn2):
    """Every checklist policy ran on the trn2 preview and passed it; each one that reads accelerators is
    shown above failing on it with its mistake, and the rest are listed with what they read. A new
    checklist policy fails this test until it has a Trainium case or a reason."""
    from supernode.policies import accelerators, monitoring, readiness, storage

    cfg, resources = trn2
    report = check(resources, config_from_stack(cfg))
    names = {p.name for m in (accelerators, readiness, storage, monitoring) for p in m.POLICIES}
    assert names <= set(report.policies) and not {v.policy for v in report.mandatory} & names
    assert names == {m[0] for m in MISTAKES} | set(VENDOR_AGNOSTIC)
