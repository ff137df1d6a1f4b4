"""The Kubernetes workload on the EKS cluster: add-ons, the training namespace, the interconnect
gate and the MoE trainer job, all sized from the one Plan (ARCHITECTURE.md §1).

`__main__.py` builds `WorkloadArgs` from the AWS components' outputs and the validated config;
nothing here reads config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pulumi
import pulumi_kubernetes as k8s

from supernode.core.config import Identity, Images, StackConfig, Workload
from supernode.core.plan import Plan

from ..context import StackContext
from ..taints import Taint
from .addons import AddonArgs, ClusterAddons
from .common import GpuNodes, dns_name
from .jobs import BaselineStore, InterconnectGate, JobArgs, TrainerArgs, TrainerJob, spans_nodes_over_nvlink
from .namespace import PRIORITY_CLASS, FsxVolume, NamespaceArgs, TrainingNamespace
from .operations import Operations, OperationsArgs
from .queues import SERVING, TRAINING, KueueArgs, KueueController, Queues, QueuesArgs, gpu_pools, job_labels
from .serving import ServingArgs, ServingWorkload

__all__ = ["TrainingWorkload", "WorkloadArgs", "FsxVolume", "GpuNodes", "StackContext", "Taint"]


@dataclass(frozen=True)
class WorkloadArgs:
    ctx: StackContext
    kubeconfig: pulumi.Input[str]
    cluster_version: str  # "1.33": Pod Security labels are pinned to it
    fsx: FsxVolume
    trainer_role_arn: pulumi.Input[str]
    gpu_nodes: GpuNodes
    plan: Plan  # every figure the jobs need: nodes, pod shape, gate floor, training settings
    images: Images
    workload: Workload
    identity: Identity
    # What the cluster needs before any workload object (GPU node groups, EKS add-ons such as the
    # FSx CSI driver and CoreDNS): the Kubernetes provider, and so everything here, waits for them.
    after: Sequence[pulumi.Resource] = ()
    # Operations (components/k8s/operations.py): the FSx directory of the baselines (storage.baseline_dir,
    # exported to S3), the whole config (Kueue pools from the node groups; the restore drill's stack
    # file) and the bucket the drill restores from. Without config and bucket: no drill CronJob.
    baseline_dir: str = "/baselines"
    config: StackConfig | None = None
    bucket_name: pulumi.Input[str] | None = None
    cluster_name: str = ""
    # The IAM role of the CloudWatch agent's Prometheus scrape (program.py); None: the agent is not deployed.
    metrics_agent_role_arn: pulumi.Input[str] | None = None


class TrainingWorkload(pulumi.ComponentResource):
    def __init__(self, name: str, args: WorkloadArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:workload:TrainingWorkload", name, None, opts)
        self.provider = k8s.Provider(
            f"{name}-k8s",
            kubeconfig=args.kubeconfig,
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
        )
        # Children inherit the provider from their component parents.
        child = pulumi.ResourceOptions(parent=self, providers={"kubernetes": self.provider})
        plan, wl = args.plan, args.workload

        self.addons = ClusterAddons(
            f"{name}-addons",
            AddonArgs(
                region=args.ctx.region,
                gpu_nodes=args.gpu_nodes,
                images=args.images.addons,
                compute_domains=spans_nodes_over_nvlink(plan),
            ),
            child,
        )
        # Kueue's controller first: its webhooks admit every job and serving pod of the queued namespaces.
        inference = args.config.inference if args.config else None
        serves = plan.inference is not None and inference is not None
        self.kueue = KueueController(
            f"{name}-kueue",
            KueueArgs(namespaces=[wl.namespace] + ([inference.namespace] if serves else []), images=args.images.addons),
            child,
        )
        self.training = TrainingNamespace(
            f"{name}-ns",
            NamespaceArgs(
                namespace=wl.namespace,
                service_account=wl.service_account,
                trainer_role_arn=args.trainer_role_arn,
                pod_identity=args.identity.pod_identity == "pod-identity",
                cluster_version=args.cluster_version,
                fsx=args.fsx,
                plan=plan,
            ),
            child,
        )
        job = JobArgs(
            namespace=self.training.name,
            image=args.images.trainer,
            gpu_nodes=args.gpu_nodes,
            plan=plan,
            plan_config_map=self.training.plan_config_map.metadata.name,
            priority_class=self.training.priority_class.metadata.name,
            wait_for=self.addons.compute_domain_ready,
        )
        fabric = replace(job, image=args.images.fabric_check or args.images.trainer)
        store = BaselineStore(
            pvc=self.training.claim.metadata.name, subpath=args.baseline_dir.strip("/"), regression=wl.fabric_regression
        )
        self.gate = InterconnectGate(
            f"{name}-gate",
            fabric,
            job_name=dns_name(plan.stack, "fabric-gate"),
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=self.kueue.ready)),
            baseline=store,
        )
        # Serving (the inference section): vLLM on the verified export, at serving priority in the same pools.
        self.serving = (
            None
            if not serves
            else ServingWorkload(
                f"{name}-serving",
                ServingArgs(
                    plan=plan,
                    inference=inference,
                    gpu_nodes=args.gpu_nodes,
                    fsx_id=args.fsx.id,
                    fsx_dns_name=args.fsx.dns_name,
                    fsx_mount_name=args.fsx.mount_name,
                    queue_labels=job_labels(plan, SERVING),
                    addon_images=args.images.addons,
                ),
                pulumi.ResourceOptions(
                    parent=self,
                    providers={"kubernetes": self.provider},
                    depends_on=[*self.addons.ready, *self.kueue.ready],
                ),
            )
        )
        serving_ns = [self.serving.namespace] if self.serving else []
        # Kueue: a ClusterQueue per GPU pool; the trainer is admitted through its LocalQueue, all workers or none.
        groups = args.config.accelerator_node_groups if args.config else ()
        self.queues = Queues(
            f"{name}-queues",
            QueuesArgs(pools=gpu_pools(groups, plan), kueue=self.kueue, after=[self.training.namespace, *serving_ns]),
            child,
        )
        self.trainer = TrainerJob(
            f"{name}-trainer",
            TrainerArgs(
                job=job,
                service_account=self.training.service_account.metadata.name,
                pvc=self.training.claim.metadata.name,
                data_subpath=args.fsx.data_dir.strip("/"),
                checkpoint_subpath=args.fsx.checkpoint_dir.strip("/"),
                termination_grace_s=wl.termination_grace_s,
                wait_for=[self.gate.job, *self.addons.ready, *self.queues.ready],
                queue_labels=job_labels(plan, TRAINING),
            ),
            job_name=dns_name(plan.stack, "train"),
            opts=child,
        )
        self.operations = Operations(
            f"{name}-ops",
            OperationsArgs(
                job=fabric,
                workload=wl,
                pvc=self.training.claim.metadata.name,
                baseline_subpath=store.subpath,
                service_account=self.training.service_account.metadata.name,
                cluster_name=args.cluster_name or f"supernode-{plan.stack}",
                region=args.ctx.region,
                config=args.config,
                bucket_name=args.bucket_name,
                metrics_agent_role_arn=args.metrics_agent_role_arn,
                addon_images=args.images.addons,
            ),
            pulumi.ResourceOptions(
                parent=self,
                providers={"kubernetes": self.provider},
                depends_on=[*self.queues.ready, self.addons.namespace],
            ),
        )  # the agent reads pods there (DCGM)

        self.outputs = {
            "namespace": self.training.name,
            "trainer_job": self.trainer.name,
            "gate_job": self.gate.job.metadata.name,
            "gate_min_busbw_gbytes_s": plan.gate_floor_gbytes_s,  # what the gate reads from the plan
            "dcgm_metrics_endpoint": self.addons.dcgm_endpoint,
            "priority_class": PRIORITY_CLASS,
            **(self.serving.outputs if self.serving else {}),
        }
        self.register_outputs(self.outputs)
