"""The supernode Pulumi program: `program(stack, cfg, plan)` declares every resource of the stack from
the validated config and its plan, and exports the stack outputs. Thin wiring: the AWS components in
the order each needs the one before, the stack outputs, then the Kubernetes side (`kubernetes`).

Importing it declares nothing. The Pulumi CLI runs `main()` through the root `__main__.py`, with the
config the engine holds; `supernode preview` calls `program` under the mock engine. Living in the
package, it ships in the wheel (`pip install .`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pulumi
import pulumi_aws as aws

from supernode.components.aws.accelerators import Accelerators, AcceleratorsArgs
from supernode.components.aws.cluster import (
    NODE_ADDONS,
    SERVICE_CIDR,
    WORKLOAD_ADDONS,
    Cluster,
    ClusterArgs,
    TeamAccess,
    TeamAccessArgs,
)
from supernode.components.aws.identity import (
    Keys,
    KeysArgs,
    NodeRole,
    ServiceAccountRole,
    ServiceAccountRoleArgs,
    TrainerRole,
    TrainerRoleArgs,
    checkpoint_retention_policy,
    metrics_agent_policy,
    node_health_agent_policy,
)
from supernode.components.aws.management import ManagementLb, ManagementLbArgs, audit_writer_policy
from supernode.components.aws.monitoring import Monitoring, MonitoringArgs
from supernode.components.aws.network import Network, NetworkArgs
from supernode.components.aws.outputs import export_stack_outputs
from supernode.components.aws.registry import Registry, RegistryArgs
from supernode.components.aws.storage import Storage, StorageArgs
from supernode.components.context import StackContext
from supernode.components.k8s.addons import AddonArgs, ClusterAddons
from supernode.components.k8s.common import GpuNodes, dns_name
from supernode.components.k8s.jobs import (
    BaselineStore,
    InterconnectGate,
    JobArgs,
    TrainerArgs,
    TrainerJob,
    spans_nodes_over_nvlink,
)
from supernode.components.k8s.management_ui import NAME as MANAGEMENT_UI_SA
from supernode.components.k8s.management_ui import NAMESPACE as MANAGEMENT_NAMESPACE
from supernode.components.k8s.management_ui import ManagementUi, ManagementUiArgs
from supernode.components.k8s.namespace import PRIORITY_CLASS, FsxVolume, NamespaceArgs, TrainingNamespace
from supernode.components.k8s.operations import (
    NODE_HEALTH_NAMESPACE,
    NODE_HEALTH_SA,
    RETENTION_SA,
    Operations,
    OperationsArgs,
    stack_file,
)
from supernode.components.k8s.queue_metrics import QueueMetrics, QueueMetricsArgs
from supernode.components.k8s.queues import (
    SERVING,
    TRAINING,
    KueueArgs,
    KueueController,
    Queues,
    QueuesArgs,
    gpu_pools,
    job_labels,
)
from supernode.components.k8s.serving import ServingArgs, ServingWorkload, serving_app
from supernode.components.k8s.teams import TeamAdmin, TeamAdminArgs, TeamNamespace, TeamNamespaceArgs, team_namespaces
from supernode.components.k8s.workload import TrainingWorkload
from supernode.components.stack_config import stack_config
from supernode.core import teams as team_names
from supernode.core.config import StackConfig
from supernode.core.contract import CONTRACT_VERSION
from supernode.core.observability import PROMETHEUS_AGENT, team_queues
from supernode.core.plan import Plan, build_plan


def main() -> None:
    """The Pulumi CLI's program: the stack's config as the engine holds it, validated, and its plan."""
    stack = pulumi.get_stack()
    cfg = stack_config()
    program(stack, cfg, build_plan(stack, cfg))


def program(stack: str, cfg: StackConfig, plan: Plan) -> None:
    """Every resource of the stack and its outputs: AWS, then Kubernetes on the cluster."""
    pulumi.export("plan", plan.summary())

    # Stack name, region, account and tags: passed once, as the first field of every component's Args.
    ctx = StackContext.create(stack, cfg.region, aws.get_caller_identity_output().account_id)
    cluster_name = f"supernode-{stack}"

    # AWS: keys, network, the cluster and its nodes, storage, identities, registry, monitoring.
    keys = Keys("keys", KeysArgs(ctx=ctx, identity=cfg.identity))
    network = _network(ctx, cfg, cluster_name, keys)
    cluster = _cluster(ctx, cfg, cluster_name, network, keys)
    node_role = NodeRole("node-role", ctx)
    node_addons = cluster.install_addons(NODE_ADDONS)
    accelerators = _accelerators(ctx, cfg, cluster, network, node_role, node_addons)
    workload_addons = cluster.install_addons(WORKLOAD_ADDONS, depends_on=accelerators.node_groups)
    storage = _storage(ctx, cfg, plan, network, accelerators, keys)
    trainer_role = _trainer_role(ctx, cfg, cluster, storage, keys)
    registry = Registry("registry", RegistryArgs(ctx=ctx, kms_key_arn=keys.data_key_arn))  # `make image` pushes here
    monitoring = _monitoring(ctx, cfg, plan, cluster, storage, keys, accelerators)
    metrics_agent_role = _metrics_agent_role(ctx, cluster, monitoring)
    # The node health agent reads NVIDIA's tools; other vendors' nodes get neither it nor its role yet.
    node_health_role = (
        _node_health_role(ctx, cluster, cluster_name, list(accelerators.labels))
        if plan.hardware.vendor_row.node_agent
        else None
    )
    retention_role = _retention_role(ctx, cfg, cluster, storage, keys)
    if cfg.teams:  # each team's IAM role reaches the cluster as its Kubernetes group, nothing more
        TeamAccess("team-access", TeamAccessArgs(ctx=ctx, cluster_name=cluster.cluster.name, teams=cfg.teams))
    management = _management(ctx, cfg, cluster, network, accelerators, keys)
    _export_stack_outputs(keys, network, cluster, accelerators, storage, trainer_role, registry, monitoring, management)

    # The Kubernetes side, on the cluster once its GPU nodes, its workload add-ons and the CloudWatch add-on
    # (which creates amazon-cloudwatch, where the scrape configuration goes) are up.
    kubernetes(
        ctx,
        cfg,
        plan,
        AwsOutputs(
            kubeconfig=cluster.kubeconfig,
            fsx=FsxVolume(
                id=storage.fsx_id,
                dns_name=storage.fsx_dns_name,
                mount_name=storage.fsx_mount_name,
                size_gib=storage.fsx_capacity_gib,
                data_dir=storage.dataset_dir,
                checkpoint_dir=storage.checkpoint_dir,
            ),
            baseline_dir=storage.baseline_dir,
            bucket_name=storage.bucket_name,
            trainer_role_arn=trainer_role.arn,
            metrics_agent_role_arn=metrics_agent_role.arn,
            node_health_role_arn=node_health_role.arn if node_health_role else None,
            retention_role_arn=retention_role.arn,
            gpu_nodes=GpuNodes.for_groups(accelerators.labels, accelerators.taints),
            cluster_name=cluster_name,
            management=management,
            after=[*accelerators.node_groups, *workload_addons, monitoring.agent_addon],
        ),
    )


@dataclass(frozen=True)
class ManagementOutputs:
    """The management page's AWS side, what its Deployment reads."""

    lb_arn: pulumi.Input[str]  # the signer of the identity header the page trusts
    audit_log_group: pulumi.Input[str]
    role_arn: pulumi.Input[str]
    dns_name: pulumi.Input[str]  # the internal load balancer's


