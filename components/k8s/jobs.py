"""The two distributed jobs: the interconnect gate (an Indexed Job measuring the fabric on every GPU
node) and the trainer (a PyTorchJob). Both run one pod per GPU node owning the whole node, with
the EFA/NCCL environment of docs/architecture.md §4, talk only to each other's pods of the same job,
and read the plan from the same ConfigMap mount (`--plan PLAN_MOUNT_PATH`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from supernode.core.observability import METRICS_SCRAPER_NAMESPACE, PROFILE_EVERY
from supernode.core.plan import PLAN_CONFIGMAP_KEY, PLAN_MOUNT_DIR, PLAN_MOUNT_PATH, Plan
from supernode.core.pools import ROLE_LABEL
from supernode.core.pretrained import is_remote

from .common import MESH_LABEL, GpuNodes, meta, pod_resources

DATA_PATH, CHECKPOINT_PATH = "/data", "/checkpoints"
# training.initFrom in the pod: the FSx directory mounted read-only, or the s3:// prefix downloaded
# into an emptyDir, either way verified by an init container before the trainer (rank 0 included) starts.
PRETRAINED_PATH = "/pretrained"
FSX_ROOT = "/fsx"  # an initFrom path in the cluster names a directory of the FSx file system: /fsx/<path>
MASTER_PORT = 29500  # torchrun static rendezvous of the gate
GATE_DEADLINE_S = 1800  # a hung fabric check fails the gate instead of blocking the rollout
FABRIC_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "NCCL_SOCKET_IFNAME": "^lo",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_DEBUG": "WARN",
    # torchrun restarts (elastic maxRestarts) reuse a shared rendezvous TCP store that dies with the
    # failed attempt unless this is set (pytorch/pytorch#135712): without it a restart cannot connect.
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}
# torchrun reads PET_* variables for its flags; the PyTorchJob operator sets them for the trainer.
TORCHRUN = ["python", "-m", "torch.distributed.run", "--module"]
# torchrun SIGKILLs its workers --shutdown-timeout seconds (30 by default) after forwarding SIGTERM,
# whatever the pod's grace period: the trainer's get the grace period, less this for the launcher
# to exit after them (before the kubelet's SIGKILL), so the final checkpoint has all the time there is.
SHUTDOWN_MARGIN_S = 10


def launch(termination_grace_s: int) -> list[str]:
    """supernode.trainer.launch (torchrun whose exit code says a recorded failure) with the pod's grace period."""
    shutdown_s = termination_grace_s - SHUTDOWN_MARGIN_S  # the config's minimum grace (30 s) leaves 20
    return ["python", "-m", "supernode.trainer.launch", "--shutdown-timeout", str(shutdown_s), "--module"]


# The fabric baseline: a directory of its own on FSx, exported to S3 (storage.baseline_dir -> the
# bucket's baselines/ prefix, which no lifecycle rule expires, unlike checkpoints/).
BASELINE_MOUNT = "/baselines"
FABRIC_BASELINE = f"{BASELINE_MOUNT}/fabric/baseline.json"  # recorded by the first gate, compared with after
# The trainer's Prometheus endpoint (rank 0), on the pod IP so the CloudWatch agent can scrape it.
METRICS_PORT = 9090
SCRAPE_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(METRICS_PORT),
    "prometheus.io/path": "/metrics",
}


@dataclass(frozen=True)
class JobArgs:
    namespace: pulumi.Input[str]
    image: str
    gpu_nodes: GpuNodes
    plan: Plan  # node count, pod shape, gate floor, training settings
    plan_config_map: pulumi.Input[str]  # the plan as the core serialised it; both jobs mount it
    priority_class: pulumi.Input[str]  # both jobs hold whole GPU nodes: same priority
    # What a job's custom resources need first: the ComputeDomain CRD where the plan spans nodes over NVLink.
    wait_for: Sequence[pulumi.Resource] = ()


# Both jobs read the plan file rather than figures copied onto their command lines.
PLAN_VOLUME_MOUNT = {"name": "plan", "mountPath": PLAN_MOUNT_DIR, "readOnly": True}


def plan_volume(args: JobArgs) -> dict[str, Any]:
    return {
        "name": "plan",
        "configMap": {"name": args.plan_config_map, "items": [{"key": PLAN_CONFIGMAP_KEY, "path": PLAN_CONFIGMAP_KEY}]},
    }


