"""Token dispatchers: how an MoE layer's token copies reach their experts and come back.

`supernode.trainer.moe.MoE` routes and combines; everything that talks to other ranks is here, and
`supernode.trainer.parallel.parallelize` injects the dispatcher that fits the layout:
- `TokenDispatcher` (default, one device or tensor parallel without expert parallel): every expert
  is on this rank. With a `tp_group` the tensor-parallel ranks, which hold the same tokens, each
  route and compute only their 1/tp slice of them and the outputs are all-gathered, so no token is
  processed twice.
- `AllToAllDispatcher` (expert parallel): routed experts are split along E over `ep_group`; token
  copies travel to their expert's rank and back with `all_to_all_single` with uneven split sizes
  (dropless: nothing is capped). With `overlap` the shared expert runs while the dispatch is in
  flight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

ProcessGroup = dist.ProcessGroup


class TokenDispatcher:
    """All experts local; an optional tensor-parallel token split around the layer."""

    def __init__(self, tp_group: ProcessGroup | None = None):
        self.tp_group = tp_group

    def scatter(self, rows: Tensor) -> tuple[Tensor, float]:
        """-> (the rows this rank routes, their share of the layer's rows on this rank)."""
        if self.tp_group is None:
            return rows, 1.0
        n = dist.get_world_size(self.tp_group)
        if rows.shape[0] % n:
            raise ValueError(f"tokens per rank ({rows.shape[0]}) must be divisible by tp ({n}) for the MoE layer")
        return _TokenSlice.apply(rows, self.tp_group), 1.0 / n

    def gather(self, rows: Tensor) -> Tensor:
        """The inverse of `scatter` for the layer's output."""
        return rows if self.tp_group is None else _TokenGather.apply(rows, self.tp_group)

    def compute(
        self, experts: nn.Module, routed: Tensor, counts: Tensor, shared: Callable[[], Tensor | None]
    ) -> tuple[Tensor, Tensor | None]:
        """routed: token copies sorted by expert, counts[e] of them for expert e (all experts).
        -> (expert outputs in the same order, the shared expert's output or None)."""
        return experts(routed, counts), shared()


class AllToAllDispatcher(TokenDispatcher):
    """Experts split along E over `ep_group`: dispatch copies to their expert's rank, compute, return."""

    def __init__(self, ep_group: ProcessGroup, tp_group: ProcessGroup | None = None, overlap: bool = True):
        super().__init__(tp_group)
        self.ep_group, self.overlap = ep_group, overlap

    def compute(
        self, experts: nn.Module, routed: Tensor, counts: Tensor, shared: Callable[[], Tensor | None]
    ) -> tuple[Tensor, Tensor | None]:
        group = self.ep_group
        ep = dist.get_world_size(group)
        local = counts.numel() // ep
        # Counts first: recv[j * local + e] = tokens rank j sends to my local expert e. The split
        # sizes must be known on the host (all_to_all_single takes lists): the one sync of the layer.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = recv.view(ep, local).sum(1).tolist()
        pending: list | None = [] if self.overlap else None
        received = _AllToAll.apply(routed, send_splits, recv_splits, group, pending)
        shared_out = shared()  # runs while the dispatch is in flight when overlap is on
        for work in pending or ():
            work.wait()
        # Arrived grouped by source rank, then expert; the experts want them grouped by expert.
        source_expert = torch.repeat_interleave(torch.arange(ep * local, device=recv.device), recv)
        by_expert = torch.argsort((source_expert % local) * ep + source_expert // local, stable=True)
        computed = experts(received[by_expert], recv.view(ep, local).sum(0))
        out = torch.empty_like(computed).index_copy(0, by_expert, computed)
        return _AllToAll.apply(out, recv_splits, send_splits, group), shared_out


# -- autograd functions for the collectives -----------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single; backward sends gradients back along the same routes.

    With `pending` (a list) the forward is asynchronous: the work handle is appended and the
    caller must wait on it before reading the output (used to overlap the shared expert).
    """

    @staticmethod
    def forward(
        ctx, x: Tensor, send: list[int], recv: list[int], group: ProcessGroup, pending: list | None = None
    ) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        work = dist.all_to_all_single(out, x.contiguous(), recv, send, group=group, async_op=pending is not None)
        if pending is not None:
            pending.append(work)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        out = g.new_empty(sum(ctx.send), *g.shape[1:])
        dist.all_to_all_single(out, g.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None, None


class _TokenSlice(torch.autograd.Function):
    """Forward: this rank's 1/n of replicated rows. Backward: all-gather the slices' gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(n)[r].contiguous()

    @staticmethod
    def backward(ctx, g: Tensor):
        return _gather_rows(g, ctx.group), None


class _TokenGather(torch.autograd.Function):
    """Forward: all-gather rows. Backward: the gradient is replicated, keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(n)[r].contiguous(), None


def _gather_rows(x: Tensor, group: ProcessGroup) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)