def _management(
    ctx: StackContext, cfg: StackConfig, cluster: Cluster, network: Network, accelerators: Accelerators, keys: Keys
) -> ManagementOutputs | None:
    """The page's internal load balancer, audit log group and IRSA role; None without management.ui."""
    if cfg.management.ui is None:
        return None
    lb = ManagementLb(
        "management",
        ManagementLbArgs(
            ctx=ctx,
            management=cfg.management,
            vpc_id=network.vpc_id,
            subnet_ids=network.private_subnet_ids,
            node_security_group_id=cluster.security_group_id,
            node_autoscaling_group=accelerators.system_node_group.resources.apply(
                lambda r: r[0].autoscaling_groups[0].name
            ),
            logs_kms_key_arn=keys.ops.arn,
        ),
    )
    role = ServiceAccountRole(
        "management-ui-role",
        ServiceAccountRoleArgs(
            ctx=ctx,
            namespace=MANAGEMENT_NAMESPACE,
            service_account=MANAGEMENT_UI_SA,
            oidc_provider_arn=cluster.oidc_provider_arn,
            oidc_issuer_url=cluster.oidc_issuer_url,
            policy=lb.audit_log_group.arn.apply(lambda arn: json.dumps(audit_writer_policy(arn))),
            description=f"supernode {ctx.stack}: the management page writes its audit records",
        ),
    )
    return ManagementOutputs(
        lb_arn=lb.arn, audit_log_group=lb.audit_log_group.name, role_arn=role.arn, dns_name=lb.dns_name
    )


