"""The supernode Pulumi program: thin wiring from the validated config and plan to the components.

It runs on import. The Pulumi CLI imports it through the root `__main__.py`; `supernode preview` runs
this file under the mock engine. Living in the package, it ships in the wheel (`pip install .`).
"""

import json

import pulumi
import pulumi_aws as aws

from components.aws.accelerators import Accelerators, AcceleratorsArgs
from components.aws.cluster import NODE_ADDONS, SERVICE_CIDR, WORKLOAD_ADDONS, Cluster, ClusterArgs
from components.aws.identity import (
    Keys,
    KeysArgs,
    NodeRole,
    ServiceAccountRole,
    ServiceAccountRoleArgs,
    TrainerRole,
    TrainerRoleArgs,
    metrics_agent_policy,
)
from components.aws.monitoring import Monitoring, MonitoringArgs
from components.aws.network import Network, NetworkArgs
from components.aws.outputs import export_stack_outputs
from components.aws.registry import Registry, RegistryArgs
from components.aws.storage import Storage, StorageArgs
from components.context import StackContext
from components.k8s.operations import PROMETHEUS_AGENT_SA
from components.k8s.workload import FsxVolume, GpuNodes, TrainingWorkload, WorkloadArgs
from components.stack_config import stack_config
from supernode.core.contract import CONTRACT_VERSION
from supernode.core.plan import build_plan

config = stack_config()
stack = pulumi.get_stack()
plan = build_plan(stack, config)
pulumi.export("plan", plan.summary())

# Stack name, region, account and tags: passed once, as the first field of every component's Args.
ctx = StackContext.create(stack, config.region, aws.get_caller_identity_output().account_id)
cluster_name = f"supernode-{stack}"
retention = config.monitoring.log_retention_days

keys = Keys("keys", KeysArgs(ctx=ctx, identity=config.identity))
network = Network(
    "network",
    NetworkArgs(
        ctx=ctx,
        network=config.network,
        gpu_availability_zone=config.availability_zone,
        cluster_name=cluster_name,
        log_retention_days=retention,
        logs_kms_key_arn=keys.ops.arn,
    ),
)
cluster = Cluster(
    "cluster",
    ClusterArgs(
        ctx=ctx,
        cluster_name=cluster_name,
        cluster=config.cluster,
        subnet_ids=network.private_subnet_ids,
        secrets_kms_key_arn=keys.eks.arn,
        logs_kms_key_arn=keys.ops.arn,
        log_retention_days=retention,
    ),
)
node_role = NodeRole("node-role", ctx)
node_addons = cluster.install_addons(NODE_ADDONS)
accelerators = Accelerators(
    "accelerators",
    AcceleratorsArgs(
        ctx=ctx,
        kubernetes_version=config.cluster.kubernetes_version,
        groups=config.accelerator_node_groups,
        system=config.system_node_group,
        cluster_name=cluster.cluster.name,
        cluster_endpoint=cluster.endpoint,
        cluster_certificate_authority=cluster.certificate_authority,
        cluster_security_group_id=cluster.security_group_id,
        service_cidr=SERVICE_CIDR,
        vpc_id=network.vpc_id,
        gpu_subnet_id=network.gpu_subnet_id,
        system_subnet_ids=network.private_subnet_ids,
        node_role_arn=node_role.arn,
        hugepages_2mi_gib=config.workload.hugepages_2mi_gib,
        node_dependencies=node_addons,
    ),
)
workload_addons = cluster.install_addons(WORKLOAD_ADDONS, depends_on=accelerators.node_groups)
storage = Storage(
    "storage",
    StorageArgs(
        ctx=ctx,
        storage=config.storage,
        plan=plan,
        vpc_id=network.vpc_id,
        fsx_subnet_id=network.gpu_subnet_id,
        node_security_group_id=accelerators.efa_security_group_id,
        data_kms_key_arn=keys.data_key_arn,
        logs_kms_key_arn=keys.ops.arn,
        log_retention_days=retention,
        weights_prefix=config.inference.weights_prefix if config.inference else None,
    ),
)
trainer_role = TrainerRole(
    "trainer-role",
    TrainerRoleArgs(
        ctx=ctx,
        identity=config.identity,
        storage=config.storage,
        namespace=config.workload.namespace,
        service_account=config.workload.service_account,
        cluster_name=cluster.cluster.name,
        oidc_provider_arn=cluster.oidc_provider_arn,
        oidc_issuer_url=cluster.oidc_issuer_url,
        bucket_arn=storage.bucket_arn,
        data_key_arn=keys.data_key_arn,
    ),
)
registry = Registry("registry", RegistryArgs(ctx=ctx, kms_key_arn=keys.data_key_arn))  # `make image` pushes here
monitoring = Monitoring(
    "monitoring",
    MonitoringArgs(
        ctx=ctx,
        monitoring=config.monitoring,
        cluster=cluster,
        fsx_id=storage.fsx_id,
        fsx_capacity_gib=storage.fsx_capacity_gib,
        ops_kms_key_arn=keys.ops.arn,
        node_groups=accelerators.node_groups,
        plan=plan,
        training_namespace=config.workload.namespace,
    ),
)
metrics_agent_role = ServiceAccountRole(
    "metrics-agent-role",
    ServiceAccountRoleArgs(
        ctx=ctx,
        namespace=PROMETHEUS_AGENT_SA[0],
        service_account=PROMETHEUS_AGENT_SA[1],
        oidc_provider_arn=cluster.oidc_provider_arn,
        oidc_issuer_url=cluster.oidc_issuer_url,
        policy=monitoring.prometheus_log_group_arn.apply(lambda arn: json.dumps(metrics_agent_policy(arn))),
        description=f"supernode {stack}: the CloudWatch agent's Prometheus scrape (training health, DCGM)",
    ),
)

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
    }
)

# Kubernetes side: add-ons, training namespace, FSx volume, plan ConfigMap, interconnect gate, trainer job.
workload = TrainingWorkload(
    "workload",
    WorkloadArgs(
        ctx=ctx,
        kubeconfig=cluster.kubeconfig,
        cluster_version=cluster.version,
        fsx=FsxVolume(
            id=storage.fsx_id,
            dns_name=storage.fsx_dns_name,
            mount_name=storage.fsx_mount_name,
            size_gib=storage.fsx_capacity_gib,
            data_dir=storage.dataset_dir,
            checkpoint_dir=storage.checkpoint_dir,
        ),
        trainer_role_arn=trainer_role.arn,
        gpu_nodes=GpuNodes.for_groups(accelerators.labels, accelerators.taints),
        plan=plan,
        images=config.images,
        workload=config.workload,
        identity=config.identity,
        baseline_dir=storage.baseline_dir,
        config=config,
        bucket_name=storage.bucket_name,
        cluster_name=cluster_name,
        metrics_agent_role_arn=metrics_agent_role.arn,
        # the CloudWatch add-on creates amazon-cloudwatch, where the scrape configuration goes
        after=[*accelerators.node_groups, *workload_addons, monitoring.agent_addon],
    ),
)