def pod_metadata(args: JobArgs, mesh: str, annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The job's pod labels and the plan's hash: the pods read the plan from a ConfigMap, so without
    the hash in the spec a changed plan would not replace (re-run) the job."""
    plan_hash = hashlib.sha256(args.plan.to_json().encode()).hexdigest()
    return {"labels": {MESH_LABEL: mesh}, "annotations": {"supernode.io/plan-sha256": plan_hash, **(annotations or {})}}


def field_env(name: str, path: str) -> dict[str, Any]:
    """An environment variable from the downward API."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


@dataclass(frozen=True)
class BaselineStore:
    """Where fabric pods keep the baseline: the FSx claim and the directory in it (exported to S3)."""

    pvc: pulumi.Input[str]
    subpath: str  # relative to the file system's root, e.g. "baselines"
    regression: float  # supernode:workload.fabricRegression


def fabric_pod_template(
    args: JobArgs, mesh: str, service: str, store: BaselineStore | None, report: str, job_name: str | None = None
) -> dict[str, Any]:
    """The pod of an Indexed fabric-check Job: one per GPU node, torchrun's static rendezvous on
    index 0 (`<job>-0.<service>`). With a baseline store it compares with the baseline (recording it
    when there is none) and writes its report as `report` next to it. `job_name` None: the Job's
    name is generated (a CronJob's), and is read from the pod's own job-name label."""
    if job_name is None:
        master = [
            field_env("JOB_NAME", "metadata.labels['batch.kubernetes.io/job-name']"),
            {"name": "PET_MASTER_ADDR", "value": f"$(JOB_NAME)-0.{service}"},
        ]
    else:
        master = [{"name": "PET_MASTER_ADDR", "value": f"{job_name}-0.{service}"}]
    env = [
        {"name": "PET_NNODES", "value": str(args.plan.nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(args.plan.accelerators_per_node)},
        field_env("PET_NODE_RANK", "metadata.annotations['batch.kubernetes.io/job-completion-index']"),
        *master,
        {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)},
        # The pair matrix names nodes by the Kubernetes node (the pod's host name is its job index,
        # which lands on another node next time: the baseline would compare the wrong pairs).
        field_env("NODE_NAME", "spec.nodeName"),
    ]
    mounts, volumes = [PLAN_VOLUME_MOUNT], [plan_volume(args)]
    fabric = ["--plan", PLAN_MOUNT_PATH]
    if store is not None:
        mounts.append({"name": "baselines", "mountPath": BASELINE_MOUNT, "subPath": store.subpath})
        volumes.append({"name": "baselines", "persistentVolumeClaim": {"claimName": store.pvc}})
        fabric += [
            "--baseline",
            FABRIC_BASELINE,
            "--report",
            f"{BASELINE_MOUNT}/fabric/{report}",
            "--regression",
            f"{store.regression:g}",
        ]
    container = {
        "name": "fabric",
        "image": args.image,
        "command": TORCHRUN + ["supernode.trainer.node.fabric"],
        "args": fabric,
        "env": env,
        "volumeMounts": mounts,
    }
    return {
        "metadata": pod_metadata(args, mesh),
        "spec": gpu_pod_spec(
            args, mesh, container, volumes, restartPolicy="Never", subdomain=service, automountServiceAccountToken=False
        ),
    }


def fabric_job_spec(args: JobArgs, template: dict[str, Any]) -> dict[str, Any]:
    nodes = args.plan.nodes
    return {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        "backoffLimit": 0,  # a slow or broken fabric is a finding, not something to retry
        "activeDeadlineSeconds": GATE_DEADLINE_S,
        "template": template,
    }


# Multi-node NVLink (GB200 UltraServers): each job's pods claim the IMEX channel of the job's own
# ComputeDomain (NVIDIA DRA driver), and GPU Feature Discovery labels the nodes of one NVLink domain
# with the same clique (docs/hardware.md "EKS").
IMEX_CLAIM = "imex-channel"
CLIQUE_LABEL = "nvidia.com/gpu.clique"


def spans_nodes_over_nvlink(plan: Plan) -> bool:
    """The plan's NVLink domain is larger than one node: the job needs IMEX channels (the vendor row's
    cross_node_domain_needs_imex; a Trn2 UltraServer's NeuronLink needs none)."""
    return plan.hardware.vendor_row.cross_node_domain_needs_imex and plan.topology.nodes_per_domain > 1


def imex_channel_template(mesh: str) -> str:
    """The ResourceClaimTemplate the job's ComputeDomain generates (and its pods claim)."""
    return f"{mesh}-imex-channel"


def compute_domain(
    name: str, namespace: pulumi.Input[str], mesh: str, opts: pulumi.ResourceOptions
) -> k8s.apiextensions.CustomResource:
    """One ComputeDomain per job: the driver starts IMEX daemons on the job's nodes as its pods arrive.
    numNodes 0: with the driver's default IMEXDaemonsWithDNSNames (25.8+) it only feeds the status,
    and the job (torchrun's rendezvous) is its own source of truth for the workers online."""
    return k8s.apiextensions.CustomResource(
        name,
        api_version="resource.nvidia.com/v1beta1",
        kind="ComputeDomain",
        metadata=meta(mesh, namespace),
        spec={"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": imex_channel_template(mesh)}}},
        opts=opts,
    )