def _network(ctx: StackContext, cfg: StackConfig, cluster_name: str, keys: Keys) -> Network:
    return Network(
        "network",
        NetworkArgs(
            ctx=ctx,
            network=cfg.network,
            gpu_availability_zone=cfg.availability_zone,
            cluster_name=cluster_name,
            log_retention_days=cfg.monitoring.log_retention_days,
            logs_kms_key_arn=keys.ops.arn,
        ),
    )


def _cluster(ctx: StackContext, cfg: StackConfig, cluster_name: str, network: Network, keys: Keys) -> Cluster:
    return Cluster(
        "cluster",
        ClusterArgs(
            ctx=ctx,
            cluster_name=cluster_name,
            cluster=cfg.cluster,
            subnet_ids=network.private_subnet_ids,
            secrets_kms_key_arn=keys.eks.arn,
            logs_kms_key_arn=keys.ops.arn,
            log_retention_days=cfg.monitoring.log_retention_days,
        ),
    )


def _accelerators(
    ctx: StackContext,
    cfg: StackConfig,
    cluster: Cluster,
    network: Network,
    node_role: NodeRole,
    node_addons: Sequence[pulumi.Resource],
) -> Accelerators:
    """The accelerator node groups in the GPU subnet and the system node group in the private subnets,
    once the add-ons nodes need to join (`node_addons`) are in."""
    return Accelerators(
        "accelerators",
        AcceleratorsArgs(
            ctx=ctx,
            kubernetes_version=cfg.cluster.kubernetes_version,
            groups=cfg.accelerator_node_groups,
            system=cfg.system_node_group,
            cluster_name=cluster.cluster.name,
            cluster_endpoint=cluster.endpoint,
            cluster_certificate_authority=cluster.certificate_authority,
            cluster_security_group_id=cluster.security_group_id,
            service_cidr=SERVICE_CIDR,
            vpc_id=network.vpc_id,
            gpu_subnet_id=network.gpu_subnet_id,
            system_subnet_ids=network.private_subnet_ids,
            node_role_arn=node_role.arn,
            hugepages_2mi_gib=cfg.workload.hugepages_2mi_gib,
            node_dependencies=node_addons,
        ),
    )


def _storage(
    ctx: StackContext, cfg: StackConfig, plan: Plan, network: Network, accelerators: Accelerators, keys: Keys
) -> Storage:
    """The bucket and FSx, in the GPU subnet, open to the GPU nodes (their EFA security group)."""
    return Storage(
        "storage",
        StorageArgs(
            ctx=ctx,
            storage=cfg.storage,
            plan=plan,
            vpc_id=network.vpc_id,
            fsx_subnet_id=network.gpu_subnet_id,
            node_security_group_id=accelerators.efa_security_group_id,
            data_kms_key_arn=keys.data_key_arn,
            logs_kms_key_arn=keys.ops.arn,
            log_retention_days=cfg.monitoring.log_retention_days,
            weights_prefix=cfg.inference.weights_prefix if cfg.inference else None,
        ),
    )


def _trainer_role(ctx: StackContext, cfg: StackConfig, cluster: Cluster, storage: Storage, keys: Keys) -> TrainerRole:
    return TrainerRole(
        "trainer-role",
        TrainerRoleArgs(
            ctx=ctx,
            identity=cfg.identity,
            storage=cfg.storage,
            namespace=cfg.workload.namespace,
            service_account=cfg.workload.service_account,
            cluster_name=cluster.cluster.name,
            oidc_provider_arn=cluster.oidc_provider_arn,
            oidc_issuer_url=cluster.oidc_issuer_url,
            bucket_arn=storage.bucket_arn,
            data_key_arn=keys.data_key_arn,
            init_from=cfg.training.init_from,
            team_namespaces=[team_names.namespace(t.name) for t in cfg.teams],
        ),
    )


