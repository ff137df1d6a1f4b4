"""The accelerator vendor seam: one row per vendor of what differs between them, read by the catalog
(`InstanceType.vendor_row`), the add-ons, monitoring and the policy pack. A new vendor is one row here
plus its add-on files (device plugin, exporter) in components/addons/."""

from __future__ import annotations

from dataclasses import dataclass

from .observability import DCGM_SCRAPE_JOB, NEURON_SCRAPE_JOB


@dataclass(frozen=True)
class AcceleratorVendor:
    # The extended resource a pod requests for the node's accelerators: whole GPUs, or whole Neuron
    # devices (chips), which hold whatever the node's LNC setting makes of their cores.
    device_resource: str
    link_name: str  # the scale-up link inside a domain, as plans and findings name it
    rank_noun: str  # what one rank runs on
    torch_device: str  # the torch device type the trainer runs on (supernode.trainer.device)
    device_plugin: str  # the add-on that advertises device_resource (components/addons/<name>.yaml)
    exporter: str  # the accelerator metrics exporter add-on
    exporter_noun: str  # how findings name it
    scrape_job: str  # the Prometheus job that scrapes the exporter (supernode.core.observability)
    # EP and TP must stay inside one scale-up domain (`layout.domain_rules`): on Trainium a logical core
    # gets 6.25 GB/s over EFA against NeuronLink's 256, so leaving is refused, not costed; GPUs may pay
    # EFA for EP, and the plan costs it.
    keeps_ep_tp_in_domain: bool
    # The node taint (value "true", NoSchedule) only pods that ask for the accelerators tolerate: for
    # Neuron, the one the device plugin's own manifest tolerates (aws-neuron-sdk src/k8).
    taint_key: str
    present_label: str  # the label that says a node carries them (the add-ons' node affinity reads it)
    # The EKS-optimised AL2023 AMI variant: NVIDIA (driver, fabric manager, IMEX, EFA) or Neuron (the
    # Neuron driver and runtime, EFA); neither carries the device plugin, which the add-ons install.
    ami_variant: str
    # The node health agent (trainer/node/agent.py) judges this vendor's nodes: it reads nvidia-smi, DCGM
    # and XID lines, so only NVIDIA nodes join unchecked, get the agent, its role and its log alarms.
    node_agent: bool
    # An NVLink domain wider than one node (GB200 NVL72) needs IMEX channels, which the job claims from a
    # ComputeDomain; a Trn2 UltraServer's NeuronLink needs none (the Neuron runtime reaches the other
    # instances' chips itself).
    cross_node_domain_needs_imex: bool
    # Why the serving path (vLLM's CUDA image) cannot serve on this vendor; empty where it can.
    not_served_because: str


VENDORS: dict[str, AcceleratorVendor] = {
    "nvidia": AcceleratorVendor(
        device_resource="nvidia.com/gpu",
        link_name="NVLink",
        rank_noun="GPU",
        torch_device="cuda",
        device_plugin="nvidia-device-plugin",
        exporter="dcgm-exporter",
        exporter_noun="DCGM exporter",
        scrape_job=DCGM_SCRAPE_JOB,
        keeps_ep_tp_in_domain=False,
        taint_key="nvidia.com/gpu",
        present_label="nvidia.com/gpu.present",
        ami_variant="nvidia",
        node_agent=True,
        cross_node_domain_needs_imex=True,
        not_served_because="",
    ),
    "neuron": AcceleratorVendor(
        device_resource="aws.amazon.com/neurondevice",
        link_name="NeuronLink",
        rank_noun="logical NeuronCore",
        torch_device="neuron",
        device_plugin="neuron-device-plugin",
        exporter="neuron-monitor",
        exporter_noun="neuron-monitor exporter",
        scrape_job=NEURON_SCRAPE_JOB,
        keeps_ep_tp_in_domain=True,
        taint_key="aws.amazon.com/neuron",
        present_label="aws.amazon.com/neuron.present",
        ami_variant="neuron",
        node_agent=False,
        cross_node_domain_needs_imex=False,
        # docs/architecture.md, "Serving on Trainium"
        not_served_because=(
            "the serving path runs vLLM's CUDA image on nvidia.com/gpu, and vLLM serves Trainium only through "
            "the vLLM Neuron plugin (beta), a separate server with its own port of each architecture, compiled "
            "per shape bucket"
        ),
    ),
}