def nvlink_domain_affinity(plan: Plan, mesh: str) -> dict[str, Any]:
    """Pods of the job on as few NVLink domains as possible: required to share one clique when the job
    fits in a domain, else preferred (each UltraServer node group then fills whole domains, and the
    trainer's rank order, supernode.core.topology.rank_order, keeps every EP/TP group inside one)."""
    term = {"labelSelector": {"matchLabels": {MESH_LABEL: mesh}}, "topologyKey": CLIQUE_LABEL}
    if plan.nodes <= plan.topology.nodes_per_domain:
        return {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
    return {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}


def gpu_pod_spec(
    args: JobArgs,
    mesh: str,
    container: dict[str, Any],
    volumes: Sequence[dict[str, Any]] = (),
    roles: Sequence[str] = ("training",),
    **spec: Any,
) -> dict[str, Any]:
    """A pod owning one whole GPU node of `roles` (ROLE_LABEL): all its GPUs and EFA devices, one pod
    of the mesh per node, and on UltraServers the IMEX channel of the job's ComputeDomain."""
    imex = spans_nodes_over_nvlink(args.plan)
    resources = pod_resources(args.plan.pod)
    if imex:
        resources["claims"] = [{"name": IMEX_CLAIM}]
        spec = {
            "resourceClaims": [{"name": IMEX_CLAIM, "resourceClaimTemplateName": imex_channel_template(mesh)}],
            **spec,
        }
    c = {
        **container,
        "env": [{"name": k, "value": v} for k, v in FABRIC_ENV.items()] + container.get("env", []),
        "resources": resources,
        # EFA pins memory for RDMA: IPC_LOCK, and nothing else beyond the runtime defaults.
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"add": ["IPC_LOCK"]}},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}] + container.get("volumeMounts", []),
    }
    # Training's nodes only unless queued (the gate, which no queue places, is the world's check); a queued
    # job may also land on serving's nodes, where Kueue admits it on serving's lent flavor (its labels).
    affinity = args.gpu_nodes.affinity([{"key": ROLE_LABEL, "operator": "In", "values": list(roles)}])
    affinity["podAntiAffinity"] = {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {MESH_LABEL: mesh}}, "topologyKey": "kubernetes.io/hostname"}
        ]
    }
    if imex:
        affinity["podAffinity"] = nvlink_domain_affinity(args.plan, mesh)
    return {
        "tolerations": args.gpu_nodes.tolerations(),
        "affinity": affinity,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "priorityClassName": args.priority_class,
        "containers": [c],
        # NCCL and the data loader share memory through /dev/shm; it counts against the memory limit.
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}, *volumes],
        **spec,
    }


def mesh_policy(
    name: str, namespace: pulumi.Input[str], mesh: str, opts: pulumi.ResourceOptions
) -> k8s.networking.v1.NetworkPolicy:
    """Pods of one job may reach each other (rendezvous, NCCL bootstrap and socket traffic) and nothing
    else may reach them. All TCP ports: NCCL listens on ephemeral ports; EFA/SRD bypasses the pod network."""
    return k8s.networking.v1.NetworkPolicy(
        name, metadata=meta(mesh_policy_name(mesh), namespace), spec=mesh_policy_spec(mesh), opts=opts
    )


