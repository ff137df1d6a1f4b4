"""The P6 stacks (gb200: 2 x u-p6e-gb200x72; b300: 4 x p6-b300) through the real program and the pack:
zero mandatory violations and valid manifests, and the two GB200 mistakes (no ComputeDomain; EP
crossing NVLink domains) plus a replica that does not fit its GPUs fail with the fix named."""

from __future__ import annotations

import copy
import json

import pytest
from policy_resources import ROOT

from supernode.core import resource_types as T
from supernode.core.config import load_stack
from supernode.core.plan import PLAN_CONFIGMAP_KEY, build_plan
from supernode.policies.view import Stack
from supernode.tools import manifests as mf
from supernode.tools.policycheck import check, config_from_stack
from supernode.tools.preview import run_program

pytestmark = pytest.mark.slow  # runs the Pulumi program under the mock engine (seconds per stack)


MANIFESTS: dict[str, list[dict]] = {}  # each stack's Kubernetes objects, as `preview --manifests` writes them
_PREVIEWS: dict[str, tuple] = {}


def previewed(name: str) -> tuple:
    """(config, recorded resources) of one stack, previewed once per test process."""
    if name not in _PREVIEWS:
        cfg = load_stack(name, ROOT)
        recorded = run_program(name, cfg).resources
        MANIFESTS[name] = mf.from_resources(recorded)
        _PREVIEWS[name] = cfg, [r.to_json() for r in recorded]
    return _PREVIEWS[name]


@pytest.fixture
def gb200():
    return previewed("gb200")


@pytest.fixture
def b300():
    return previewed("b300")


def mandatory(resources: list[dict], cfg) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for v in check(resources, config_from_stack(cfg)).mandatory:
        out.setdefault(v.policy, []).append(v.message)
    return out


@pytest.mark.parametrize("name", ["gb200", "b300"])
def test_zero_mandatory_violations_and_valid_manifests(name):
    cfg, resources = previewed(name)
    assert mandatory(resources, cfg) == {}
    assert mf.validate(MANIFESTS[name], cfg.cluster.kubernetes_version) == []


def test_gb200_jobs_claim_their_compute_domain_and_keep_to_one_clique(gb200):
    cfg, resources = gb200
    manifests = MANIFESTS["gb200"]
    domains = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "ComputeDomain"}
    # one per job: the trainer, the interconnect gate and the scheduled fabric check
    assert set(domains) == {"gb200-fabric-gate", "gb200-train", "gb200-fabric-check"}
    assert any(
        m["kind"] == "CustomResourceDefinition" and m["metadata"]["name"] == "computedomains.resource.nvidia.com"
        for m in manifests
    )  # the CRD the validator checked them against
    job = next(m for m in manifests if m["kind"] == "PyTorchJob")
    spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    template = domains["gb200-train"]["spec"]["channel"]["resourceClaimTemplate"]["name"]
    assert spec["resourceClaims"] == [{"name": "imex-channel", "resourceClaimTemplateName": template}]
    assert spec["containers"][0]["resources"]["claims"] == [{"name": "imex-channel"}]
    # 36 pods over two 18-node domains: preferred (a required clique could not hold them all)
    term = spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "nvidia.com/gpu.clique"
    gate = next(m for m in manifests if m["kind"] == "Job")
    assert (
        gate["spec"]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
        == (domains["gb200-fabric-gate"]["spec"]["channel"]["resourceClaimTemplate"]["name"])
    )
    check = next(m for m in manifests if m["kind"] == "CronJob" and "fabric" in m["metadata"]["name"])
    pod = check["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert (
        pod["resourceClaims"][0]["resourceClaimTemplateName"]
        == (domains["gb200-fabric-check"]["spec"]["channel"]["resourceClaimTemplate"]["name"])
    )


def test_single_node_domains_create_no_compute_domain(b300):
    cfg, resources = b300
    assert not [r for r in resources if r["type"] == T.COMPUTE_DOMAIN]
    job = next(m for m in MANIFESTS["b300"] if m["kind"] == "PyTorchJob")
    assert "resourceClaims" not in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


DRA = "nvidia-dra-driver-gpu"


def dra_driver(manifests: list[dict]) -> list[dict]:
    return [
        m
        for m in manifests
        if m["metadata"].get("labels", {}).get("app.kubernetes.io/name") == DRA or m["kind"] == "DeviceClass"
    ]


