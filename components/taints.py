"""The one taint type: the AWS node groups set taints, the Kubernetes workload tolerates them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)  # ordered (key, value, effect) so a set of them sorts stably
class Taint:
    key: str
    value: str
    effect: str = "NoSchedule"  # Kubernetes spelling; the EKS API's is derived where it is needed

    def kubelet_flag(self) -> str:
        """As kubelet's --register-with-taints takes it: key=value:Effect."""
        return f"{self.key}={self.value}:{self.effect}"

    def toleration(self) -> dict[str, str]:
        return {"key": self.key, "operator": "Equal", "value": self.value, "effect": self.effect}


# Node health (supernode.trainer.node.agent, which names the same keys): a GPU node joins UNCHECKED and
# the agent removes it once its deep check passes; it taints a failing node unhealthy. Training and
# serving pods tolerate neither; the DaemonSets on the GPU nodes tolerate both (the agent must run there).
UNCHECKED = Taint("supernode.io/unchecked", "true", "NoSchedule")
NODE_HEALTH_KEYS = ("supernode.io/unhealthy", UNCHECKED.key)