def mesh_policy_name(mesh: str) -> str:
    return f"allow-mesh-{mesh}"


def mesh_policy_spec(mesh: str) -> dict[str, Any]:
    """The mesh NetworkPolicy's spec (also a submitted job's, supernode.tools.jobs_cluster)."""
    peers = [{"podSelector": {"matchLabels": {MESH_LABEL: mesh}}}]
    return {
        "podSelector": {"matchLabels": {MESH_LABEL: mesh}},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": peers, "ports": [{"protocol": "TCP"}]}],
        "egress": [{"to": peers, "ports": [{"protocol": "TCP"}]}],
    }


def headless_service(
    name: str, service: str, namespace: pulumi.Input[str], mesh: str, opts: pulumi.ResourceOptions
) -> k8s.core.v1.Service:
    return k8s.core.v1.Service(
        name,
        metadata=meta(service, namespace),
        spec={
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {MESH_LABEL: mesh},
            "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT}],
        },
        opts=opts,
    )


def fabric_mesh(name: str, args: JobArgs, mesh: str, parent: pulumi.Resource) -> list[pulumi.Resource]:
    """What the pods of a fabric run (the gate, the scheduled check) need before they start: the mesh
    NetworkPolicy, the headless Service giving them stable DNS names <job>-<index>.<mesh>, and where
    the plan spans nodes over NVLink a ComputeDomain of their own whose IMEX channel they claim."""
    child = pulumi.ResourceOptions(parent=parent)
    needs: list[pulumi.Resource] = [
        mesh_policy(f"{name}-mesh", args.namespace, mesh, child),
        headless_service(f"{name}-svc", mesh, args.namespace, mesh, child),
    ]
    if spans_nodes_over_nvlink(args.plan):
        needs.append(
            compute_domain(
                f"{name}-compute-domain",
                args.namespace,
                mesh,
                pulumi.ResourceOptions(parent=parent, depends_on=list(args.wait_for)),
            )
        )
    return needs


class InterconnectGate(pulumi.ComponentResource):
    """Indexed Job, one pod per GPU node, running `supernode.trainer.node.fabric` (all_reduce and all_to_all bus
    bandwidth) under torchrun; it fails below the plan's floor (`gate_floor_gbytes_s`, read from the
    mounted plan file). Pulumi waits for a Job to complete, so anything that depends on `job` is
    created only after the fabric passed."""

    def __init__(
        self,
        name: str,
        args: JobArgs,
        job_name: str,
        opts: pulumi.ResourceOptions | None = None,
        baseline: BaselineStore | None = None,
    ):
        super().__init__("supernode:workload:InterconnectGate", name, None, opts)
        plan, mesh = args.plan, job_name
        if plan.gate_floor_gbytes_s is None:
            # The fabric check would refuse the plan (exit 2) only once the GPU nodes are up: say so now.
            raise pulumi.RunError(
                f"no interconnect gate floor for {plan.instance_type}: the catalog publishes no "
                f"all_reduce baseline for it (its row's all_reduce_baseline_gbytes_s in supernode/core/catalog.py)"
            )
        self.min_busbw_gbytes_s = plan.gate_floor_gbytes_s
        after = fabric_mesh(name, args, mesh, self)
        # The first gate records the fabric baseline, every later one compares with it (and fails when a node
        # regressed).
        template = fabric_pod_template(args, mesh, job_name, baseline, "gate.json", job_name=job_name)
        # Pulumi waits for the Job to complete and fails the update if it fails; replaceUnready makes
        # the next `pulumi up` run a fresh gate instead of waiting on the failed one.
        self.job = k8s.batch.v1.Job(
            f"{name}-job",
            metadata=meta(job_name, args.namespace, annotations={"pulumi.com/replaceUnready": "true"}),
            spec=fabric_job_spec(args, template),
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=after,
                delete_before_replace=True,
                custom_timeouts=pulumi.CustomTimeouts(create=f"{GATE_DEADLINE_S // 60 + 10}m"),
            ),
        )
        self.register_outputs({"job": self.job.metadata.name, "min_busbw_gbytes_s": self.min_busbw_gbytes_s})


