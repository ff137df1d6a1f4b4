"""Accelerator instance catalog: the hardware facts every other part builds on.

Figures follow AWS's published instance specifications (sources in ../shared/HARDWARE.md). GPU memory is what
EC2's DescribeInstanceTypes reports (`GpuInfo.Gpus[].MemoryInfo.SizeInMiB`), so preflight can
compare it field for field. Prices are us-east-1 on-demand list prices per instance-hour, used
only for the planner's cost estimate.

An NVLink domain is the set of GPUs that reach each other's memory over NVLink (the supernode's
"global address space"): one instance for every type here except p6e-gb200, whose domain is the
whole UltraServer (9 or 18 instances, 36 or 72 GPUs, joined by NVLink switches and IMEX channels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GIB = 1024**3


@dataclass(frozen=True)
class InstanceType:
    name: str
    accelerator: str
    accelerators: int  # GPUs per node
    hbm_mib: int  # per GPU, as EC2 reports it
    efa_interfaces: int  # EFA devices per node, one per EFA-capable network card (MaximumEfaInterfaces)
    efa_gbps: int  # per EFA device, Gb/s
    nvlink_gbytes_s: int  # per GPU, GB/s (bidirectional aggregate)
    bf16_tflops: float  # dense peak per GPU
    vcpus: int
    memory_gib: int
    local_nvme: bool
    # AWS's newer layout puts an ENA primary at card 0 / device 0 and EFA-only at card 0 / device 1.
    ena_primary: bool
    price_per_hour: float
    # Network card 0 carries EFA. When it does not (p6-b300, p6e-gb200) the instance has one card
    # more than EFA devices (the rule aws-parallelcluster's add_network_interfaces uses:
    # MaximumEfaInterfaces < MaximumNetworkCards), and card 0 holds only the ENA primary.
    card0_efa: bool = True
    # Device index of the efa-only interface on cards 1..n: 1 in the layout the p4/p5 types were
    # validated with; 0 in EC2's current guidance (efa-acc-inst-types), used for the P6 types.
    efa_only_device_index: int = 1
    arch: Literal["x86_64", "arm64"] = "x86_64"
    # HBM bandwidth per GPU, GB/s (vendor datasheets: A100 40/80 GB SXM 1555/2039, H100 SXM 3350,
    # H200 4800, B200/B300/GB200 8000). Decoding reads every weight once per step, so this bounds
    # the inference planner's decode tokens/s. 0: unknown.
    hbm_gbytes_s: float = 0.0

    @property
    def family(self) -> str:
        return self.name.split(".")[0]

    @property
    def network_cards(self) -> int:
        """Network cards the launch template fills (EC2's MaximumNetworkCards)."""
        return self.efa_interfaces + (0 if self.card0_efa else 1)

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


# The P6 rows follow ../shared/HARDWARE.md: B200/B300 memory, EFA counts and network cards as EC2
# (moto 5.2.5) reports them; NVLink 5 at 1.8 TB/s per GPU; bf16 dense ~2.25 PFLOP/s (B200, B300) and
# ~2.5 PFLOP/s (GB200). p6e-gb200 is not in moto's data: its figures are AWS's P6e page (4 GPUs,
# ~185 GB HBM3e each, 144 Grace vCPUs, arm64) and the EKS UltraServer guide for the EFA count
# (docs.aws.amazon.com/eks/latest/userguide/ml-eks-nvidia-ultraserver.html: 4 allocatable EFA
# devices per node, one efa-only interface per NCI group; aws-parallelcluster's tests bind 8, so
# this is the one place to change, and preflight compares it with EC2 where EC2 knows the type).
# p6-b200/p6-b300 prices are list prices noted for the estimate only (not in HARDWARE.md); the
# p6e-gb200 price is the UltraServer fixture of HARDWARE.md ($761.90/h per x72) divided by 18.
CATALOG: dict[str, InstanceType] = {
    t.name: t
    for t in [
        InstanceType(
            "p4d.24xlarge", "A100", 8, 40960, 4, 100, 600, 312.0, 96, 1152, True, False, 21.96, hbm_gbytes_s=1555.0
        ),
        InstanceType(
            "p4de.24xlarge", "A100", 8, 81920, 4, 100, 600, 312.0, 96, 1152, True, False, 27.45, hbm_gbytes_s=2039.0
        ),
        InstanceType(
            "p5.48xlarge", "H100", 8, 81920, 32, 100, 900, 989.0, 192, 2048, True, False, 55.04, hbm_gbytes_s=3350.0
        ),
        InstanceType(
            "p5e.48xlarge", "H200", 8, 144384, 32, 100, 900, 989.0, 192, 2048, True, False, 60.70, hbm_gbytes_s=4800.0
        ),
        InstanceType(
            "p5en.48xlarge", "H200", 8, 144384, 16, 200, 900, 989.0, 192, 2048, True, True, 63.30, hbm_gbytes_s=4800.0
        ),
        InstanceType(
            "p6-b200.48xlarge",
            "B200",
            8,
            183359,
            8,
            400,
            1800,
            2250.0,
            192,
            2048,
            True,
            True,
            113.93,
            efa_only_device_index=0,
            hbm_gbytes_s=8000.0,
        ),
        InstanceType(
            "p6-b300.48xlarge",
            "B300",
            8,
            275040,
            16,
            400,
            1800,
            2250.0,
            192,
            4096,
            True,
            True,
            142.42,
            card0_efa=False,
            efa_only_device_index=0,
            hbm_gbytes_s=8000.0,
        ),
        InstanceType(
            "p6e-gb200.36xlarge",
            "GB200",
            4,
            189440,
            4,
            400,
            1800,
            2500.0,
            144,
            960,
            True,
            True,
            round(761.90 / 18, 2),
            card0_efa=False,
            efa_only_device_index=0,
            arch="arm64",
            hbm_gbytes_s=8000.0,
        ),
    ]
}


@dataclass(frozen=True)
class UltraServer:
    """Instances sold together as one NVLink domain (one Capacity Block per UltraServer)."""

    name: str
    instance_type: str
    instances: int

    @property
    def gpus(self) -> int:
        return self.instances * CATALOG[self.instance_type].accelerators


# HARDWARE.md "Buying and placing": u-p6e-gb200x36 = 9 instances, x72 = 18, sold only as Capacity Blocks.
ULTRASERVERS: dict[str, UltraServer] = {
    u.name: u
    for u in [
        UltraServer("u-p6e-gb200x36", "p6e-gb200.36xlarge", 9),
        UltraServer("u-p6e-gb200x72", "p6e-gb200.36xlarge", 18),
    ]
}


def ultraserver_only(instance_type: str) -> bool:
    """The type is sold only inside an UltraServer (a node group of it must name one)."""
    return any(u.instance_type == instance_type for u in ULTRASERVERS.values())


def nvlink_domain_gpus(instance_type: str, ultra_server: str | None = None) -> int:
    """GPUs in one NVLink domain: the UltraServer's, else one instance's."""
    return ULTRASERVERS[ultra_server].gpus if ultra_server else CATALOG[instance_type].accelerators


# Instance types allowed for the small system node group (no accelerators, no EFA).
SYSTEM_INSTANCE_TYPES = ("m6i.large", "m6i.xlarge", "m6i.2xlarge", "m7i.large", "m7i.xlarge", "m7i.2xlarge")

# Public reference: 2 x p5.48xlarge NCCL all_reduce bus bandwidth at large message sizes (GB/s).
# P6: aws-parallelcluster's NCCL test minimums at 1 GiB (HARDWARE.md "Interconnect baselines"): p6-b200
# > 300 GB/s on 2 nodes, p6e-gb200 > 500 GB/s inside one UltraServer. No figure is published for
# p6-b300; it has twice p6-b200's EFA, so p6-b200's minimum is a floor that cannot over-reject.
ALL_REDUCE_BASELINE_GBYTES_S = {
    "p5.48xlarge": 480.0,
    "p5e.48xlarge": 480.0,
    "p5en.48xlarge": 480.0,
    "p4d.24xlarge": 45.0,
    "p4de.24xlarge": 45.0,
    "p6-b200.48xlarge": 300.0,
    "p6-b300.48xlarge": 300.0,
    "p6e-gb200.36xlarge": 500.0,
}


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
# Local Zones where accelerators are sold (opt in to the zone group first): P6e-GB200 UltraServers are
# in Dallas (HARDWARE.md "Buying and placing"). Only the GPU subnet may lie in one.
LOCAL_ZONES: dict[str, tuple[str, ...]] = {"us-east-1": ("us-east-1-dfw-2a",)}


def zone_group(zone: str) -> str:
    """The opt-in group of a Local Zone (us-east-1-dfw-2a -> us-east-1-dfw-2)."""
    return zone[:-1]


def lookup(name: str) -> InstanceType:
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"instance type {name!r} is not in the catalog; valid: {', '.join(CATALOG)}") from None


