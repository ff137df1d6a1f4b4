"""Mixture-of-experts FFN: router, optional shared expert, stacked routed experts, expert parallel.

Written for one device; `trainer.parallel` attaches process groups afterwards:
- `ep_group`: routed experts are split along E over it; token copies travel to their expert's
  rank and back with `all_to_all_single` with uneven split sizes (dropless: nothing is capped).
- `tp_group`: tensor-parallel ranks hold the same tokens; each routes and computes only its
  1/tp slice of them and the outputs are all-gathered, so no token is processed twice.
- `stats_group`: all ranks that see distinct tokens; token counts are summed over it so the
  load-balance loss, the expert load and the bias update use global counts.
- `grad_scale`: FSDP averages a gradient over the group that holds a parameter; MoE parameters
  collect contributions of tokens from more ranks than the data-parallel degree, so their
  gradients are rescaled to the data-parallel mean (see parallel.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

ProcessGroup = dist.ProcessGroup


# -- grouped matmul ----------------------------------------------------------------------------

def grouped_mm_applies(x: Tensor, w: Tensor) -> bool:
    """`torch._grouped_mm` needs fp32/bf16 (bf16 on sm90+ on CUDA) and 16-byte row strides."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype or x.shape[0] == 0:
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = x.element_size()
    return all((n * size) % 16 == 0 for n in (w.shape[1], w.shape[2]))


def _contiguous_grad(t: Tensor) -> Tensor:
    # grouped_mm's backward rejects gradients with zero strides (e.g. from `.sum()`).
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def expert_ffn(x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, grouped: Optional[bool] = None) -> Tensor:
    """SwiGLU per expert on rows sorted by expert: rows [sum(counts[:e]), sum(counts[:e+1])) use expert e.

    `grouped=None` picks `torch._grouped_mm` when it applies; the loop is the same math per expert.
    """
    if grouped is None:  # w1's shape [E, dim, hidden] covers every operand's row stride
        grouped = grouped_mm_applies(x, w1)
    if grouped:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(_contiguous_grad(torch._grouped_mm(x, w1, offs=offs))) * _contiguous_grad(
            torch._grouped_mm(x, w3, offs=offs))
        return _contiguous_grad(torch._grouped_mm(h, w2, offs=offs))
    outs = []
    for e, rows in enumerate(torch.split(x, counts.tolist())):
        outs.append((F.silu(rows @ w1[e]) * (rows @ w3[e])) @ w2[e])
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class GroupedExperts(nn.Module):
    """Routed experts as stacked weights: w1, w3 [E, dim, hidden], w2 [E, hidden, dim]."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.use_grouped_mm: Optional[bool] = None  # None: where it applies
        self.grad_scale = 1.0  # set by trainer.parallel

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x: rows sorted by (local) expert; counts: rows per local expert."""
        # Under expert parallel the weights are DTensors sharded along E: compute on the local slice.
        # Experts outside FSDP (no replicas to shard over) miss its bf16 cast: match the input.
        w1, w2, w3 = (_scale_grad(w.to_local() if isinstance(w, DTensor) else w, self.grad_scale).to(x.dtype)
                      for w in (self.w1, self.w2, self.w3))
        return expert_ffn(x, counts, w1, w2, w3, self.use_grouped_mm)


class SwiGLU(nn.Module):
    """Dense FFN (and the shared expert): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# -- autograd helpers for the collectives -------------------------------------------------------

class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * ctx.scale, None


def _scale_grad(t: Tensor, scale: float) -> Tensor:
    return t if scale == 1.0 else _ScaleGrad.apply(t, scale)


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single; backward sends gradients back along the same routes.

    With `pending` (a list) the forward is asynchronous: the work handle is appended and the
    caller must wait on it before reading the output (used to overlap the shared expert).
    """

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group: ProcessGroup,
                pending: Optional[list] = None) -> Tensor:
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


# -- router and layer ---------------------------------------------------------------------------