def pretrained_init(plan: Plan, image: str, trainer: dict[str, Any], volumes: list[dict[str, Any]]) -> dict | None:
    """The init container that makes `training.initFrom` local and verified (supernode.trainer.hf.fetch,
    exit non-zero on a mismatch, so the pod never starts training); adds the trainer's --init-from, its
    read-only mount and the volume. None without initFrom."""
    t = plan.training
    if not t.init_from:
        return None
    remote = is_remote(t.init_from)
    if remote:  # downloaded by the init container into the pod's own volume
        volumes.append({"name": "pretrained", "emptyDir": {}})
        source, mount = t.init_from, {"name": "pretrained", "mountPath": PRETRAINED_PATH}
    else:  # verified in place on FSx, never written to
        sub = t.init_from.removeprefix(FSX_ROOT).strip("/")
        source, mount = PRETRAINED_PATH, {"name": "fsx", "mountPath": PRETRAINED_PATH, "subPath": sub}
    trainer["args"] = [*trainer["args"], "--init-from", PRETRAINED_PATH]
    trainer["volumeMounts"] = [*trainer["volumeMounts"], {**mount, "readOnly": True}]
    small = {"cpu": "2", "memory": "4Gi"}
    return {
        "name": "verify-weights",
        "image": image,
        "command": ["python", "-m", "supernode.trainer.hf.fetch", "--from", source, "--to", PRETRAINED_PATH]
        + (["--sha256", t.init_from_sha256] if t.init_from_sha256 else []),
        "volumeMounts": [{**mount, "readOnly": not remote}],
        "resources": {"requests": small, "limits": small},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


@dataclass(frozen=True)
class TrainerArgs:
    job: JobArgs
    service_account: pulumi.Input[str]
    pvc: pulumi.Input[str]
    data_subpath: str  # inside the FSx volume
    checkpoint_subpath: str
    termination_grace_s: int
    # Created only after these: the interconnect gate's Job (which Pulumi awaits to completion),
    # the PyTorchJob CRD and the operator that admits it (and the job's Kueue LocalQueue).
    wait_for: Sequence[pulumi.Resource] = ()
    # Kueue's queue-name and priority-class labels (supernode.components.k8s.queues.job_labels): the job is admitted
    # as one Workload, all of its workers or none.
    queue_labels: Mapping[str, str] = field(default_factory=dict)


def scrape_policy(
    name: str, namespace: pulumi.Input[str], mesh: str, opts: pulumi.ResourceOptions
) -> k8s.networking.v1.NetworkPolicy:
    """The namespace denies all ingress: let the CloudWatch agent reach the metrics port, nothing else."""
    return k8s.networking.v1.NetworkPolicy(
        name,
        metadata=meta(f"allow-scrape-{mesh}", namespace),
        spec={
            "podSelector": {"matchLabels": {MESH_LABEL: mesh}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": METRICS_SCRAPER_NAMESPACE}
                            }
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": METRICS_PORT}],
                }
            ],
        },
        opts=opts,
    )


def trainer_container(args: TrainerArgs) -> dict[str, Any]:
    """The worker's container: supernode.trainer.train under supernode.trainer.launch, on the plan file,
    the data and the checkpoints (both on FSx)."""
    plan = args.job.plan
    return {
        "name": "pytorch",  # the operator injects the PET_* rendezvous env into this container name
        "image": args.job.image,
        # supernode.trainer.launch: torchrun whose exit code says a recorded failure (bad input 2, failed 1)
        # apart from a signal, so the ExitCode restart policy (pytorch_job_spec) retries only what can recover.
        "command": launch(args.termination_grace_s) + ["supernode.trainer.train"],
        # Rank 0 serves its gauges on the pod IP (not loopback) for the CloudWatch agent's scrape.
        "args": [
            "--plan",
            PLAN_MOUNT_PATH,
            "--data",
            DATA_PATH,
            "--out",
            CHECKPOINT_PATH,
            *("--run-id", plan.training.run or plan.stack),  # training.run, else one run per stack
            # metrics every step are counters; Kineto on one step in PROFILE_EVERY (issue 39)
            *("--log-every", "1", "--profile-every", str(PROFILE_EVERY)),
            "--prometheus-port",
            str(METRICS_PORT),
            "--prometheus-addr",
            "$(POD_IP)",
        ],
        "env": [field_env("POD_IP", "status.podIP")],
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
        "volumeMounts": [
            PLAN_VOLUME_MOUNT,
            {"name": "fsx", "mountPath": DATA_PATH, "subPath": args.data_subpath, "readOnly": True},
            {"name": "fsx", "mountPath": CHECKPOINT_PATH, "subPath": args.checkpoint_subpath},
        ],
    }


