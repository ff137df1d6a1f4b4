"""Accelerator instance catalog: the hardware facts every other part builds on.

Figures follow AWS's published instance specifications (sources in docs/hardware.md). GPU memory is what
EC2's DescribeInstanceTypes reports (`GpuInfo.Gpus[].MemoryInfo.SizeInMiB`), so preflight can
compare it field for field. Prices are us-east-1 on-demand list prices per instance-hour, used
only for the planner's cost estimate.

An NVLink domain is the set of GPUs that reach each other's memory over NVLink (the supernode's
"global address space"): one instance for every type here except p6e-gb200, whose domain is the
whole UltraServer (9 or 18 instances, 36 or 72 GPUs, joined by NVLink switches and IMEX channels).

Trainium2 (vendor "neuron") counts ranks, not chips: a rank is a logical NeuronCore. Under the default
Logical NeuronCore configuration (LNC=2) two physical NeuronCore-v3 form one logical core, 4 per chip,
so a trn2.48xlarge runs 64 ranks and every per-accelerator figure of its row (HBM, bf16 peak, HBM and
NeuronLink bandwidth) is the chip's divided by 4. Its scale-up domain is the NeuronLink domain: one
instance (16 chips in a 4 x 4 torus), or a Trn2 UltraServer (4 x trn2u.48xlarge, 64 chips).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from .vendors import VENDORS, AcceleratorVendor

GIB = 1024**3


class NetworkInterface(NamedTuple):
    """One interface of a launch template, in EC2's terms."""

    network_card_index: int
    device_index: int
    interface_type: str  # "efa", "efa-only", or "interface" (ENA)


EFA_INTERFACE_TYPES = ("efa", "efa-only")


Vendor = Literal["nvidia", "neuron"]


@dataclass(frozen=True, kw_only=True)
class InstanceType:
    name: str
    accelerator: str
    accelerators: int  # ranks per node: GPUs, or Trainium2's logical NeuronCores
    # Whose accelerator: drives the Kubernetes device resource, the device plugin, the exporter, the
    # AMI and the trainer's device and process-group backend.
    vendor: Vendor = "nvidia"
    # Ranks on one accelerator chip: 1 for a GPU; 4 logical NeuronCores per Trainium2 under LNC=2.
    ranks_per_chip: int = 1
    # Physical NeuronCores per chip as EC2 reports them (NeuronInfo CoreInfo.Count): 8 NeuronCore-v3 on a
    # Trainium2, two per logical core under LNC=2. 0: not a Neuron device.
    neuron_cores_per_chip: int = 0
    hbm_mib: int  # per GPU, as EC2 reports it
    # HBM bandwidth per GPU, GB/s (vendor datasheets: A100 40/80 GB SXM 1555/2039, H100 SXM 3350,
    # H200 4800, B200/B300/GB200 8000). Decoding reads every weight once per step, so this bounds
    # the inference planner's decode tokens/s. 0: unknown.
    hbm_gbytes_s: float = 0.0
    bf16_tflops: float  # dense peak per GPU
    nvlink_gbytes_s: int  # per GPU (rank), GB/s (bidirectional aggregate) of the scale-up link: NVLink or NeuronLink
    # Per rank, GB/s, between the instances of one UltraServer domain where that link is slower than
    # inside an instance (Trn2 UltraServer: 256 GB/s per chip against 1,024); None: one uniform domain.
    domain_inter_node_gbytes_s: int | None = None
    efa_interfaces: int  # EFA devices per node, one per EFA-capable network card (MaximumEfaInterfaces)
    efa_gbps: int  # per EFA device, Gb/s
    # AWS's newer layout puts an ENA primary at card 0 / device 0 and EFA-only at card 0 / device 1.
    ena_primary: bool
    # Network card 0 carries EFA. When it does not (p6-b300, p6e-gb200) the instance has one card
    # more than EFA devices (the rule aws-parallelcluster's add_network_interfaces uses:
    # MaximumEfaInterfaces < MaximumNetworkCards), and card 0 holds only the ENA primary.
    card0_efa: bool = True
    # Device index of the efa-only interface on cards 1..n: 1 in the layout the p4/p5 types were
    # validated with; 0 in EC2's current guidance (efa-acc-inst-types), used for the P6 types.
    efa_only_device_index: int = 1
    vcpus: int
    memory_gib: int
    local_nvme: bool
    arch: Literal["x86_64", "arm64"] = "x86_64"
    price_per_hour: float  # us-east-1 on-demand, for the planner's cost estimate
    # NCCL all_reduce bus bandwidth at large messages (GB/s), published for this type; the interconnect
    # gate's floor is a fraction of it. None: no published figure, so no gate.
    all_reduce_baseline_gbytes_s: float | None = None

    @property
    def family(self) -> str:
        return self.name.split(".")[0]

    @property
    def chips(self) -> int:
        """Accelerator chips per node (GPUs, or Trainium2 chips)."""
        return self.accelerators // self.ranks_per_chip

    @property
    def vendor_row(self) -> AcceleratorVendor:
        """What this instance's accelerator vendor differs in (supernode.core.vendors)."""
        return VENDORS[self.vendor]

    @property
    def device_resource(self) -> str:
        return self.vendor_row.device_resource

    @property
    def link_name(self) -> str:
        return self.vendor_row.link_name

    @property
    def keeps_ep_tp_in_domain(self) -> bool:
        return self.vendor_row.keeps_ep_tp_in_domain

    @property
    def rank_noun(self) -> str:
        return self.vendor_row.rank_noun

    @property
    def torch_device(self) -> str:
        return self.vendor_row.torch_device

    @property
    def network_cards(self) -> int:
        """Network cards the launch template fills (EC2's MaximumNetworkCards)."""
        return self.efa_interfaces + (0 if self.card0_efa else 1)

    @property
    def network_interfaces(self) -> list[NetworkInterface]:
        """The launch template's interfaces, one per network card: card 0 / device 0 is `efa`, or an ENA
        primary (EC2: an efa-only interface cannot be primary) with `efa-only` beside it at device 1 only
        where card 0 carries EFA; every other card is `efa-only` at `efa_only_device_index`."""
        if not self.ena_primary:
            card0 = [NetworkInterface(0, 0, "efa")]
        elif self.card0_efa:
            card0 = [NetworkInterface(0, 0, "interface"), NetworkInterface(0, 1, "efa-only")]
        else:
            card0 = [NetworkInterface(0, 0, "interface")]
        return card0 + [
            NetworkInterface(card, self.efa_only_device_index, "efa-only") for card in range(1, self.network_cards)
        ]

    @property
    def efa_cards(self) -> list[int]:
        """The network cards that carry an EFA interface (NCCL uses one per card)."""
        return [i.network_card_index for i in self.network_interfaces if i.interface_type in EFA_INTERFACE_TYPES]

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