def _monitoring(
    ctx: StackContext,
    cfg: StackConfig,
    plan: Plan,
    cluster: Cluster,
    storage: Storage,
    keys: Keys,
    accelerators: Accelerators,
) -> Monitoring:
    return Monitoring(
        "monitoring",
        MonitoringArgs(
            ctx=ctx,
            monitoring=cfg.monitoring,
            cluster=cluster,
            fsx_id=storage.fsx_id,
            fsx_capacity_gib=storage.fsx_capacity_gib,
            ops_kms_key_arn=keys.ops.arn,
            node_groups=accelerators.node_groups,
            plan=plan,
            training_namespace=cfg.workload.namespace,
            # The training queues the queue alarms watch: the stack's, or each team's.
            queues=team_queues(
                [p.accelerator for p in plan.pools], cfg.workload.namespace, [t.name for t in cfg.teams]
            ),
            serving_model=serving_app(ctx.stack) if cfg.inference else None,
        ),
    )


def _metrics_agent_role(ctx: StackContext, cluster: Cluster, monitoring: Monitoring) -> ServiceAccountRole:
    """The CloudWatch agent's Prometheus scrape: it writes to monitoring's Prometheus log group."""
    return ServiceAccountRole(
        "metrics-agent-role",
        ServiceAccountRoleArgs(
            ctx=ctx,
            namespace=PROMETHEUS_AGENT.namespace,
            service_account=PROMETHEUS_AGENT.name,
            oidc_provider_arn=cluster.oidc_provider_arn,
            oidc_issuer_url=cluster.oidc_issuer_url,
            policy=monitoring.prometheus_log_group_arn.apply(lambda arn: json.dumps(metrics_agent_policy(arn))),
            description=f"supernode {ctx.stack}: the CloudWatch agent's Prometheus scrape (training health, DCGM)",
        ),
    )


def _node_health_role(
    ctx: StackContext, cluster: Cluster, cluster_name: str, gpu_groups: list[str]
) -> ServiceAccountRole:
    """The node health agent's: it replaces broken nodes of `gpu_groups`."""
    return ServiceAccountRole(
        "node-health-role",
        ServiceAccountRoleArgs(
            ctx=ctx,
            namespace=NODE_HEALTH_NAMESPACE,
            service_account=NODE_HEALTH_SA,
            oidc_provider_arn=cluster.oidc_provider_arn,
            oidc_issuer_url=cluster.oidc_issuer_url,
            policy=pulumi.Output.from_input(ctx.account_id).apply(
                lambda account: json.dumps(node_health_agent_policy(ctx.region, account, cluster_name, gpu_groups))
            ),
            description=f"supernode {ctx.stack}: the node health agent replaces broken GPU nodes",
        ),
    )


def _retention_role(
    ctx: StackContext, cfg: StackConfig, cluster: Cluster, storage: Storage, keys: Keys
) -> ServiceAccountRole:
    """`supernode checkpoints --retain` in the cluster (operations.py): list, read markers, tag; nothing else."""
    return ServiceAccountRole(
        "checkpoint-retention-role",
        ServiceAccountRoleArgs(
            ctx=ctx,
            namespace=cfg.workload.namespace,
            service_account=RETENTION_SA,
            oidc_provider_arn=cluster.oidc_provider_arn,
            oidc_issuer_url=cluster.oidc_issuer_url,
            policy=pulumi.Output.all(storage.bucket_arn, keys.data_key_arn).apply(
                lambda a: json.dumps(checkpoint_retention_policy(a[0], cfg.storage.checkpoint_prefix, a[1], ctx.region))
            ),
            description=f"supernode {ctx.stack}: checkpoint retention tags the checkpoints for the lifecycle rules",
        ),
    )


