"""The parent of the Kubernetes side: one component holding the Kubernetes provider of the cluster.

The program (components/program.py) builds the Kubernetes components (add-ons, Kueue, the training
namespace, the interconnect gate, serving, queues, the trainer job, operations) as its children, with
`child()`, so their URNs name it as their parent and they all reach the cluster through its provider.
"""

from __future__ import annotations

from collections.abc import Sequence

import pulumi
import pulumi_kubernetes as k8s


class TrainingWorkload(pulumi.ComponentResource):
    def __init__(
        self,
        name: str,
        kubeconfig: pulumi.Input[str],
        after: Sequence[pulumi.Resource] = (),
        opts: pulumi.ResourceOptions | None = None,
    ):
        """`after`: what the cluster needs before any workload object (GPU node groups, EKS add-ons such as
        the FSx CSI driver and CoreDNS); the provider, and so everything under it, waits for them."""
        super().__init__("supernode:workload:TrainingWorkload", name, None, opts)
        self.provider = k8s.Provider(
            f"{name}-k8s", kubeconfig=kubeconfig, opts=pulumi.ResourceOptions(parent=self, depends_on=list(after))
        )

    def child(self, after: Sequence[pulumi.Resource] = ()) -> pulumi.ResourceOptions:
        """A child component's options: under this one, with the cluster's provider (its own children
        inherit it), created after `after`."""
        return pulumi.ResourceOptions(parent=self, providers={"kubernetes": self.provider}, depends_on=list(after))
