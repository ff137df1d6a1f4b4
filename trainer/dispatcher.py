"""Token dispatchers: how an MoE layer's token copies reach their experts and come back.

`supernode.trainer.moe.MoE` routes and combines; everything that talks to other ranks is here, and
`supernode.trainer.parallel.parallelize` injects the dispatcher that fits the layout:
- `TokenDispatcher` (default, one device or tensor parallel without expert parallel): every expert
  is on this rank. With a `tp_group` the tensor-parallel ranks, which hold the same tokens, each
  route and compute only their 1/tp slice of them and the outputs are all-gathered, so no token is
  processed twice.
- `AllToAllDispatcher` (expert parallel): routed experts are split along E over `ep_group`; token
  copies travel to their expert's rank and back with `all_to_all_single` with uneven split sizes
  (dropless: nothing is capped). With `overlap` the routed copies go in `chunks` pieces, each a
  share of every expert's copies, pipelined so communication runs beside computation (`compute`).
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
    """Experts split along E over `ep_group`: dispatch copies to their expert's rank, compute, return.

    With `overlap` the copies travel in `chunks` pieces (chunk i holds rows [c*i//K, c*(i+1)//K)
    of each expert's c copies, so every piece has about 1/K of every expert's work) on an
    asynchronous schedule, each collective queued on the group's own thread before the computation
    it runs beside:

        dispatch 0 ............ shared expert
        dispatch i+1, combine i-1 .. experts on chunk i     (i = 0 .. K-1)
        combine K-1 ........... (nothing: exposed)

    `supernode.core.capacity.step_time` models exactly this forward schedule. Backward runs the
    all-to-alls synchronously (`_AllToAll.backward`). Every token copy meets the same expert
    arithmetic as in one piece, so outputs and input gradients equal the unchunked path's; the
    expert weights' gradients are sums over K pieces instead of one, equal up to fp32 rounding
    of the order of that sum (tests/trainer/test_overlap.py).
    """

    def __init__(
        self, ep_group: ProcessGroup, tp_group: ProcessGroup | None = None, overlap: bool = True, chunks: int = 2
    ):
        super().__init__(tp_group)
        if chunks < 1:
            raise ValueError(f"all-to-all chunks must be at least 1, got {chunks}")
        self.ep_group, self.overlap = ep_group, overlap
        self.chunks = chunks if overlap else 1

    def compute(
        self, experts: nn.Module, routed: Tensor, counts: Tensor, shared: Callable[[], Tensor | None]
    ) -> tuple[Tensor, Tensor | None]:
        group, k = self.ep_group, self.chunks
        ep = dist.get_world_size(group)
        local = counts.numel() // ep
        # Chunk i of expert e: copies [c*i//K, c*(i+1)//K) of its c, in the (token) order they came.
        bounds = counts.unsqueeze(0) * torch.arange(k + 1, device=counts.device).unsqueeze(1) // k
        piece_counts = bounds.diff(dim=0)  # [K, E]
        # Counts first: recv[j, i, e] = copies rank j sends in chunk i to my local expert e. The split
        # sizes must be known on the host (all_to_all_single takes lists): the one sync of the layer.
        send_counts = piece_counts.view(k, ep, local).transpose(0, 1).contiguous()
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=group)
        send_splits = piece_counts.view(k, ep, local).sum(2).tolist()  # [chunk][rank]
        recv_splits = recv.sum(2).T.tolist()  # [chunk][rank]
        pieces = routed
        if k > 1:  # routed sorted by chunk, then expert as before
            starts = torch.cumsum(counts, 0) - counts
            expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
            position = torch.arange(routed.shape[0], device=counts.device) - starts[expert]
            chunk = ((position + 1) * k - 1) // counts[expert].clamp(min=1)
            by_chunk = torch.argsort(chunk, stable=True)
            unchunk = torch.argsort(by_chunk)
            pieces = _Permute.apply(routed, by_chunk, unchunk)
        sent = pieces.split([sum(s) for s in send_splits])
        # With overlap each collective is asynchronous: its handle waits in `pending`/`back`.
        pending: list[list] = [[] for _ in range(k)]
        back: list[list] = [[] for _ in range(k)]
        hold = (lambda works: works) if self.overlap else (lambda works: None)
        arrived = [_AllToAll.apply(sent[0], send_splits[0], recv_splits[0], group, hold(pending[0]))]
        shared_out = shared()  # beside dispatch 0 when overlap is on
        returned: list[Tensor] = []
        for i in range(k):
            for work in pending[i]:
                work.wait()
            if i + 1 < k:  # the next chunk travels while this one computes
                arrived.append(
                    _AllToAll.apply(sent[i + 1], send_splits[i + 1], recv_splits[i + 1], group, hold(pending[i + 1]))
                )
            out = self._experts(experts, arrived[i], recv[:, i])
            returned.append(_AllToAll.apply(out, recv_splits[i], send_splits[i], group, hold(back[i])))
        for works in back:
            for work in works:
                work.wait()
        if k == 1:
            return returned[0], shared_out
        return _Permute.apply(torch.cat(returned), unchunk, by_chunk), shared_out  # back to the order of `routed`

    @staticmethod
    def _experts(experts: nn.Module, received: Tensor, recv: Tensor) -> Tensor:
        """received: one chunk's copies grouped by source rank, then local expert, recv[j, e] of each
        -> the experts' outputs in the same order."""
        ep, local = recv.shape
        # The experts want them grouped by expert.
        source_expert = torch.repeat_interleave(torch.arange(ep * local, device=recv.device), recv.flatten())
        by_expert = torch.argsort((source_expert % local) * ep + source_expert // local, stable=True)
        computed = experts(received[by_expert], recv.sum(0))
        return torch.empty_like(computed).index_copy(0, by_expert, computed)


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


class _Permute(torch.autograd.Function):
    """Rows in the order `perm`; backward gathers by `inverse` (no scatter-add: cheaper on CPU)."""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, g: Tensor):
        (inverse,) = ctx.saved_tensors
        return g.index_select(0, inverse), None, None


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