def _export_stack_outputs(
    keys: Keys,
    network: Network,
    cluster: Cluster,
    accelerators: Accelerators,
    storage: Storage,
    trainer_role: TrainerRole,
    registry: Registry,
    monitoring: Monitoring,
    management: ManagementOutputs | None,
) -> None:
    """The contract's stack outputs (supernode.core.contract), from the AWS components."""
    log_groups = [cluster.log_group_name, storage.fsx_log_group_name, *monitoring.log_group_names]
    if network.flow_log_group_name is not None:
        log_groups.append(network.flow_log_group_name)
    export_stack_outputs(
        {
            "contract_version": CONTRACT_VERSION,
            "cluster_name": cluster.cluster.name,
            "cluster_endpoint": cluster.endpoint,
            "cluster_version": cluster.cluster.version,
            "oidc_issuer_url": cluster.oidc_issuer_url,
            "oidc_provider_arn": cluster.oidc_provider_arn,
            "node_group_names": accelerators.node_group_names,
            "system_node_group_name": accelerators.system_node_group.node_group_name,
            "vpc_id": network.vpc_id,
            "private_subnet_ids": network.private_subnet_ids,
            "gpu_subnet_id": network.gpu_subnet_id,
            "efa_security_group_id": accelerators.efa_security_group_id,
            "bucket_name": storage.bucket_name,
            "dataset_prefix": storage.dataset_prefix,
            "checkpoint_prefix": storage.checkpoint_prefix,
            "fsx_id": storage.fsx_id,
            "fsx_dns_name": storage.fsx_dns_name,
            "fsx_mount_name": storage.fsx_mount_name,
            "kms_key_arns": keys.arns,
            "sns_topic_arn": monitoring.topic_arn,
            "trainer_role_arn": trainer_role.arn,
            "log_group_names": log_groups,
            "alarm_names": monitoring.alarm_names,
            "kubeconfig": cluster.kubeconfig,
            "trainer_repository_url": registry.url,
            "management_ui": None
            if management is None
            else {"load_balancer_dns_name": management.dns_name, "audit_log_group": management.audit_log_group},
        }
    )


@dataclass(frozen=True)
class AwsOutputs:
    """What the Kubernetes side reads from the AWS side."""

    kubeconfig: pulumi.Input[str]
    fsx: FsxVolume
    baseline_dir: str  # the FSx directory of the fabric baselines, exported to the bucket
    bucket_name: pulumi.Input[str]  # where the restore drill restores from
    trainer_role_arn: pulumi.Input[str]
    metrics_agent_role_arn: pulumi.Input[str]  # the CloudWatch agent's Prometheus scrape
    node_health_role_arn: pulumi.Input[str] | None  # the node health agent's (NVIDIA nodes only)
    retention_role_arn: pulumi.Input[str]  # the checkpoint retention CronJob's
    gpu_nodes: GpuNodes
    cluster_name: str
    management: ManagementOutputs | None = None  # the management page's load balancer (management.ui)
    # What the cluster needs before any workload object: the Kubernetes provider waits for it.
    after: Sequence[pulumi.Resource] = ()


