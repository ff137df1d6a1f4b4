"""Parallelism from the Plan: the layout checked, device meshes, and `parallelize` (TP -> EP -> AC -> FSDP2).

The layout is the Plan's `parallel`, a `supernode.core.mesh.Mesh`: it owns the rank order (tp
fastest, pp outermost, as in torchtitan), every rank's coordinates and the shape of each device
mesh; this module only builds those meshes. The ranks are numbered NVLink domain by domain
(`renumber_by_domain`), so every EP and TP group lies inside one domain whatever order torchrun
handed them out in. Each pipeline stage is a block of world/pp consecutive ranks; inside it, three
meshes (each with the "pp" dim in front, dims of degree 1 left out):
- `dense` ("dp_replicate", "dp_shard", "tp"): attention, dense FFN, embeddings (TP + FSDP/HSDP);
- `experts` ("dp_replicate", "edp", "ep"): the EP group is carved out of dp_shard*tp (consecutive
  ranks), edp = dp_shard*tp/ep ranks hold the same experts and FSDP-shard them;
- `moe` ("dp_replicate", "dp_shard_tp"): the router and shared expert. Inside an MoE layer each
  tensor-parallel rank routes its own 1/tp of the tokens, so these parameters see different tokens
  on every rank and their gradients are reduced over dp_shard*tp, not only over dp_shard.
FSDP averages over the ranks of its mesh; MoE gradients are rescaled so that every parameter ends
up with the data-parallel mean, exactly what one process computes on the global batch.
With pp > 1 the model is built as pipeline stages (`supernode.trainer.pipeline`), each parallelised here.
"""

from __future__ import annotations

import ctypes
import math
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from supernode.core.config import Model, Parallel
from supernode.core.errors import BadInput, ConfigError
from supernode.core.layout import layout_rules
from supernode.core.mesh import Mesh
from supernode.core.plan import Plan
from supernode.core.topology import GroupPlacement, rank_order

from .dispatcher import AllToAllDispatcher, TokenDispatcher
from .log import LOG
from .model import Transformer
from .moe import MoE


def checked_layout(plan: Plan, world_size: int, max_tp: int | None = None) -> Parallel:
    """The plan's layout for a job of `world_size` ranks, checked by the core's layout validator
    (tp at most `max_tp`, the GPUs of a node; default: no limit beyond the world size)."""
    issues = layout_rules(
        plan.model,
        plan.parallel,
        plan.training,
        world_size,
        max_tp or world_size,
        prefix="plan:",
        world_source=" (WORLD_SIZE of this job)",
    )
    if issues:
        raise ConfigError(issues, "the plan does not fit this job")
    return plan.parallel


def _mesh(device_type: str, dims: tuple[tuple[str, int], ...], keep: tuple[str, ...] = ()) -> DeviceMesh | None:
    kept = [(name, n) for name, n in dims if n > 1 or name in keep]
    if not kept:
        return None
    return init_device_mesh(device_type, tuple(n for _, n in kept), mesh_dim_names=tuple(name for name, _ in kept))


# This rank's NVLink domain: GPUs that reach each other's memory over NVLink (a node, or on GB200 an
# UltraServer's nodes). Set it to override what NVML says (tests; a job whose nodes' clique is known).
DOMAIN_ENV = "SUPERNODE_NVLINK_DOMAIN"
GROUPED_DIMS = ("ep", "tp")  # the all-to-all and per-layer collectives: each group inside one domain


def nvlink_domain() -> str:
    """This rank's NVLink domain label: `SUPERNODE_NVLINK_DOMAIN` if set, else the GPU's NVLink
    fabric clique as GPU Feature Discovery writes `nvidia.com/gpu.clique` (GB200), else the node
    (p5/p6: the NVLink domain is one instance)."""
    return os.environ.get(DOMAIN_ENV) or nvml_clique() or socket.gethostname()


