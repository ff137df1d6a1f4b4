"""Accelerator instance catalog: the hardware facts every other part builds on.

Figures follow AWS's published instance specifications (sources in ../shared/HARDWARE.md). GPU memory is what
EC2's DescribeInstanceTypes reports (`GpuInfo.Gpus[].MemoryInfo.SizeInMiB`), so preflight can
compare it field for field. Prices are us-east-1 on-demand list prices per instance-hour, used
only for the planner's cost estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class InstanceType:
    name: str
    accelerator: str
    accelerators: int  # GPUs per node
    hbm_mib: int  # per GPU, as EC2 reports it
    efa_interfaces: int  # one EFA device per network card (MaximumEfaInterfaces)
    efa_gbps: int  # per EFA device, Gb/s
    nvlink_gbytes_s: int  # per GPU, GB/s (bidirectional aggregate)
    bf16_tflops: float  # dense peak per GPU
    vcpus: int
    memory_gib: int
    local_nvme: bool
    # AWS's newer layout puts an ENA primary at card 0 / device 0 and EFA-only at card 0 / device 1.
    ena_primary: bool
    price_per_hour: float

    @property
    def family(self) -> str:
        return self.name.split(".")[0]

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_mib * 2**20

    @property
    def hbm_gib(self) -> float:
        return self.hbm_mib / 1024

    @property
    def efa_gbytes_s(self) -> float:
        """Aggregate node EFA bandwidth in GB/s."""
        return self.efa_interfaces * self.efa_gbps / 8

    @property
    def peak_flops(self) -> float:
        """Dense bf16 FLOP/s per GPU."""
        return self.bf16_tflops * 1e12


CATALOG: dict[str, InstanceType] = {
    t.name: t
    for t in [
        InstanceType("p4d.24xlarge", "A100", 8, 40960, 4, 100, 600, 312.0, 96, 1152, True, False, 21.96),
        InstanceType("p4de.24xlarge", "A100", 8, 81920, 4, 100, 600, 312.0, 96, 1152, True, False, 27.45),
        InstanceType("p5.48xlarge", "H100", 8, 81920, 32, 100, 900, 989.0, 192, 2048, True, False, 55.04),
        InstanceType("p5e.48xlarge", "H200", 8, 144384, 32, 100, 900, 989.0, 192, 2048, True, False, 60.70),
        InstanceType("p5en.48xlarge", "H200", 8, 144384, 16, 200, 900, 989.0, 192, 2048, True, True, 63.30),
    ]
}

# Instance types allowed for the small system node group (no accelerators, no EFA).
SYSTEM_INSTANCE_TYPES = ("m6i.large", "m6i.xlarge", "m6i.2xlarge", "m7i.large", "m7i.xlarge", "m7i.2xlarge")

# Public reference: 2 x p5.48xlarge NCCL all_reduce bus bandwidth at large message sizes (GB/s).
ALL_REDUCE_BASELINE_GBYTES_S = {"p5.48xlarge": 480.0, "p5e.48xlarge": 480.0, "p5en.48xlarge": 480.0,
                                "p4d.24xlarge": 45.0, "p4de.24xlarge": 45.0}



def gate_floor_gbytes_s(instance_type: str, fraction: float) -> float | None:
    """The interconnect gate's all_reduce bus-bandwidth floor: the published baseline x fraction
    (None where no baseline is published). The gate Job passes it; the policy pack checks it."""
    baseline = ALL_REDUCE_BASELINE_GBYTES_S.get(instance_type)
    return None if baseline is None else round(baseline * fraction, 3)


# AZ suffixes of the regions where these instance types are offered (for offline validation;
# preflight asks EC2 for the real offering).
REGION_AZS: dict[str, tuple[str, ...]] = {
    "us-east-1": ("a", "b", "c", "d", "e", "f"),
    "us-east-2": ("a", "b", "c"),
    "us-west-2": ("a", "b", "c", "d"),
    "eu-west-1": ("a", "b", "c"),
    "eu-north-1": ("a", "b", "c"),
    "ap-northeast-1": ("a", "c", "d"),
    "ap-southeast-2": ("a", "b", "c"),
}


def lookup(name: str) -> InstanceType:
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"instance type {name!r} is not in the catalog; valid: {', '.join(CATALOG)}") from None

# EKS add-on versions pinned per Kubernetes version (`aws eks describe-addon-versions`); the stack
# installs exactly these, and config validation rejects a Kubernetes version without a row here.
EKS_ADDON_VERSIONS: dict[str, dict[str, str]] = {
    "1.32": {
        "vpc-cni": "v1.20.4-eksbuild.2", "coredns": "v1.11.4-eksbuild.24", "kube-proxy": "v1.32.9-eksbuild.2",
        "aws-fsx-csi-driver": "v1.7.0-eksbuild.1", "eks-node-monitoring-agent": "v1.4.1-eksbuild.1",
        "eks-pod-identity-agent": "v1.3.9-eksbuild.3", "amazon-cloudwatch-observability": "v4.6.0-eksbuild.1",
    },
    "1.33": {
        "vpc-cni": "v1.20.4-eksbuild.2", "coredns": "v1.12.2-eksbuild.4", "kube-proxy": "v1.33.5-eksbuild.2",
        "aws-fsx-csi-driver": "v1.7.0-eksbuild.1", "eks-node-monitoring-agent": "v1.4.1-eksbuild.1",
        "eks-pod-identity-agent": "v1.3.9-eksbuild.3", "amazon-cloudwatch-observability": "v4.6.0-eksbuild.1",
    },
    "1.34": {
        "vpc-cni": "v1.20.4-eksbuild.2", "coredns": "v1.12.4-eksbuild.1", "kube-proxy": "v1.34.1-eksbuild.2",
        "aws-fsx-csi-driver": "v1.7.0-eksbuild.1", "eks-node-monitoring-agent": "v1.4.1-eksbuild.1",
        "eks-pod-identity-agent": "v1.3.9-eksbuild.3", "amazon-cloudwatch-observability": "v4.6.0-eksbuild.1",
    },
}