def kubernetes(ctx: StackContext, cfg: StackConfig, plan: Plan, from_aws: AwsOutputs) -> TrainingWorkload:
    """The Kubernetes side, as children of one TrainingWorkload (its provider reaches the cluster), each
    after what it needs: add-ons and Kueue's controller, whose webhooks admit every job and serving pod
    of the queued namespaces; the training namespace; the interconnect gate; serving; the queues, a
    LocalQueue in each namespace; the trainer job, admitted once the gate passed; operations."""
    wl = cfg.workload
    workload = TrainingWorkload("workload", from_aws.kubeconfig, from_aws.after)
    addons = _cluster_addons(ctx, cfg, plan, from_aws, workload.child())
    serving_namespace = [] if cfg.inference is None else [cfg.inference.namespace]
    teams = _team_namespaces(cfg, plan, from_aws, workload.child())
    if from_aws.management is not None:
        _management_ui(cfg, plan, from_aws.management, teams, workload.child())
    kueue = KueueController(
        "workload-kueue",
        KueueArgs(
            namespaces=[wl.namespace, *serving_namespace, *(t.name for t in teams)],
            images=cfg.images.addons,
            fair_sharing=bool(teams),
        ),
        workload.child(),
    )
    # Its metrics Service and reader role, the visibility APIService (issue 36, item 5).
    QueueMetrics(
        "workload-queue-metrics",
        QueueMetricsArgs(kueue=kueue, image=cfg.images.trainer, window_s=cfg.monitoring.queue_wait_p95_minutes * 60),
        workload.child(),
    )
    training = _training_namespace(cfg, plan, from_aws, workload.child())
    job = JobArgs(
        namespace=training.name,
        image=cfg.images.trainer,
        gpu_nodes=from_aws.gpu_nodes,
        plan=plan,
        plan_config_map=training.plan_config_map.metadata.name,
        priority_class=training.priority_class.metadata.name,
        wait_for=addons.compute_domain_ready,
    )
    fabric = replace(job, image=cfg.images.fabric_check or cfg.images.trainer)
    store = BaselineStore(
        pvc=training.claim.metadata.name, subpath=from_aws.baseline_dir.strip("/"), regression=wl.fabric_regression
    )
    gate = InterconnectGate(
        "workload-gate",
        fabric,
        job_name=dns_name(plan.stack, "fabric-gate"),
        opts=workload.child(after=kueue.ready),
        baseline=store,
    )
    serving = _serving(cfg, plan, from_aws, workload.child(after=[*addons.ready, *kueue.ready]))
    queues = _queues(cfg, plan, kueue, training, serving, teams, workload.child())
    trainer = _trainer_job(
        cfg, plan, from_aws, job, training, [gate.job, *addons.ready, *queues.ready], workload.child()
    )
    _operations(
        ctx,
        cfg,
        from_aws,
        fabric,
        store,
        training,
        # the agent reads pods there (DCGM) and in serving's monitoring namespace (the SLO relay)
        workload.child(after=[*queues.ready, addons.namespace, *([serving.monitoring_namespace] if serving else [])]),
    )
    workload.register_outputs(
        {
            "namespace": training.name,
            "trainer_job": trainer.name,
            "gate_job": gate.job.metadata.name,
            "gate_min_busbw_gbytes_s": plan.gate_floor_gbytes_s,  # what the gate reads from the plan
            "dcgm_metrics_endpoint": addons.dcgm_endpoint,
            "priority_class": PRIORITY_CLASS,
            **(serving.outputs if serving else {}),
        }
    )
    return workload


def _cluster_addons(
    ctx: StackContext, cfg: StackConfig, plan: Plan, from_aws: AwsOutputs, opts: pulumi.ResourceOptions
) -> ClusterAddons:
    return ClusterAddons(
        "workload-addons",
        AddonArgs(
            region=ctx.region,
            gpu_nodes=from_aws.gpu_nodes,
            images=cfg.images.addons,
            compute_domains=spans_nodes_over_nvlink(plan),
            vendor=plan.hardware.vendor,
        ),
        opts,
    )


def _team_namespaces(
    cfg: StackConfig, plan: Plan, from_aws: AwsOutputs, opts: pulumi.ResourceOptions
) -> list[TeamNamespace]:
    """Each team's namespace, quota and Role (none without supernode:teams), and the admin group's read of them."""
    if not plan.teams:
        return []
    [shares] = plan.teams  # the config rules allow teams on one training pool
    shared = TeamNamespaceArgs(
        team=shares.teams[0],
        pod=plan.pod,
        cluster_version=cfg.cluster.kubernetes_version,
        pod_identity=cfg.identity.pod_identity == "pod-identity",
        service_account=cfg.workload.service_account,
        trainer_role_arn=from_aws.trainer_role_arn,
        fsx=from_aws.fsx,
    )
    namespaces = team_namespaces(shares.teams, shared, opts)
    TeamAdmin("workload-team-admin", TeamAdminArgs(namespaces=[t.namespace for t in namespaces]), opts)
    return namespaces


def _management_ui(
    cfg: StackConfig,
    plan: Plan,
    aws_side: ManagementOutputs,
    teams: Sequence[TeamNamespace],
    opts: pulumi.ResourceOptions,
) -> ManagementUi:
    """`supernode ui --cluster` behind the load balancer, with rights in the teams' namespaces only."""
    return ManagementUi(
        "workload-management-ui",
        ManagementUiArgs(
            stack=plan.stack,
            cfg=cfg,
            image=cfg.images.trainer,
            role_arn=aws_side.role_arn,
            signer=aws_side.lb_arn,
            audit_log_group=aws_side.audit_log_group,
            team_namespaces=[t.name for t in teams],
            lb_cidrs=cfg.network.private_subnet_cidrs or [cfg.network.vpc_cidr],
            after=[t.namespace for t in teams],
        ),
        opts,
    )