def test_gb200_installs_the_dra_driver_in_compute_domain_mode_before_its_jobs(gb200):
    cfg, resources = gb200
    objs = {(m["kind"], m["metadata"]["name"]): m for m in dra_driver(MANIFESTS["gb200"])}
    controller = objs["Deployment", f"{DRA}-controller"]
    plugin = objs["DaemonSet", f"{DRA}-kubelet-plugin"]
    pod = controller["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert c["command"][0] == "compute-domain-controller"
    assert env["IMAGE_NAME"] == c["image"] and c["image"].startswith("nvcr.io/nvidia/k8s-dra-driver-gpu:v25.8")
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert pod["serviceAccountName"] == f"{DRA}-controller"
    # ComputeDomains only (resources.gpus.enabled=false): the compute-domains plugin, no gpus container
    pod = plugin["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["name"] == "compute-domains" and c["command"][0] == "compute-domain-kubelet-plugin"
    assert {e["name"]: e.get("value") for e in c["env"]}["KUBELET_PLUGINS_DIRECTORY_PATH"] == "/var/lib/kubelet/plugins"
    assert {v["hostPath"]["path"] for v in pod["volumes"]} >= {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/run/cdi",
    }
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"  # on the GPU node groups
    assert pod["serviceAccountName"] == f"{DRA}-kubeletplugin"
    assert {c["image"] for c in pod["initContainers"] + pod["containers"]} == {
        controller["spec"]["template"]["spec"]["containers"][0]["image"]
    }
    # the channel and daemon classes, at the DRA version the 1.33 cluster serves
    classes = {n: m["apiVersion"] for (k, n), m in objs.items() if k == "DeviceClass"}
    assert classes == {
        "compute-domain-daemon.nvidia.com": "resource.k8s.io/v1beta1",
        "compute-domain-default-channel.nvidia.com": "resource.k8s.io/v1beta1",
    }
    # the daemons the controller launches run as the account its template names
    assert ("ServiceAccount", "compute-domain-daemon-service-account") in objs
    # every ComputeDomain, so the trainer and the gate, waits for the driver's workloads
    urns = {
        r["inputs"]["metadata"]["name"]: r["urn"]
        for r in resources
        if r["type"] in (T.DEPLOYMENT, T.DAEMON_SET) and r["inputs"]["metadata"].get("name", "").startswith(DRA)
    }
    assert set(urns) == {f"{DRA}-controller", f"{DRA}-kubelet-plugin"}
    domains = [r for r in resources if r["type"] == T.COMPUTE_DOMAIN]
    assert len(domains) == 3
    for cd in domains:
        assert set(urns.values()) <= set(cd["dependencies"]), cd["name"]


def test_single_node_domains_install_no_dra_driver(b300):
    assert dra_driver(MANIFESTS["b300"]) == []


def test_gb200_without_a_compute_domain_fails_naming_the_fix(gb200):
    cfg, resources = gb200
    broken = [r for r in copy.deepcopy(resources) if r["type"] != T.COMPUTE_DOMAIN]
    messages = mandatory(broken, cfg)["interconnect-nvlink-domain"]
    assert len(messages) == 2  # the trainer and the gate
    assert all("claim no ComputeDomain IMEX channel" in m and "install the NVIDIA DRA driver" in m for m in messages)


def with_plan(resources: list[dict], plan_json: str) -> list[dict]:
    out = copy.deepcopy(resources)
    cm = next(r for r in out if r["type"] == T.CONFIG_MAP and PLAN_CONFIGMAP_KEY in (r["inputs"].get("data") or {}))
    cm["inputs"]["data"][PLAN_CONFIGMAP_KEY] = plan_json
    return out


def test_gb200_ep_crossing_domains_fails_naming_the_fix(gb200):
    cfg, resources = gb200
    crossing = cfg.model_copy(
        update={"parallel": cfg.parallel.model_copy(update={"dp_replicate": 1, "dp_shard": 144, "ep": 144})}
    )
    plan = build_plan("gb200", crossing)
    assert not plan.layout.group("ep").inside_domain
    messages = mandatory(with_plan(resources, plan.to_json()), cfg)["interconnect-nvlink-domain"]
    assert len(messages) == 1
    assert "each ep group of 144 GPUs across 2 NVLink domains of 72 (u-p6e-gb200x72)" in messages[0]
    assert "Fix: choose supernode:parallel.ep dividing 72" in messages[0]


def test_replica_state_over_the_domain_memory_fails_item_2(gb200):
    cfg, resources = gb200
    plan = json.loads(build_plan("gb200", cfg).to_json())
    plan["layouts"][-1]["replica_fits"] = False  # the plan's verdict, as the policy reads it
    messages = mandatory(with_plan(resources, json.dumps(plan)), cfg)["memory-fit"]
    assert len(messages) == 1 and "One replica's training state" in messages[0]
    assert "72 shard-group GPUs (1 NVLink domain(s) of 72 GPUs" in messages[0] and "dpShard up" in messages[0]


def test_policies_see_the_gb200_plan(gb200):
    cfg, resources = gb200
    stack = Stack.from_json(resources)
    assert stack.plan() == build_plan("gb200", cfg)
    assert len(stack.of(T.COMPUTE_DOMAIN)) == 3 and len(stack.gpu_node_groups()) == 2