# The P6 rows follow docs/hardware.md: B200/B300 memory, EFA counts and network cards as EC2
# (moto 5.2.5) reports them; NVLink 5 at 1.8 TB/s per GPU; bf16 dense ~2.25 PFLOP/s (B200, B300) and
# ~2.5 PFLOP/s (GB200). p6e-gb200 is not in moto's data: its figures are AWS's P6e page (4 GPUs,
# ~185 GB HBM3e each, 144 Grace vCPUs, arm64) and the EKS UltraServer guide for the EFA count
# (docs.aws.amazon.com/eks/latest/userguide/ml-eks-nvidia-ultraserver.html: 4 allocatable EFA
# devices per node, one efa-only interface per NCI group; aws-parallelcluster's tests bind 8, so
# this is the one place to change, and preflight compares it with EC2 where EC2 knows the type).
# p6-b200/p6-b300 prices are list prices noted for the estimate only (not in docs/hardware.md); the
# p6e-gb200 price is the UltraServer fixture of docs/hardware.md ($761.90/h per x72) divided by 18.
# All-reduce baselines: 2 x p5.48xlarge NCCL all_reduce bus bandwidth at large message sizes (public
# reference); P6: aws-parallelcluster's NCCL test minimums at 1 GiB (docs/hardware.md "Interconnect
# baselines"): p6-b200 > 300 GB/s on 2 nodes, p6e-gb200 > 500 GB/s inside one UltraServer. No figure is
# published for p6-b300; it has twice p6-b200's EFA, so p6-b200's minimum is a floor that cannot over-reject.
CATALOG: dict[str, InstanceType] = {
    t.name: t
    for t in [
        InstanceType(
            name="p4d.24xlarge",
            accelerator="A100",
            accelerators=8,
            hbm_mib=40960,
            hbm_gbytes_s=1555.0,
            bf16_tflops=312.0,
            nvlink_gbytes_s=600,
            efa_interfaces=4,
            efa_gbps=100,
            ena_primary=False,
            vcpus=96,
            memory_gib=1152,
            local_nvme=True,
            price_per_hour=21.96,
            all_reduce_baseline_gbytes_s=45.0,
        ),
        InstanceType(
            name="p4de.24xlarge",
            accelerator="A100",
            accelerators=8,
            hbm_mib=81920,
            hbm_gbytes_s=2039.0,
            bf16_tflops=312.0,
            nvlink_gbytes_s=600,
            efa_interfaces=4,
            efa_gbps=100,
            ena_primary=False,
            vcpus=96,
            memory_gib=1152,
            local_nvme=True,
            price_per_hour=27.45,
            all_reduce_baseline_gbytes_s=45.0,
        ),
        InstanceType(
            name="p5.48xlarge",
            accelerator="H100",
            accelerators=8,
            hbm_mib=81920,
            hbm_gbytes_s=3350.0,
            bf16_tflops=989.0,
            nvlink_gbytes_s=900,
            efa_interfaces=32,
            efa_gbps=100,
            ena_primary=False,
            vcpus=192,
            memory_gib=2048,
            local_nvme=True,
            price_per_hour=55.04,
            all_reduce_baseline_gbytes_s=480.0,
        ),
        InstanceType(
            name="p5e.48xlarge",
            accelerator="H200",
            accelerators=8,
            hbm_mib=144384,
            hbm_gbytes_s=4800.0,
            bf16_tflops=989.0,
            nvlink_gbytes_s=900,
            efa_interfaces=32,
            efa_gbps=100,
            ena_primary=False,
            vcpus=192,
            memory_gib=2048,
            local_nvme=True,
            price_per_hour=60.70,
            all_reduce_baseline_gbytes_s=480.0,
        ),
        InstanceType(
            name="p5en.48xlarge",
            accelerator="H200",
            accelerators=8,
            hbm_mib=144384,
            hbm_gbytes_s=4800.0,
            bf16_tflops=989.0,
            nvlink_gbytes_s=900,
            efa_interfaces=16,
            efa_gbps=200,
            ena_primary=True,
            vcpus=192,
            memory_gib=2048,
            local_nvme=True,
            price_per_hour=63.30,
            all_reduce_baseline_gbytes_s=480.0,
        ),
        InstanceType(
            name="p6-b200.48xlarge",
            accelerator="B200",
            accelerators=8,
            hbm_mib=183359,
            hbm_gbytes_s=8000.0,
            bf16_tflops=2250.0,
            nvlink_gbytes_s=1800,
            efa_interfaces=8,
            efa_gbps=400,
            ena_primary=True,
            efa_only_device_index=0,
            vcpus=192,
            memory_gib=2048,
            local_nvme=True,
            price_per_hour=113.93,
            all_reduce_baseline_gbytes_s=300.0,
        ),
        InstanceType(
            name="p6-b300.48xlarge",
            accelerator="B300",
            accelerators=8,
            hbm_mib=275040,
            hbm_gbytes_s=8000.0,
            bf16_tflops=2250.0,
            nvlink_gbytes_s=1800,
            efa_interfaces=16,
            efa_gbps=400,
            ena_primary=True,
            card0_efa=False,
            efa_only_device_index=0,
            vcpus=192,
            memory_gib=4096,
            local_nvme=True,
            price_per_hour=142.42,
            all_reduce_baseline_gbytes_s=300.0,
        ),
        InstanceType(
            name="p6e-gb200.36xlarge",
            accelerator="GB200",
            accelerators=4,
            hbm_mib=189440,
            hbm_gbytes_s=8000.0,
            bf16_tflops=2500.0,
            nvlink_gbytes_s=1800,
            efa_interfaces=4,
            efa_gbps=400,
            ena_primary=True,
            card0_efa=False,
            efa_only_device_index=0,
            vcpus=144,
            memory_gib=960,
            local_nvme=True,
            arch="arm64",
            price_per_hour=round(761.90 / 18, 2),
            all_reduce_baseline_gbytes_s=500.0,
        ),
        # Trainium2, per rank = per logical NeuronCore (LNC=2, 4 per chip: Neuron docs, "Logical NeuronCore
        # configuration"). Chip figures, divided by 4 here: 96 GiB HBM at 2.9 TB/s, 667 TFLOP/s bf16 dense
        # (awsdocs-neuron about-neuron/arch/neuron-hardware/trainium2 and nki/arch/trainium2_arch);
        # NeuronLink-v3 1,024 GB/s per chip inside an instance and 256 GB/s per chip between the
        # instances of a Trn2 UltraServer, EFAv3 3,200 Gb/s per instance (trn2-arch, "Trn2 instance
        # specifications"). EC2 (moto 5.2.5 describe_instance_types): 16 Trainium2 with 8 cores each,
        # 192 vCPUs, 2,048 GiB, 4 x 1,900 GB NVMe, 16 network cards of 200 Gb/s, MaximumEfaInterfaces 16,
        # card 0 offers efa/efa-only (so the ENA primary with efa-only beside it at card 0, efa-only at
        # device 0 on cards 1-15, EC2's current layout). Price: $35.76/h on demand in us-east-2, the
        # region Trn2 is sold in (instances.vantage.sh, 2025-11-30); trn2u is sold only as UltraServer
        # Capacity Blocks, for which no list price is published: the same per-instance figure, an
        # estimate. All-reduce baseline: none is published for Trainium (nccom-test's guide shows only a
        # 2-rank example). Two nodes' all_reduce is bounded by each node's EFA, which here is p6-b200's
        # 3,200 Gb/s, so p6-b200's aws-parallelcluster minimum (300 GB/s at 1 GiB) stands in: UNVERIFIED
        # on Trainium; replace it with a measured nccom-test figure (workload.gateMinFraction scales it).
        InstanceType(
            name="trn2.48xlarge",
            accelerator="Trainium2",
            accelerators=64,
            vendor="neuron",
            ranks_per_chip=4,
            neuron_cores_per_chip=8,
            hbm_mib=96 * 1024 // 4,
            hbm_gbytes_s=2900.0 / 4,
            bf16_tflops=667.0 / 4,
            nvlink_gbytes_s=1024 // 4,
            efa_interfaces=16,
            efa_gbps=200,
            ena_primary=True,
            efa_only_device_index=0,
            vcpus=192,
            memory_gib=2048,
            local_nvme=True,
            price_per_hour=35.76,
            all_reduce_baseline_gbytes_s=300.0,
        ),
        InstanceType(
            name="trn2u.48xlarge",
            accelerator="Trainium2",
            accelerators=64,
            vendor="neuron",
            ranks_per_chip=4,
            neuron_cores_per_chip=8,
            hbm_mib=96 * 1024 // 4,
            hbm_gbytes_s=2900.0 / 4,
            bf16_tflops=667.0 / 4,
            nvlink_gbytes_s=1024 // 4,
            domain_inter_node_gbytes_s=256 // 4,
            efa_interfaces=16,
            efa_gbps=200,
            ena_primary=True,
            efa_only_device_index=0,
            vcpus=192,
            memory_gib=2048,
            local_nvme=True,
            price_per_hour=35.76,
            all_reduce_baseline_gbytes_s=300.0,
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
        """Ranks in the domain (GPUs, or logical NeuronCores)."""
        return self.instances * CATALOG[self.instance_type].accelerators


# docs/hardware.md "Buying and placing": u-p6e-gb200x36 = 9 instances, x72 = 18, sold only as Capacity Blocks.
# A Trn2 UltraServer (u-trn2x64) is four trn2u.48xlarge joined by NeuronLink-v3, 64 chips (trn2-arch).
ULTRASERVERS: dict[str, UltraServer] = {
    u.name: u
    for u in [
        UltraServer("u-p6e-gb200x36", "p6e-gb200.36xlarge", 9),
        UltraServer("u-p6e-gb200x72", "p6e-gb200.36xlarge", 18),
        UltraServer("u-trn2x64", "trn2u.48xlarge", 4),
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


def gate_floor_gbytes_s(instance_type: str, fraction: float) -> float | None:
    """The interconnect gate's all_reduce bus-bandwidth floor: the published baseline x fraction
    (None where no baseline is published). The gate Job passes it; the policy pack checks it."""
    baseline = CATALOG[instance_type].all_reduce_baseline_gbytes_s if instance_type in CATALOG else None
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
# in Dallas (docs/hardware.md "Buying and placing"). Only the GPU subnet may lie in one.
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