# EKS add-on versions pinned per Kubernetes version (`aws eks describe-addon-versions`); the stack
# installs exactly these, and config validation rejects a Kubernetes version without a row here.
EKS_ADDON_VERSIONS: dict[str, dict[str, str]] = {
    "1.32": {
        "vpc-cni": "v1.20.4-eksbuild.2",
        "coredns": "v1.11.4-eksbuild.24",
        "kube-proxy": "v1.32.9-eksbuild.2",
        "aws-fsx-csi-driver": "v1.7.0-eksbuild.1",
        "eks-node-monitoring-agent": "v1.4.1-eksbuild.1",
        "eks-pod-identity-agent": "v1.3.9-eksbuild.3",
        "amazon-cloudwatch-observability": "v4.6.0-eksbuild.1",
    },
    "1.33": {
        "vpc-cni": "v1.20.4-eksbuild.2",
        "coredns": "v1.12.2-eksbuild.4",
        "kube-proxy": "v1.33.5-eksbuild.2",
        "aws-fsx-csi-driver": "v1.7.0-eksbuild.1",
        "eks-node-monitoring-agent": "v1.4.1-eksbuild.1",
        "eks-pod-identity-agent": "v1.3.9-eksbuild.3",
        "amazon-cloudwatch-observability": "v4.6.0-eksbuild.1",
    },
    "1.34": {
        "vpc-cni": "v1.20.4-eksbuild.2",
        "coredns": "v1.12.4-eksbuild.1",
        "kube-proxy": "v1.34.1-eksbuild.2",
        "aws-fsx-csi-driver": "v1.7.0-eksbuild.1",
        "eks-node-monitoring-agent": "v1.4.1-eksbuild.1",
        "eks-pod-identity-agent": "v1.3.9-eksbuild.3",
        "amazon-cloudwatch-observability": "v4.6.0-eksbuild.1",
    },
}
