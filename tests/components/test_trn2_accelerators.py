"""Trainium node groups: the EKS-optimised AL2023 Neuron AMI by release, the Neuron taint and labels the
Neuron add-ons select, and one node group per Trn2 UltraServer labelled with its NeuronLink domain."""

from __future__ import annotations

from supernode.components.aws.accelerators import (
    DOMAIN_LABEL,
    NEURON_TAINT,
    ami_parameter,
    node_labels,
)
from supernode.core.config import AcceleratorNodeGroup, Capacity


def test_the_neuron_ami_is_pinned_by_release():
    assert ami_parameter("1.33", "1.33.5-20251120", "x86_64", "neuron") == (
        "/aws/service/eks/optimized-ami/1.33/amazon-linux-2023/x86_64/neuron/"
        "amazon-eks-node-al2023-x86_64-neuron-1.33-v20251120/image_id"
    )
    assert "/nvidia/" in ami_parameter("1.33", "1.33.5-20251120")  # GPUs keep the NVIDIA AMI


def test_trainium_nodes_are_labelled_and_tainted_for_the_neuron_add_ons():
    group = AcceleratorNodeGroup(
        name="trn2-ultra-a",
        instance_type="trn2u.48xlarge",
        ultra_server="u-trn2x64",
        nodes=4,
        ami_release_version="1.33.5-20251120",
        capacity=Capacity(type="capacity-block", reservation_id="cr-0a64a64a64a64a640"),
    )
    labels = node_labels(group)
    assert labels["aws.amazon.com/neuron.present"] == "true" and "nvidia.com/gpu.present" not in labels
    assert labels["supernode.io/accelerator"] == "Trainium2" and labels[DOMAIN_LABEL] == "trn2-ultra-a"
    assert labels["supernode.io/ultraserver"] == "u-trn2x64"
    assert (NEURON_TAINT.key, NEURON_TAINT.value, NEURON_TAINT.effect) == (
        "aws.amazon.com/neuron",
        "true",
        "NoSchedule",
    )