def trainer_pod_template(args: TrainerArgs, mesh: str) -> dict[str, Any]:
    """A worker's pod: the trainer, the plan and FSx volumes, and with training.initFrom the init
    container that verifies the pretrained weights first."""
    container = trainer_container(args)
    volumes = [plan_volume(args.job), {"name": "fsx", "persistentVolumeClaim": {"claimName": args.pvc}}]
    init = pretrained_init(args.job.plan, args.job.image, container, volumes)
    # A changed plan replaces the job (the spec changes with its hash); checkpoints carry the run over.
    return {
        "metadata": pod_metadata(args.job, mesh, SCRAPE_ANNOTATIONS),
        "spec": gpu_pod_spec(
            args.job,
            mesh,
            container,
            volumes,
            # queued: Kueue places it on training's flavor, or on serving's idle share it borrows
            roles=("training", "serving") if args.queue_labels else ("training",),
            serviceAccountName=args.service_account,
            # the trainer writes a checkpoint on SIGTERM before exiting
            terminationGracePeriodSeconds=args.termination_grace_s,
            **({"initContainers": [init]} if init else {}),
        ),
    }


def pytorch_job_spec(plan: Plan, template: dict[str, Any]) -> dict[str, Any]:
    nodes = plan.nodes
    return {
        "nprocPerNode": str(plan.accelerators_per_node),
        # Elastic between training.minNodes and the planned nodes: a lost node shrinks the job
        # (the trainer picks the plan's layout for the world it gets, Plan.for_world) instead
        # of stopping it, and a replacement (a spare node) grows it back.
        "elasticPolicy": {
            "rdzvBackend": "c10d",
            "minReplicas": plan.min_nodes,
            "maxReplicas": nodes,
            "maxRestarts": plan.training.max_restarts,
        },
        "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": plan.training.max_restarts},
        # ExitCode: the operator restarts a pod for a signal (128-255: OOM kill, node loss) and
        # fails the job for 1-127, which supernode.trainer.launch returns only once torchrun's own elastic
        # restarts are spent or the failure is recorded as one no restart can fix.
        "pytorchReplicaSpecs": {"Worker": {"replicas": nodes, "restartPolicy": "ExitCode", "template": template}},
    }


class TrainerJob(pulumi.ComponentResource):
    """PyTorchJob (kubeflow.org/v1), elastic with c10d rendezvous, one worker per GPU node."""

    def __init__(self, name: str, args: TrainerArgs, job_name: str, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:workload:TrainerJob", name, None, opts)
        plan, mesh, namespace = args.job.plan, job_name, args.job.namespace
        child = pulumi.ResourceOptions(parent=self)
        self.name = job_name
        self.policy = mesh_policy(f"{name}-mesh", namespace, mesh, child)
        self.scrape_policy = scrape_policy(f"{name}-scrape", namespace, mesh, child)
        after: list[pulumi.Resource] = [self.policy, self.scrape_policy]
        if spans_nodes_over_nvlink(plan):
            after.append(
                compute_domain(
                    f"{name}-compute-domain",
                    namespace,
                    mesh,
                    pulumi.ResourceOptions(parent=self, depends_on=list(args.job.wait_for)),
                )
            )
        # `pulumi up` succeeds once the workers run (admitted, scheduled, images pulled), not at creation.
        self.job = k8s.apiextensions.CustomResource(
            f"{name}-job",
            api_version="kubeflow.org/v1",
            kind="PyTorchJob",
            metadata=meta(
                job_name, namespace, labels=args.queue_labels, annotations={"pulumi.com/waitFor": "condition=Running"}
            ),
            spec=pytorch_job_spec(plan, trainer_pod_template(args, mesh)),
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=[*after, *args.wait_for],
                delete_before_replace=True,
                replace_on_changes=["spec"],
                custom_timeouts=pulumi.CustomTimeouts(create="30m"),
            ),
        )
        self.register_outputs({"job": job_name, "workers": plan.nodes, "nproc_per_node": plan.accelerators_per_node})