def _training_namespace(
    cfg: StackConfig, plan: Plan, from_aws: AwsOutputs, opts: pulumi.ResourceOptions
) -> TrainingNamespace:
    return TrainingNamespace(
        "workload-ns",
        NamespaceArgs(
            namespace=cfg.workload.namespace,
            service_account=cfg.workload.service_account,
            trainer_role_arn=from_aws.trainer_role_arn,
            pod_identity=cfg.identity.pod_identity == "pod-identity",
            cluster_version=cfg.cluster.kubernetes_version,
            fsx=from_aws.fsx,
            plan=plan,
        ),
        opts,
    )


def _serving(
    cfg: StackConfig, plan: Plan, from_aws: AwsOutputs, opts: pulumi.ResourceOptions
) -> ServingWorkload | None:
    """vLLM on the verified export, at serving priority in the same pools; None without inference."""
    if cfg.inference is None:
        return None
    return ServingWorkload(
        "workload-serving",
        ServingArgs(
            plan=plan,
            inference=cfg.inference,
            gpu_nodes=from_aws.gpu_nodes,
            fsx_id=from_aws.fsx.id,
            fsx_dns_name=from_aws.fsx.dns_name,
            fsx_mount_name=from_aws.fsx.mount_name,
            queue_labels=job_labels(plan, SERVING),
            addon_images=cfg.images.addons,
            relay_image=cfg.images.trainer,
            slo_window_s=cfg.monitoring.serving_slo_window_minutes * 60,
        ),
        opts,
    )


def _queues(
    cfg: StackConfig,
    plan: Plan,
    kueue: KueueController,
    training: TrainingNamespace,
    serving: ServingWorkload | None,
    teams: Sequence[TeamNamespace],
    opts: pulumi.ResourceOptions,
) -> Queues:
    """A ClusterQueue per GPU pool (with teams, one per team); the trainer is admitted through its
    LocalQueue, all workers or none."""
    return Queues(
        "workload-queues",
        QueuesArgs(
            pools=gpu_pools(cfg.accelerator_node_groups, plan),
            kueue=kueue,
            after=[training.namespace, *([serving.namespace] if serving else []), *(t.namespace for t in teams)],
            serving_namespace=cfg.inference.namespace if cfg.inference else None,
            teams=plan.teams,
            team_namespaces={t.team: t.name for t in teams},
        ),
        opts,
    )


def _trainer_job(
    cfg: StackConfig,
    plan: Plan,
    from_aws: AwsOutputs,
    job: JobArgs,
    training: TrainingNamespace,
    wait_for: Sequence[pulumi.Resource],
    opts: pulumi.ResourceOptions,
) -> TrainerJob:
    """The trainer job on the training namespace's claim, created after `wait_for` (the gate's job among them)."""
    return TrainerJob(
        "workload-trainer",
        TrainerArgs(
            job=job,
            service_account=training.service_account.metadata.name,
            pvc=training.claim.metadata.name,
            data_subpath=from_aws.fsx.data_dir.strip("/"),
            checkpoint_subpath=from_aws.fsx.checkpoint_dir.strip("/"),
            termination_grace_s=cfg.workload.termination_grace_s,
            wait_for=wait_for,
            queue_labels=job_labels(plan, TRAINING),
        ),
        job_name=dns_name(plan.stack, "train"),
        opts=opts,
    )


def _operations(
    ctx: StackContext,
    cfg: StackConfig,
    from_aws: AwsOutputs,
    fabric: JobArgs,
    store: BaselineStore,
    training: TrainingNamespace,
    opts: pulumi.ResourceOptions,
) -> Operations:
    """What runs on a schedule and feeds the monitoring (components/k8s/operations.py): the fabric
    re-check runs `fabric`'s job against the baselines in `store`."""
    return Operations(
        "workload-ops",
        OperationsArgs(
            job=fabric,
            workload=cfg.workload,
            pvc=training.claim.metadata.name,
            baseline_subpath=store.subpath,
            service_account=training.service_account.metadata.name,
            cluster_name=from_aws.cluster_name,
            region=ctx.region,
            stack_file=stack_file(cfg),
            bucket_name=from_aws.bucket_name,
            metrics_agent_role_arn=from_aws.metrics_agent_role_arn,
            node_health_role_arn=from_aws.node_health_role_arn,
            retention_role_arn=from_aws.retention_role_arn,
            addon_images=cfg.images.addons,
            serving=cfg.inference is not None,
        ),
        opts,
    )