def nvml_clique() -> str | None:
    """`<clusterUuid>.<cliqueId>` of this node's GPUs once their NVLink fabric is up; None without
    pynvml, a GPU, or a multi-node fabric (pre-GB200 GPUs report the state not supported). GPU 0
    speaks for the node: GPU Feature Discovery, too, labels a node with one clique."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            info = pynvml.c_nvmlGpuFabricInfo_t()
            pynvml.nvmlDeviceGetGpuFabricInfo(pynvml.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    cluster = bytes(info.clusterUuid)
    if (
        info.state != pynvml.NVML_GPU_FABRIC_STATE_COMPLETED or info.status != pynvml.NVML_SUCCESS or not any(cluster)
    ):  # a fabric not (yet) formed: only the node's own NVLink is usable
        return None
    return f"{uuid.UUID(bytes=cluster)}.{info.cliqueId}"


def domain_order(world_size: int, placement: Sequence[GroupPlacement]) -> list[int]:
    """torchrun's ranks in the order to number them, NVLink domain by domain
    (`supernode.core.topology.rank_order`), so that every EP and TP group the plan places inside a
    domain (`placement`, the Plan's topology) lies inside one. One all_gather_object of the domain labels: the only
    collective, and
    every rank then computes the same order. A group the plan lets cross domains by design (EP wider
    than a domain) is said once; the ranks are still ordered domain by domain, as the plan's costs
    assume. Raises BadInput (on every rank alike) when the labels cannot keep a group inside."""
    labels: list[str | None] = [None] * world_size
    dist.all_gather_object(labels, nvlink_domain())
    placed = {g.dim: g for g in placement if g.dim in GROUPED_DIMS and g.size > 1}
    inside = [g for g in placed.values() if g.inside_domain]
    crossing = [g for g in placed.values() if not g.inside_domain]
    if crossing:
        LOG.info(
            "; ".join(
                f"{g.dim} {g.size} spans {g.domains} NVLink domains by the plan's design ({g.link})" for g in crossing
            )
            + ": those groups cross domains over EFA"
        )
    try:
        return rank_order(labels, math.lcm(1, *(g.size for g in inside)))
    except ValueError as e:
        kept = " and ".join(f"{g.dim} {g.size}" for g in inside)
        raise BadInput(
            f"rank order: {e}; the plan keeps {kept} inside one domain: check the nodes' "
            f"nvidia.com/gpu.clique labels (NVLink fabric up?) or {DOMAIN_ENV}"
        ) from None


def renumber_by_domain(
    world_size: int,
    placement: Sequence[GroupPlacement],
    backend: str,
    timeout: timedelta,
) -> None:
    """Number the ranks of the default process group NVLink domain by domain (`domain_order`), so the
    row-major meshes put every EP and TP group inside one domain and everything that derives a
    coordinate from the rank (data shard, stage, rank 0's duties) follows. Where torchrun's order is
    already that order (the usual case), nothing is re-initialised.

    Why renumber rather than build the meshes over a permuted rank tensor: c10d numbers a group's
    members by ascending global rank and DTensor/FSDP assemble shards in that order, not by mesh
    coordinate, so a mesh whose ranks do not ascend along every dim silently scrambles sharded
    tensors (tests/trainer/test_parallel.py shows it). Rank 0 keeps rank 0: the first domain is
    rank 0's and ranks ascend inside a domain."""
    order = domain_order(world_size, placement)
    if order == sorted(order):
        return
    rank = order.index(dist.get_rank())
    # Re-rendezvous on the job's store (a fresh prefix), as the same processes under new numbers.
    store = dist.PrefixStore("supernode/domain-order/", dist.distributed_c10d._get_default_store())
    dist.destroy_process_group()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


@dataclass(frozen=True)
class Meshes:
    dense: DeviceMesh | None
    experts: DeviceMesh | None
    moe: DeviceMesh | None
    stage: DeviceMesh | None = None

    @classmethod
    def build(cls, layout: Mesh, device_type: str) -> Meshes:
        """The layout's device meshes (`Mesh.device_meshes`), over the default process group."""
        shapes = layout.device_meshes()
        # Mixed precision is FSDP's (`_fully_shard`), so a one-GPU job keeps its FSDP dims at size 1:
        # every parameter is then a DTensor that computes in bf16 (measured on one H200 without
        # this: the dev model trained in fp32 at 3% MFU).
        one_gpu = isinstance(layout, Parallel) and bf16_compute(layout, device_type) and layout.world_size == 1
        return cls(
            dense=_mesh(device_type, shapes["dense"], keep=("dp_shard",) if one_gpu else ()),
            experts=_mesh(device_type, shapes["experts"], keep=("edp",) if one_gpu else ()),
            moe=_mesh(device_type, shapes["moe"], keep=("dp_shard_tp",) if one_gpu else ()),
            # The ranks of one stage, for what sums over all of its tokens (the expert counts); kept
            # even with one rank per stage, where None would mean the whole job.
            stage=(
                init_device_mesh(device_type, (layout.pp, layout.stride("pp")), mesh_dim_names=("pp", "stage"))
                if layout.pp > 1
                else None
            ),
        )

    @staticmethod
    def sub(mesh: DeviceMesh | None, *names: str) -> DeviceMesh | None:
        """The named dims that exist in `mesh` (None when none does)."""
        present = tuple(n for n in names if mesh is not None and n in (mesh.mesh_dim_names or ()))
        return mesh[present] if present else None

    @property
    def tp(self) -> DeviceMesh | None:
        return self.sub(self.dense, "tp")

    @property
    def dp(self) -> DeviceMesh | None:
        """FSDP's mesh: 2-D (HSDP: replicate x shard) when both degrees exceed 1. With dp_shard = 1
        it is the replicate dim alone, which FSDP then shards over: same maths, less memory."""
        return self.sub(self.dense, "dp_replicate", "dp_shard")

    @property
    def pp(self) -> DeviceMesh | None:
        return self.sub(self.dense, "pp")

    @property
    def router(self) -> DeviceMesh | None:
        """The router's and shared expert's FSDP mesh (see the module docstring)."""
        return self.sub(self.moe, "dp_replicate", "dp_shard_tp")

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's pipeline stage; None at pp 1: every rank of the job."""
        return self.stage["stage"].get_group() if self.stage is not None else None

    @property
    def ep(self) -> DeviceMesh | None:
        return self.sub(self.experts, "ep")

    @property
    def expert_dp(self) -> DeviceMesh | None:
        return self.sub(self.experts, "dp_replicate", "edp")


def _size(mesh: DeviceMesh | None) -> int:
    return mesh.size() if mesh is not None else 1


def build_model(
    cfg: Model, parallel: Parallel, device: torch.device, seed: int, mesh: Meshes | None = None
) -> Transformer:
    """The model sharded from the first byte: built on the meta device, parallelised, then only this
    rank's shards are allocated (`to_empty`) and initialised in place, equal to the single-process
    `Transformer.init_weights(seed)` at every layout. (pp > 1: `supernode.trainer.pipeline.build_pipeline`.)"""
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, parallel, mesh or Meshes.build(parallel, device.type), device.type)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def bf16_compute(parallel: Parallel, device_type: str) -> bool:
    """Whether the step computes in bf16: `mixedPrecision: bf16` as `device_type` runs it
    (`Parallel.computed_on`, the rule the planner costs by: a CPU computes in fp32)."""
    return parallel.computed_on(device_type).mixed_precision == "bf16"


def autocast_dtype(parallel: Parallel, mesh: Meshes, device_type: str) -> torch.dtype | None:
    """bf16 where the plan says bf16 on an accelerator but FSDP's mixed precision has no mesh to apply
    to (several ranks, dp 1: tp, ep or pp alone; one GPU keeps its FSDP dims instead: `Meshes.build`):
    the forward runs under torch.autocast, torchtitan's choice there, rather than in fp32 at about half
    the speed and twice the activation memory the plan assumes. None elsewhere."""
    return torch.bfloat16 if bf16_compute(parallel, device_type) and mesh.dp is None else None


def compute_dtype(mesh: Meshes, parallel: Parallel, device_type: str) -> torch.dtype:
    """The dtype activations flow in: bf16 where FSDP's mixed precision applies (see `_fully_shard`)."""
    bf16 = bf16_compute(parallel, device_type) and mesh.dp is not None
    return torch.bfloat16 if bf16 else torch.float32


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model or of a pipeline stage (whose layers keep their global index)."""
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def parallelize(model: Transformer, parallel: Parallel, mesh: Meshes, device_type: str) -> Transformer:
    """Apply tensor parallel, expert parallel, activation checkpointing and FSDP2, in that order,
    as the layout `parallel` says, on its device meshes `mesh` (`Meshes.build`).

    `model` may be on the meta device (then `to_empty` and `init_weights`, as `build_model` does)
    or hold the same full weights on every rank. The layout was checked once, by `checked_layout`.
    """
    if parallel.tp > 1:
        _tensor_parallel(model, mesh.tp)
    tp_group = mesh.tp.get_group() if parallel.tp > 1 else None
    for moe in model.moe_layers():
        if parallel.ep > 1:
            for name in ("w1", "w2", "w3"):
                full = getattr(moe.experts, name)
                setattr(moe.experts, name, nn.Parameter(distribute_tensor(full.detach(), mesh.ep, [Shard(0)])))
            moe.dispatcher = AllToAllDispatcher(
                mesh.ep.get_group(), tp_group, parallel.overlap, parallel.all_to_all_chunks
            )
        else:
            moe.dispatcher = TokenDispatcher(tp_group)
        # FSDP averages over its mesh; rescale to the mean over the dp data-parallel streams.
        moe.grad_scale = _size(mesh.router) / parallel.dp
        moe.experts.grad_scale = _size(mesh.expert_dp) / parallel.dp
    _activation_checkpointing(model, parallel.activation_checkpointing)
    _fully_shard(model, mesh, parallel, device_type, pipelined=parallel.pp > 1)
    return model


def _tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    for block in blocks(model):
        parallelize_module(
            block.attention,
            tp_mesh,
            {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()},
        )
        if not isinstance(block.ffn, MoE):  # the MoE layer slices tokens instead (its dispatcher)
            parallelize_module(
                block.ffn, tp_mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
            )


def _activation_checkpointing(model: Transformer, mode: str) -> None:
    for block in blocks(model):
        block.checkpoint = mode


def _fully_shard(model: Transformer, mesh: Meshes, parallel: Parallel, device_type: str, pipelined: bool) -> None:
    # bf16 compute with fp32 reduction on accelerators (`bf16_compute`).
    # Inputs are not cast: activations are bf16 anyway (bf16 weights), and the RoPE tables passed
    # to every block stay fp32.
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
        if bf16_compute(parallel, device_type)
        else MixedPrecisionPolicy()
    )
    dp = mesh.dp
    # Experts that no other rank holds (ep = dp_shard*tp, no replicas) stay out of FSDP: they are
    # DTensors on the EP mesh, and there is nothing to shard or reduce them over.
    unsharded = set()
    sharded = []
    # Pipelined, a block runs once per micro-batch before its backward: resharding after each forward
    # would all-gather it again for every micro-batch (torchtitan's default keeps it gathered).
    reshard = not pipelined
    for block in blocks(model):
        if isinstance(block.ffn, MoE):
            experts = block.ffn.experts
            if mesh.expert_dp is not None:
                fully_shard(experts, mesh=mesh.expert_dp, mp_policy=mp, reshard_after_forward=reshard)
            else:
                unsharded |= set(experts.parameters())
            if mesh.router is not None:
                fully_shard(
                    block.ffn,
                    mesh=mesh.router,
                    mp_policy=mp,
                    ignored_params=unsharded or None,
                    reshard_after_forward=reshard,
                )
        if dp is not None:
            fully_shard(block, mesh=dp, mp_policy=mp, ignored_params=unsharded or None, reshard_after_forward=reshard)
            sharded.append(block)
    if dp is not None:
        fully_shard(model, mesh=dp, mp_policy=mp, reshard_after_forward=False, ignored_params=unsharded or None)
        if parallel.overlap:  # gather the next block's weights while this one computes
            for this, nxt in zip(sharded, sharded[1:]):
                this.set_modules_to_forward_prefetch([nxt])
