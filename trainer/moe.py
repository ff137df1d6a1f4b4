"""Mixture-of-experts FFN: router, optional shared expert, stacked routed experts; expert balancing.

Written for one device and free of process groups: `trainer.parallel` injects the token dispatcher
(`trainer.dispatcher`: tensor-parallel token slices, expert-parallel all-to-all) and `grad_scale`:
FSDP averages a gradient over the group that holds a parameter; MoE parameters collect
contributions of tokens from more ranks than the data-parallel degree, so their gradients are
rescaled to the data-parallel mean (see parallel.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .dispatcher import TokenDispatcher

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
    """Router, routed experts and an optional shared expert; `dispatcher` moves the token copies.

    Statistics stay on the device: `tokens_per_expert` accumulates this rank's routed copies over
    the forwards of a step (not the recomputations of activation checkpointing) until an
    `ExpertBalancer` reduces all layers' counts at the optimizer step. The load-balance loss is
    measured per routing group, the tokens one rank routes in one forward (as in DeepSeek-V3 and
    torchtitan, local statistics need no collective); `balance_groups` splits the rows into that
    many groups, so one process reproduces what a parallel layout computes.
    """

    def __init__(self, dim: int, experts: int, top_k: int, hidden: int, shared_experts: int = 0,
                 score: str = "softmax"):
        super().__init__()
        self.experts_total, self.top_k = experts, top_k
        self.router = Router(dim, experts, top_k, score)
        self.experts = GroupedExperts(experts, dim, hidden)
        self.shared = SwiGLU(dim, hidden * shared_experts) if shared_experts else None
        self.dispatcher: TokenDispatcher = TokenDispatcher()  # trainer.parallel injects another
        self.grad_scale = 1.0  # set by trainer.parallel
        self.balance_groups = 1
        self.register_buffer("tokens_per_expert", torch.zeros(experts, dtype=torch.long), persistent=False)
        # Of the last forward.
        self.load_balance_loss = torch.zeros(())
        self.z_loss = torch.zeros(())

    def forward(self, rows: Tensor) -> Tensor:
        """rows [tokens, dim] -> [tokens, dim]."""
        d = self.dispatcher
        rows, share = d.scatter(rows)
        weights, ids, logits, scores = _module_scaled(self.router, rows, self.grad_scale)
        counts = torch.bincount(ids.flatten(), minlength=self.experts_total)
        self._record_stats(counts, ids, logits, scores, share)
        # Sort token copies by expert (stable: a deterministic order for identical inputs).
        order = torch.argsort(ids.flatten(), stable=True)
        token = order // self.top_k
        # On CPU index_select, not rows[token]: a cheaper gather, and its backward is one index_add
        # instead of advanced indexing's slower accumulating index_put. (CUDA keeps rows[token], whose
        # backward is deterministic there.)
        routed = rows.index_select(0, token) if rows.device.type == "cpu" else rows[token]
        out, shared = d.compute(self.experts, routed, counts, lambda: self._shared(rows))
        out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
        combined = torch.zeros_like(rows).index_add(0, token, out)
        if shared is not None:
            combined = combined + shared
        return d.gather(combined)

    def _shared(self, rows: Tensor) -> Optional[Tensor]:
        if self.shared is None:
            return None
        return _module_scaled(self.shared, rows, self.grad_scale)

    def _record_stats(self, counts: Tensor, ids: Tensor, logits: Tensor, scores: Tensor, share: float) -> None:
        if torch._C._current_graph_task_id() == -1:  # a forward, not a recomputation inside backward
            self.tokens_per_expert.add_(counts.detach())
        # Switch-style balance per routing group: E * sum_i f_i * P_i, averaged over the groups and
        # scaled by this rank's share of its rows so the sum over tensor-parallel slices is the whole.
        g, e = self.balance_groups, self.experts_total
        group_ids = ids.reshape(g, -1)
        f = torch.zeros(g, e, device=ids.device).scatter_add_(1, group_ids, torch.ones_like(group_ids, dtype=torch.float))
        f = f / f.sum(-1, keepdim=True).clamp(min=1)
        probs = (scores / scores.sum(-1, keepdim=True)).reshape(g, -1, e).mean(1)
        self.load_balance_loss = e * (f * probs).sum(-1).mean() * share
        self.z_loss = torch.logsumexp(logits, -1).square().mean() * share


class ExpertBalancer:
    """Aux-loss-free balancing, outside the model: at each optimizer step (a step pre-hook, see
    `attach`) the step's token counts of every MoE layer are summed over the ranks in one
    all-reduce, and each router's bias moves toward balance: up for under-loaded experts, down for
    over-loaded ones. The reduced counts stay on the device (`last_load`) for logging to read."""

    def __init__(self, layers: list[MoE], rate: float, group: Optional[ProcessGroup] = None):
        """`group`: the ranks that route distinct tokens (default: every rank of the job)."""
        self.layers, self.rate = layers, rate
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.group = (group or dist.group.WORLD) if distributed else None
        self.last_load: Optional[Tensor] = None

    def reduce(self) -> Tensor:
        """The global token copies per expert since the last call, [layers, experts]; restarts the count."""
        if not self.layers:
            return torch.zeros(0, 0, dtype=torch.long)
        load = torch.stack([m.tokens_per_expert for m in self.layers])
        if self.group is not None:
            dist.all_reduce(load, group=self.group)
        self.reset()
        return load

    def reset(self) -> None:
        """Forget the counts since the last step (a skipped update must not count twice)."""
        for m in self.layers:
            m.tokens_per_expert.zero_()

    @torch.no_grad()
    def step(self, load: Optional[Tensor] = None) -> Tensor:
        """One bias step from `load` [layers, experts] (default: `reduce()`); returns the load used."""
        load = self.reduce() if load is None else load
        if tuple(load.shape) != (len(self.layers), self.layers[0].experts_total if self.layers else 0):
            raise ValueError(f"load must have shape ({len(self.layers)}, "
                             f"{self.layers[0].experts_total if self.layers else 0}), got {tuple(load.shape)}")
        for moe, counts in zip(self.layers, load):
            counts = counts.float().to(moe.router.bias.device)
            moe.router.bias.add_(self.rate * torch.sign(counts.mean() - counts))
        self.last_load = load
        return load

    def attach(self, optimizer: torch.optim.Optimizer):
        """Run `step()` before every `optimizer.step()`; returns the hook's handle."""
        def hook(opt, args, kwargs) -> None:
            self.step()
        return optimizer.register_step_pre_hook(hook)


def _module_scaled(module: nn.Module, x: Tensor, scale: float) -> Tensor:
    if scale == 1.0:
        return module(x)
    params = {name: _scale_grad(p, scale) for name, p in module.named_parameters()}
    return torch.func.functional_call(module, params, (x,))
