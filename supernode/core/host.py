"""The host baseline of a GPU node: what the node bootstrap sets (components/aws/accelerators.py,
host_baseline_script) and the node inventory checks on every node (supernode.trainer.node.inventory), so the two
cannot disagree. Settings from the EFA and NCCL guides."""

from __future__ import annotations

# vm.* and kernel.* are host-wide, so a pod reads the node's values.
HOST_SYSCTLS = {
    "vm.max_map_count": 1048576,  # EFA/NCCL register many memory regions; each is a mapping
    "kernel.numa_balancing": 0,  # page migration under pinned (RDMA / CUDA) buffers stalls transfers
}
NOFILE = 1048576  # NCCL with EFA opens many sockets and devices per rank
AMAZON_TIME_SYNC = ("169.254.169.123", "fd00:ec2::123")  # chrony's source: IPv4, IPv6
