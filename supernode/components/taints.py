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