class Router(nn.Module):
    """Top-k over softmax or sigmoid scores; the aux-loss-free bias shifts selection only."""

    def __init__(self, dim: int, experts: int, top_k: int, score: str):
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"router score must be softmax or sigmoid, got {score!r}")
        self.gate = nn.Linear(dim, experts, bias=False)
        self.register_buffer("bias", torch.zeros(experts), persistent=True)
        self.top_k, self.score = top_k, score

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> (gate weights [T, k], expert ids [T, k], logits [T, E] fp32, scores [T, E] fp32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        ids = torch.topk(scores.detach() + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids, logits, scores


class MoE(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int, hidden: int, shared_experts: int = 0,
                 score: str = "softmax"):
        super().__init__()
        self.experts_total, self.top_k = experts, top_k
        self.router = Router(dim, experts, top_k, score)
        self.experts = GroupedExperts(experts, dim, hidden)
        self.shared = SwiGLU(dim, hidden * shared_experts) if shared_experts else None
        # Set by trainer.parallel; the defaults are one device.
        self.ep_group: Optional[ProcessGroup] = None
        self.tp_group: Optional[ProcessGroup] = None
        self.stats_group: Optional[ProcessGroup] = None
        self.grad_scale = 1.0
        self.overlap = True
        # From the last forward.
        self.tokens_per_expert = torch.zeros(experts, dtype=torch.long)
        self.load_balance_loss = torch.zeros(())
        self.z_loss = torch.zeros(())

    def forward(self, rows: Tensor) -> Tensor:
        """rows [tokens, dim] -> [tokens, dim]."""
        slice_frac = 1.0
        if self.tp_group is not None:
            n = dist.get_world_size(self.tp_group)
            if rows.shape[0] % n:
                raise ValueError(f"tokens per rank ({rows.shape[0]}) must be divisible by tp ({n}) for the MoE layer")
            rows, slice_frac = _TokenSlice.apply(rows, self.tp_group), 1.0 / n
        gs = self.grad_scale
        weights, ids, logits, scores = _module_scaled(self.router, rows, gs)
        counts = torch.bincount(ids.flatten(), minlength=self.experts_total)
        self._record_stats(counts, logits, scores, slice_frac)

        # Sort token copies by expert (stable: a deterministic order for identical inputs).
        order = torch.argsort(ids.flatten(), stable=True)
        token = order // self.top_k
        routed = rows[token]
        if self.ep_group is None:
            shared = self._shared(rows)
            out = self.experts(routed, counts)
        else:
            out, shared = self._expert_parallel(routed, counts, rows)
        out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
        combined = torch.zeros_like(rows).index_add(0, token, out)
        if shared is not None:
            combined = combined + shared
        if self.tp_group is not None:
            combined = _TokenGather.apply(combined, self.tp_group)
        return combined

    def _shared(self, rows: Tensor) -> Optional[Tensor]:
        if self.shared is None:
            return None
        return _module_scaled(self.shared, rows, self.grad_scale)

    def _expert_parallel(self, routed: Tensor, counts: Tensor, rows: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """Dispatch token copies to the rank owning their expert, compute, send the results back."""
        group = self.ep_group
        ep = dist.get_world_size(group)
        local = self.experts_total // ep
        # Counts first: recv[j * local + e] = tokens rank j sends to my local expert e.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = recv.view(ep, local).sum(1).tolist()
        pending: Optional[list] = [] if self.overlap else None
        received = _AllToAll.apply(routed, send_splits, recv_splits, group, pending)
        shared = self._shared(rows)  # runs while the dispatch is in flight when overlap is on
        for work in pending or ():
            work.wait()
        # Arrived grouped by source rank, then expert; the experts want them grouped by expert.
        source_expert = torch.repeat_interleave(torch.arange(ep * local, device=recv.device), recv)
        by_expert = torch.argsort((source_expert % local) * ep + source_expert // local, stable=True)
        local_counts = recv.view(ep, local).sum(0)
        computed = self.experts(received[by_expert], local_counts)
        out = torch.empty_like(computed).index_copy(0, by_expert, computed)
        return _AllToAll.apply(out, recv_splits, send_splits, group), shared

    def _record_stats(self, counts: Tensor, logits: Tensor, scores: Tensor, slice_frac: float) -> None:
        global_counts = counts.detach().clone()
        if self.stats_group is not None:
            dist.all_reduce(global_counts, group=self.stats_group)
        self.tokens_per_expert = global_counts
        # Switch-style balance: E * sum_i f_i * P_i with global f and this rank's mean P; scaled by
        # this rank's share of its data-parallel tokens so the sum over tp slices is the whole.
        f = global_counts.float() / global_counts.sum().clamp(min=1)
        probs = scores / scores.sum(-1, keepdim=True)
        self.load_balance_loss = self.experts_total * (f * probs.mean(0)).sum() * slice_frac
        self.z_loss = torch.logsumexp(logits, -1).square().mean() * slice_frac

    @torch.no_grad()
    def update_bias(self, rate: float, load: Optional[Tensor] = None) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones.

        `load`: token counts per expert (default: those of the last forward).
        """
        load = (self.tokens_per_expert if load is None else load).float().to(self.router.bias.device)
        self.router.bias.add_(rate * torch.sign(load.mean() - load))


def _module_scaled(module: nn.Module, x: Tensor, scale: float) -> Tensor:
    if scale == 1.0:
        return module(x)
    params = {name: _scale_grad(p, scale) for name, p in module.named_parameters()}
    return torch.func.functional_call(module, params, (x,))
