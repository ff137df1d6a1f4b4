"""Monitoring: Container Insights (the CloudWatch observability add-on), log groups, alarms on GPU
utilisation, node health, GPU XID errors, FSx free capacity, NCCL timeouts and OOM, an encrypted
SNS topic every alarm notifies, and a dashboard (issue 3, part 6)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import pulumi
import pulumi_aws as aws

from supernode.core.catalog import GIB
from supernode.core.config import Monitoring as MonitoringConfig

from .cluster import Cluster
from .context import StackContext
from .identity import irsa_trust_policy, managed_policy_arn

CONTAINER_INSIGHTS = "ContainerInsights"
# Container Insights writes to these groups; creating them first sets retention and KMS.
INSIGHTS_LOG_GROUPS = ("application", "dataplane", "host", "performance")
CW_AGENT = ("amazon-cloudwatch", "cloudwatch-agent")  # the add-on's namespace and service account
PERIOD_S = 60


class LogPattern:
    """CloudWatch Logs filter patterns (any of the quoted terms) for failures worth a page."""
    NCCL_TIMEOUT = '?"Watchdog caught collective operation timeout" ?"NCCL timeout" ?"NCCL communicator was aborted"'
    OOM = '?"CUDA out of memory" ?"OutOfMemoryError" ?"Out of memory: Killed process"'
    GPU_XID = '?"NVRM: Xid" ?"NVRM: GPU has fallen off the bus"'


@dataclass
class MonitoringArgs:
    ctx: StackContext
    monitoring: MonitoringConfig
    cluster: Cluster
    fsx_id: pulumi.Input[str]
    fsx_capacity_gib: int
    ops_kms_key_arn: pulumi.Input[str]
    node_groups: Sequence[pulumi.Resource]  # the add-on's agents run on them


class Monitoring(pulumi.ComponentResource):
    topic_arn: pulumi.Output[str]
    log_group_names: list[pulumi.Output[str]]
    alarm_names: list[pulumi.Output[str]]

    def __init__(self, name: str, args: MonitoringArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("supernode:monitoring:Monitoring", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        m, ctx, cluster_name = args.monitoring, args.ctx, args.cluster.name
        tags = ctx.tagged()
        self.namespace, self.prefix = f"Supernode/{ctx.stack}", f"supernode-{ctx.stack}"

        self.topic = aws.sns.Topic(name, name=f"supernode-{ctx.stack}-alarms", kms_master_key_id=args.ops_kms_key_arn,
                                   tags=tags, opts=child)
        aws.sns.TopicSubscription(f"{name}-email", topic=self.topic.arn, protocol="email",
                                  endpoint=m.notification_email, opts=child)
        self.topic_arn = self.topic.arn

        groups = {}
        for kind in INSIGHTS_LOG_GROUPS:
            groups[kind] = aws.cloudwatch.LogGroup(
                f"{name}-{kind}", name=f"/aws/containerinsights/{cluster_name}/{kind}",
                retention_in_days=m.log_retention_days, kms_key_id=args.ops_kms_key_arn, tags=tags, opts=child)
        self.log_group_names = [g.name for g in groups.values()]
        self.training_log_group_name = groups["application"].name  # where the trainer pods' stdout lands

        agent_role = aws.iam.Role(f"{name}-cloudwatch-agent", tags=tags, opts=child, assume_role_policy=irsa_trust_policy(
            args.cluster.oidc_provider_arn, args.cluster.oidc_issuer_url, *CW_AGENT))
        attach = aws.iam.RolePolicyAttachment(f"{name}-cloudwatch-agent", role=agent_role.name,
                                              policy_arn=managed_policy_arn("CloudWatchAgentServerPolicy"), opts=child)
        args.cluster.addon("amazon-cloudwatch-observability", service_account_role_arn=agent_role.arn, parent=self,
                           depends_on=[attach, *groups.values(), *args.node_groups])

        filters = {
            "NcclTimeouts": (groups["application"], LogPattern.NCCL_TIMEOUT),
            "OutOfMemory": (groups["application"], LogPattern.OOM),
            "GpuXidErrors": (groups["host"], LogPattern.GPU_XID),
        }
        for metric, (group, pattern) in filters.items():
            aws.cloudwatch.LogMetricFilter(
                f"{name}-{metric}", log_group_name=group.name, pattern=pattern, opts=child,
                metric_transformation=aws.cloudwatch.LogMetricFilterMetricTransformationArgs(
                    name=metric, namespace=self.namespace, value="1", default_value="0"))

        insights = {"ClusterName": cluster_name}
        window = m.gpu_util_window_minutes * 60 // PERIOD_S
        self.alarms = [
            self._alarm(name, "gpu-util-low", f"GPU utilisation below {m.gpu_util_floor_percent}% for "
                        f"{m.gpu_util_window_minutes} min (DCGM via Container Insights)",
                        namespace=CONTAINER_INSIGHTS, metric_name="node_gpu_utilization", dimensions=insights,
                        statistic="Average", threshold=m.gpu_util_floor_percent, comparison="LessThanThreshold",
                        periods=window, missing="notBreaching"),
            self._alarm(name, "node-not-ready", "a node is not ready",
                        namespace=CONTAINER_INSIGHTS, metric_name="cluster_failed_node_count", dimensions=insights,
                        statistic="Maximum", threshold=0, comparison="GreaterThanThreshold", periods=5),
            self._alarm(name, "gpu-xid-errors", "NVIDIA XID errors in node kernel logs",
                        namespace=self.namespace, metric_name="GpuXidErrors", statistic="Sum", threshold=0,
                        comparison="GreaterThanThreshold", periods=1),
            self._alarm(name, "nccl-timeouts", "NCCL collective timeouts in training logs",
                        namespace=self.namespace, metric_name="NcclTimeouts", statistic="Sum", threshold=0,
                        comparison="GreaterThanThreshold", periods=1),
            self._alarm(name, "out-of-memory", "out-of-memory errors in training logs",
                        namespace=self.namespace, metric_name="OutOfMemory", statistic="Sum", threshold=0,
                        comparison="GreaterThanThreshold", periods=1),
            self._alarm(name, "fsx-free-capacity-low", f"FSx free capacity below {m.fsx_free_capacity_floor_percent}%",
                        namespace="AWS/FSx", metric_name="FreeDataStorageCapacity",
                        dimensions={"FileSystemId": args.fsx_id}, statistic="Minimum",
                        threshold=fsx_free_floor_bytes(args.fsx_capacity_gib, m.fsx_free_capacity_floor_percent),
                        comparison="LessThanThreshold", periods=5),
        ]
        self.alarm_names = [a.name for a in self.alarms]
        self.dashboard = aws.cloudwatch.Dashboard(
            name, dashboard_name=f"supernode-{ctx.stack}", opts=child,
            dashboard_body=pulumi.Output.all(args.fsx_id).apply(
                lambda a: json.dumps(dashboard(ctx.region, cluster_name, self.namespace, a[0], m))))
        self.register_outputs({"topic_arn": self.topic_arn, "alarm_names": self.alarm_names})

    def _alarm(self, name: str, short: str, description: str, *, namespace: str, metric_name: str, statistic: str,
               threshold: float, comparison: str, periods: int, dimensions: Optional[Mapping] = None,
               missing: str = "notBreaching") -> aws.cloudwatch.MetricAlarm:
        return aws.cloudwatch.MetricAlarm(
            f"{name}-{short}", name=f"{self.prefix}-{short}", alarm_description=description, namespace=namespace,
            metric_name=metric_name, dimensions=dict(dimensions) if dimensions else None, statistic=statistic,
            period=PERIOD_S, evaluation_periods=periods, datapoints_to_alarm=periods, threshold=threshold,
            comparison_operator=comparison, treat_missing_data=missing,
            alarm_actions=[self.topic.arn], ok_actions=[self.topic.arn], opts=pulumi.ResourceOptions(parent=self))


def fsx_free_floor_bytes(capacity_gib: int, floor_percent: float) -> float:
    return capacity_gib * GIB * floor_percent / 100


def dashboard(region: str, cluster_name: str, namespace: str, fsx_id: str, m: MonitoringConfig) -> dict:
    def metric(title: str, metrics: list, annotation: Optional[float] = None) -> dict:
        props = {"title": title, "region": region, "metrics": metrics, "period": PERIOD_S, "view": "timeSeries"}
        if annotation is not None:
            props["annotations"] = {"horizontal": [{"label": "floor", "value": annotation}]}
        return {"type": "metric", "width": 12, "height": 6, "properties": props}

    return {"widgets": [
        metric("GPU utilisation (%)", [[CONTAINER_INSIGHTS, "node_gpu_utilization", "ClusterName", cluster_name]],
               m.gpu_util_floor_percent),
        metric("GPU memory used (%)", [[CONTAINER_INSIGHTS, "node_gpu_memory_utilization", "ClusterName", cluster_name]]),
        metric("Failed nodes", [[CONTAINER_INSIGHTS, "cluster_failed_node_count", "ClusterName", cluster_name]]),
        metric("Training failures", [[namespace, "NcclTimeouts"], [namespace, "OutOfMemory"], [namespace, "GpuXidErrors"]]),
        metric("FSx free capacity (bytes)", [["AWS/FSx", "FreeDataStorageCapacity", "FileSystemId", fsx_id]]),
        metric("FSx throughput (bytes)", [["AWS/FSx", "DataWriteBytes", "FileSystemId", fsx_id],
                                          ["AWS/FSx", "DataReadBytes", "FileSystemId", fsx_id]]),
    ]}
