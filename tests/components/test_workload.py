"""The Kubernetes side of the program (supernode.components.program.kubernetes) under Pulumi's mock engine, with
literal stand-ins for the AWS outputs (kubeconfig, FSx, IAM roles, GPU node labels/taints), for the dev
and prod stacks.

Every expected figure comes from the plan, the catalog or the config, never typed in here.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pulumi
import pytest

from supernode.components.context import StackContext
from supernode.components.k8s.common import GpuNodes
from supernode.components.k8s.jobs import SHUTDOWN_MARGIN_S
from supernode.components.k8s.namespace import FsxVolume
from supernode.components.k8s.operations import NODE_HEALTH_NAMESPACE, OPS_NAMESPACE
from supernode.components.program import AwsOutputs, kubernetes
from supernode.components.taints import Taint
from supernode.core import resource_types as T
from supernode.core.catalog import CATALOG
from supernode.core.config import StackConfig, from_mapping, load_stack
from supernode.core.plan import Plan, build_plan
from supernode.tools import manifests as mf
from supernode.tools.preview import PreviewResult, Resource, run_program

ROOT = Path(__file__).resolve().parents[2]
FSX_ID = "fs-0123456789abcdef0"
ROLE_ARN = "arn:aws:iam::123456789012:role/supernode-trainer"
RETENTION_ROLE_ARN = "arn:aws:iam::123456789012:role/supernode-checkpoint-retention"
GPU_LABELS = {
    "gpu-a": {"supernode.io/node-group": "gpu-a", "nvidia.com/gpu.present": "true"},
    "gpu-b": {"supernode.io/node-group": "gpu-b", "nvidia.com/gpu.present": "true"},
}
GPU_TAINT = Taint(key="nvidia.com/gpu", value="true", effect="NoSchedule")


def kubernetes_alone(stack: str, cfg: StackConfig, plan: Plan) -> None:
    """The Kubernetes side fed literal AWS outputs; config and plan as the program gets them."""
    kubernetes(
        StackContext.create(stack, cfg.region, "123456789012"),
        cfg,
        plan,
        AwsOutputs(
            kubeconfig=pulumi.Output.secret("apiVersion: v1\nkind: Config\n"),
            fsx=FsxVolume(
                id=FSX_ID,
                dns_name=f"{FSX_ID}.fsx.us-east-1.amazonaws.com",
                mount_name="abcdef12",
                size_gib=pulumi.Output.from_input(4800),
                data_dir="/datasets",
                checkpoint_dir="/checkpoints",
            ),
            baseline_dir="/baselines",
            bucket_name=f"supernode-{stack}-data",
            trainer_role_arn=ROLE_ARN,
            metrics_agent_role_arn="arn:aws:iam::123456789012:role/supernode-metrics-agent",
            node_health_role_arn="arn:aws:iam::123456789012:role/supernode-node-health",
            retention_role_arn=RETENTION_ROLE_ARN,
            gpu_nodes=GpuNodes.for_groups(GPU_LABELS, {group: [GPU_TAINT] for group in GPU_LABELS}),
            cluster_name=f"supernode-{stack}",
        ),
    )


def preview(stack: str, cfg: StackConfig) -> PreviewResult:
    return run_program(stack, cfg, kubernetes_alone)


@cache
def stack_preview(stack: str) -> tuple[StackConfig, PreviewResult]:
    cfg = load_stack(stack, ROOT)
    return cfg, preview(stack, cfg)


def one(result: PreviewResult, typ: str, name: str | None = None) -> Resource:
    found = [r for r in result.by_type(typ) if name is None or r.inputs["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {typ} {name or ''}, found {[r.name for r in found]}"
    return found[0]


def objects(result: PreviewResult) -> dict[tuple[str, str], dict]:
    return {(m["kind"], m["metadata"]["name"]): m for m in mf.from_resources(result.resources)}


def worker(result: PreviewResult) -> tuple[dict, dict]:
    job = objects(result)[("PyTorchJob", f"{result.stack}-train")]
    spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    return job, spec


def gate_floor(result: PreviewResult) -> float:
    """The bus-bandwidth floor the gate Job runs with: `--plan PATH`, PATH on the plan ConfigMap's
    mount, the floor that ConfigMap's plan carries."""
    gate = objects(result)[("Job", f"{result.stack}-fabric-gate")]["spec"]["template"]["spec"]
    (c,) = gate["containers"]
    args = c["args"]
    path = Path(args[args.index("--plan") + 1])
    assert path == Path("/etc/supernode/plan.json")
    assert not any("busbw" in a for a in args)  # the floor comes from the plan, not the command line
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent))
    volume = next(v for v in gate["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["items"] == [{"key": "plan.json", "path": path.name}]
    cm = objects(result)[("ConfigMap", volume["configMap"]["name"])]
    return Plan.from_json(cm["data"][path.name]).gate_floor_gbytes_s


def check_trainer(cfg: StackConfig, plan: Plan, result: PreviewResult) -> None:
    hw = CATALOG[plan.instance_type]
    job, w = worker(result)
    pod = w["template"]["spec"]
    (c,) = pod["containers"]
    assert job["spec"]["nprocPerNode"] == str(plan.accelerators_per_node) == str(hw.accelerators)
    assert w["replicas"] == plan.nodes == cfg.nodes
    assert w["restartPolicy"] == "ExitCode"  # signals are retried, a recorded failure is not
    elastic = job["spec"]["elasticPolicy"]
    assert elastic == {
        "rdzvBackend": "c10d",
        "minReplicas": cfg.training.min_nodes or cfg.nodes,  # elastic down to training.minNodes
        "maxReplicas": plan.nodes,
        "maxRestarts": cfg.training.max_restarts,
    }
    res = c["resources"]
    assert res["requests"] == res["limits"], "requests must equal limits (Guaranteed QoS, whole node)"
    assert res["limits"]["nvidia.com/gpu"] == str(hw.accelerators)
    assert res["limits"]["vpc.amazonaws.com/efa"] == str(hw.efa_interfaces)
    assert res["limits"]["hugepages-2Mi"] == f"{cfg.workload.hugepages_2mi_gib}Gi"
    assert 0 < int(res["limits"]["cpu"]) < hw.vcpus
    assert 0 < int(res["limits"]["memory"].removesuffix("Gi")) < hw.memory_gib
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    # the metrics endpoint listens on the pod IP (downward API), for the CloudWatch agent's scrape
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert (
        env
        | {
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1",
            "FI_EFA_FORK_SAFE": "1",
            "NCCL_SOCKET_IFNAME": "^lo",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "NCCL_DEBUG": "WARN",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        == env
    )
    assert c["image"] == cfg.images.trainer and "@sha256:" in c["image"]
    assert c["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"]}
    assert pod["terminationGracePeriodSeconds"] == cfg.workload.termination_grace_s
    assert pod["priorityClassName"] == "supernode-training"
    assert pod["serviceAccountName"] == cfg.workload.service_account
    assert {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"} in pod["tolerations"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "supernode.io/node-group", "operator": "In", "values": ["gpu-a", "gpu-b"]} in term[
        "matchExpressions"
    ]
    args = c["args"]
    # supernode.trainer.launch (torchrun with a recorded failure as its exit code) and ExitCode restarts: the
    # operator retries a signal (128-255), never bad input or a full disk recorded by the trainer
    assert (
        c["command"][:3] == ["python", "-m", "supernode.trainer.launch"]
        and c["command"][-1] == "supernode.trainer.train"
    )
    # torchrun gives the workers the pod's grace period to checkpoint (its default SIGKILLs them after 30 s)
    shutdown_s = int(c["command"][c["command"].index("--shutdown-timeout") + 1])
    assert shutdown_s == pod["terminationGracePeriodSeconds"] - SHUTDOWN_MARGIN_S and shutdown_s > 0
    assert args[args.index("--plan") + 1] == "/etc/supernode/plan.json"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory"}
    assert volumes[mounts["/etc/supernode"]["name"]]["configMap"]["name"] == "supernode-plan"
    for flag, sub in (("--data", "datasets"), ("--out", "checkpoints")):
        m = mounts[args[args.index(flag) + 1]]
        assert m["subPath"] == sub and volumes[m["name"]]["persistentVolumeClaim"]["claimName"] == "fsx"


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_trainer_job_matches_plan_and_catalog(stack: str) -> None:
    cfg, result = stack_preview(stack)
    check_trainer(cfg, build_plan(stack, cfg), result)


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_plan_configmap_is_the_core_serialisation(stack: str) -> None:
    cfg, result = stack_preview(stack)
    cm = objects(result)[("ConfigMap", "supernode-plan")]
    plan = build_plan(stack, cfg)
    assert cm["data"]["plan.json"] == plan.to_json()
    assert Plan.from_json(cm["data"]["plan.json"]) == plan


def test_job_follows_the_config() -> None:
    """Three nodes instead of two and other workload settings: the job (and quota) change with them."""
    base = load_stack("dev", ROOT)
    data = base.to_mapping()
    data["acceleratorNodeGroups"][0]["nodes"] = 3
    data["parallel"]["dpShard"] = base.parallel.dp_shard * 3 // 2  # keep world size = 3 nodes x 8 GPUs
    data["training"]["globalBatch"] = base.training.micro_batch * data["parallel"]["dpShard"] * 4
    data["training"]["maxRestarts"] = base.training.max_restarts + 4
    data["workload"].update(
        hugepages2MiGib=base.workload.hugepages_2mi_gib + 3,
        terminationGraceS=base.workload.termination_grace_s + 300,
        gateMinFraction=0.5,
    )
    cfg = from_mapping(data)
    plan = build_plan("dev", cfg)
    assert plan.nodes == 3 != base.nodes
    result = preview("dev", cfg)
    check_trainer(cfg, plan, result)
    quota = objects(result)[("ResourceQuota", "training-quota")]["spec"]["hard"]
    assert quota["requests.nvidia.com/gpu"] == str(plan.world_size)
    gate = objects(result)[("Job", "dev-fabric-gate")]["spec"]
    assert gate["completions"] == gate["parallelism"] == 3
    assert gate_floor(result) == pytest.approx(CATALOG[plan.instance_type].all_reduce_baseline_gbytes_s * 0.5)


def test_job_follows_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    """A (hypothetical) 4-GPU, 2-EFA instance type: nproc, GPUs and EFA devices all follow the catalog."""
    from dataclasses import replace

    small = replace(
        CATALOG["p5.48xlarge"],
        name="p5.test",
        accelerators=4,
        efa_interfaces=2,
        vcpus=96,
        memory_gib=1024,
        all_reduce_baseline_gbytes_s=200.0,
    )
    monkeypatch.setitem(CATALOG, small.name, small)
    base = load_stack("dev", ROOT)
    data = base.to_mapping()
    data["acceleratorNodeGroups"][0]["instanceType"] = small.name
    data["parallel"]["dpShard"] = base.parallel.dp_shard // 2  # world size 2 nodes x 4 GPUs
    cfg = from_mapping(data)
    plan = build_plan("dev", cfg)
    assert plan.accelerators_per_node == 4
    result = preview("dev", cfg)
    check_trainer(cfg, plan, result)
    quota = objects(result)[("ResourceQuota", "training-quota")]["spec"]["hard"]
    assert quota["requests.vpc.amazonaws.com/efa"] == str(2 * plan.nodes)


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_trainer_waits_for_the_interconnect_gate(stack: str) -> None:
    cfg, result = stack_preview(stack)
    plan = build_plan(stack, cfg)
    gate = one(result, T.K8S_JOB, f"{stack}-fabric-gate")
    trainer = one(result, T.PYTORCH_JOB)
    crd = one(result, T.CRD, "pytorchjobs.kubeflow.org")
    operator = one(result, T.DEPLOYMENT, "training-operator")
    assert {gate.urn, crd.urn, operator.urn} <= set(trainer.dependencies)

    # a failed gate fails `pulumi up`; the next one runs a fresh gate rather than waiting on the old one
    assert gate.inputs["metadata"]["annotations"]["pulumi.com/replaceUnready"] == "true"
    assert trainer.inputs["metadata"]["annotations"]["pulumi.com/waitFor"] == "condition=Running"

    spec = objects(result)[("Job", f"{stack}-fabric-gate")]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == plan.nodes
    assert spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][-1] == "supernode.trainer.node.fabric"
    assert pod["priorityClassName"] == "supernode-training"
    threshold = gate_floor(result)
    assert threshold == pytest.approx(
        CATALOG[plan.instance_type].all_reduce_baseline_gbytes_s * cfg.workload.gate_min_fraction
    )
    # the gate measures the same fabric the trainer uses: whole nodes, all EFA devices, one pod per node
    _, w = worker(result)
    assert c["resources"] == w["template"]["spec"]["containers"][0]["resources"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    env = {e["name"]: e for e in c["env"]}
    assert env["PET_NNODES"]["value"] == str(plan.nodes)
    assert env["PET_NPROC_PER_NODE"]["value"] == str(plan.accelerators_per_node)
    svc = objects(result)[("Service", f"{stack}-fabric-gate")]["spec"]
    assert svc["clusterIP"] == "None" and pod["subdomain"] == f"{stack}-fabric-gate"
    assert env["PET_MASTER_ADDR"]["value"].startswith(f"{stack}-fabric-gate-0.")


def test_network_policies_deny_by_default_and_allow_narrowly() -> None:
    cfg, result = stack_preview("prod")
    # the training, operations and node-health namespaces' (serving's own: tests/policies/test_serving.py)
    policies = {
        m["metadata"]["name"]: m["spec"]
        for (k, _), m in objects(result).items()
        if k == "NetworkPolicy"
        and m["metadata"]["namespace"] in (cfg.workload.namespace, OPS_NAMESPACE, NODE_HEALTH_NAMESPACE)
    }
    assert policies.pop("default-deny") == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    dns = policies.pop("allow-dns")
    assert "ingress" not in dns and dns["policyTypes"] == ["Egress"]
    (rule,) = dns["egress"]
    (peer,) = rule["to"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
    assert peer["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert sorted((p["protocol"], p["port"]) for p in rule["ports"]) == [("TCP", 53), ("UDP", 53)]

    aws = policies.pop("allow-aws-apis")
    assert "ingress" not in aws and aws["podSelector"] != {}
    (rule,) = aws["egress"]
    assert rule["ports"] == [{"port": 443, "protocol": "TCP"}]
    assert rule["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}}]

    scrape = policies.pop("allow-scrape-prod-train")  # only the metrics port, only from the CloudWatch agent
    assert scrape["policyTypes"] == ["Ingress"] and [r["ports"] for r in scrape["ingress"]] == [
        [{"port": 9090, "protocol": "TCP"}]
    ]
    assert policies.pop("inventory")["podSelector"] == {}  # the supernode-ops namespace's own policy
    health = policies.pop("node-health")  # the agent's namespace: DNS, and HTTPS but not the metadata service
    assert health["podSelector"] == {} and "ingress" not in health
    assert health["egress"][1]["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}}]

    assert set(policies) == {"allow-mesh-prod-train", "allow-mesh-prod-fabric-gate", "allow-mesh-prod-fabric-check"}
    for name, spec in policies.items():
        mesh = {"matchLabels": {"supernode.io/fabric-mesh": name.removeprefix("allow-mesh-")}}
        assert spec["podSelector"] == mesh
        for rule in spec["ingress"] + spec["egress"]:
            # peers: exactly the same job's pods; no namespace or IP block widens it
            assert rule.get("from", rule.get("to")) == [{"podSelector": mesh}]
            assert rule["ports"] == [{"protocol": "TCP"}]
    # the job pods carry the mesh label the policies select
    _, w = worker(result)
    assert w["template"]["metadata"]["labels"]["supernode.io/fabric-mesh"] == "prod-train"


def test_namespace_guard_rails_identity_and_storage() -> None:
    cfg, result = stack_preview("prod")
    objs = objects(result)
    ns = objs[("Namespace", cfg.workload.namespace)]["metadata"]["labels"]
    assert ns["pod-security.kubernetes.io/warn"] == ns["pod-security.kubernetes.io/audit"] == "baseline"
    assert ns["pod-security.kubernetes.io/enforce-version"] == f"v{cfg.cluster.kubernetes_version}"
    guard = objs[("ValidatingAdmissionPolicy", "training-baseline-plus-efa")]["spec"]
    caps = next(v["expression"] for v in guard["validations"] if "capabilities.add" in v["expression"])
    assert "'IPC_LOCK'" in caps and "'SYS_ADMIN'" not in caps and "'NET_ADMIN'" not in caps
    sa = objs[("ServiceAccount", cfg.workload.service_account)]
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == ROLE_ARN
    pv = objs[("PersistentVolume", "training-fsx")]["spec"]
    assert pv["csi"] == {
        "driver": "fsx.csi.aws.com",
        "volumeHandle": FSX_ID,
        "volumeAttributes": {"dnsname": f"{FSX_ID}.fsx.us-east-1.amazonaws.com", "mountname": "abcdef12"},
    }
    assert pv["mountOptions"] == ["flock"] and pv["capacity"] == {"storage": "4800Gi"}
    pvc = objs[("PersistentVolumeClaim", "fsx")]["spec"]
    assert pvc["volumeName"] == "training-fsx" and pvc["storageClassName"] == "" == pv["storageClassName"]
    plan = build_plan("prod", cfg)
    quota = objs[("ResourceQuota", "training-quota")]["spec"]["hard"]
    assert quota["requests.vpc.amazonaws.com/efa"] == str(plan.nodes * CATALOG[plan.instance_type].efa_interfaces)


def test_pod_identity_mode_drops_irsa_and_allows_only_the_agent() -> None:
    data = load_stack("dev", ROOT).to_mapping()
    data["identity"]["podIdentity"] = "pod-identity"
    result = preview("dev", from_mapping(data))
    objs = objects(result)
    assert "annotations" not in objs[("ServiceAccount", "trainer")]["metadata"]
    egress = objs[("NetworkPolicy", "allow-aws-apis")]["spec"]["egress"]
    assert {"to": [{"ipBlock": {"cidr": "169.254.170.23/32"}}], "ports": [{"port": 80, "protocol": "TCP"}]} in egress


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_manifest_validates(stack: str) -> None:
    cfg, result = stack_preview(stack)
    manifests = mf.from_resources(result.resources)
    kinds = {m["kind"] for m in manifests}
    assert {
        "DaemonSet",
        "Deployment",
        "CustomResourceDefinition",
        "PyTorchJob",
        "Job",
        "NetworkPolicy",
        "PersistentVolume",
        "PersistentVolumeClaim",
        "ConfigMap",
        "ResourceQuota",
        "LimitRange",
    } <= kinds
    assert mf.validate(manifests, cfg.cluster.kubernetes_version) == []
    assert json.dumps(manifests)  # plain data, no engine objects


def test_validation_catches_bad_objects() -> None:
    cfg, result = stack_preview("dev")
    manifests = json.loads(json.dumps(mf.from_resources(result.resources)))
    by_kind = {m["kind"]: m for m in manifests}
    by_kind["NetworkPolicy"]["spec"]["podSelectr"] = {}  # unknown field in a built-in kind (strict)
    by_kind["PyTorchJob"]["spec"]["elasticPolicy"]["rdzvBackend"] = "zookeeper"  # CRD enum
    by_kind["PyTorchJob"]["spec"]["elasticPolicy"]["maxRestart"] = 3  # unknown CR field
    worker_pod = by_kind["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    worker_pod["containers"][0]["imagePullPolice"] = "Always"  # unknown field inside the embedded pod template
    problems = [str(p) for p in mf.validate(manifests, cfg.cluster.kubernetes_version)]
    assert len(problems) == 4, problems
    assert any("podSelectr" in p for p in problems) and any("zookeeper" in p for p in problems)
    assert any("maxRestart" in p for p in problems)
    assert any(
        "pytorchReplicaSpecs.Worker.template.spec.containers.0" in p and "imagePullPolice" in p for p in problems
    )


def test_schema_version_is_the_closest_not_newer() -> None:
    from kubernetes_validate.utils import all_versions

    shipped = {".".join(v.split(".")[:2]) for v in all_versions()}
    assert "1.33" in shipped and mf.schema_version("1.33") == "1.33"
    newest = max(shipped, key=lambda v: tuple(map(int, v.split("."))))
    assert mf.schema_version("1.99") == newest
    from kubernetes_validate.utils import VersionNotSupportedError

    with pytest.raises(VersionNotSupportedError):
        mf.schema_version("1.1")
