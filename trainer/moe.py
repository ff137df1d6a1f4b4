"""Mixture-of-experts FFN: router, optional shared expert, stacked routed experts; expert balancing.

Written for one device and free of process groups: `supernode.trainer.parallel` injects the token dispatcher
(`supernode.trainer.dispatcher`: tensor-parallel token slices, expert-parallel all-to-all) and `grad_scale`:
FSDP averages a gradient over the group that holds a parameter; MoE parameters collect
contributions of tokens from more ranks than the data-parallel degree, so their gradients are
rescaled to the data-parallel mean (see parallel.py).
"""

from __future__ import annotations

import bisect
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .dispatcher import TokenDispatcher

ProcessGroup = dist.ProcessGroup


# -- expert matmuls -----------------------------------------------------------------------------


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


# On CPU the experts run as batched matmuls over blocks of consecutive experts, each expert's rows
# padded with zeros to the block's largest count rounded up to PAD_ROWS (`expert_blocks`). oneDNN's
# AMX/AVX-512 matmuls pay a fixed cost per call and per new shape and run at full speed on row
# counts that are multiples of 32, which a matmul per expert of ragged size (what
# `torch._grouped_mm` does on CPU) never gets. A block grows while its padded rows stay within
# BLOCK_WASTE times its routed rows: fewer, larger batches beat less padding (with memory pooled,
# 4k tokens, paired in one process: one block per layer ran 8-10% faster than blocks capped at
# 4,096 padded rows at 8, 16 and 32 experts; at 32 experts a limit of 1.25x instead of 1.6x was
# no faster); the limit keeps a skewed expert from padding its neighbours. The padded rows are
# saved for backward too: on CPU the experts' activations are up to BLOCK_WASTE times the routed
# rows' (plus < PAD_ROWS rows per expert), which the planner does not model; the GPU path, what
# the prod stacks run, pads nothing.
PAD_ROWS = 32
BLOCK_WASTE = 1.6


def _round_up(n: int) -> int:
    return -(-n // PAD_ROWS) * PAD_ROWS


def expert_blocks(sizes: list[int]) -> list[tuple[slice, int]]:
    """Blocks of consecutive experts for routed-row counts `sizes`: (experts, padded rows per expert)."""
    blocks, start = [], 0
    while start < len(sizes):
        stop, most = start + 1, sizes[start]
        while stop < len(sizes):
            grown = max(most, sizes[stop])
            padded = (stop + 1 - start) * _round_up(grown)
            if padded > BLOCK_WASTE * sum(sizes[start : stop + 1]):
                break
            stop, most = stop + 1, grown
        blocks.append((slice(start, stop), _round_up(most)))
        start = stop
    return blocks


def expert_strategy(x: Tensor, w1: Tensor) -> str:
    """'padded' (CPU), 'grouped' (`torch._grouped_mm`, GPU) or 'loop' (a matmul per expert)."""
    if x.device.type == "cpu" and x.dtype == w1.dtype and x.dtype.is_floating_point:
        return "padded"
    return "grouped" if grouped_mm_applies(x, w1) else "loop"


def _contiguous_grad(t: Tensor) -> Tensor:
    # grouped_mm's backward rejects gradients with zero strides (e.g. from `.sum()`).
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def expert_ffn(x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, strategy: str | None = None) -> Tensor:
    """SwiGLU per expert on rows sorted by expert: rows [sum(counts[:e]), sum(counts[:e+1])) use expert e.

    `strategy=None` picks with `expert_strategy`; every strategy computes the same function.
    """
    strategy = strategy or expert_strategy(x, w1)
    if strategy == "padded":
        return _PaddedSwiGLU.apply(x, w1, w2, w3, counts.tolist())
    if strategy == "grouped":
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(_contiguous_grad(torch._grouped_mm(x, w1, offs=offs))) * _contiguous_grad(
            torch._grouped_mm(x, w3, offs=offs)
        )
        return _contiguous_grad(torch._grouped_mm(h, w2, offs=offs))
    if strategy != "loop":
        raise ValueError(f"expert strategy must be padded, grouped or loop, got {strategy!r}")
    outs = []
    for e, rows in enumerate(torch.split(x, counts.tolist())):
        outs.append((F.silu(rows @ w1[e]) * (rows @ w3[e])) @ w2[e])
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


def _pad(out: Tensor, rows: Tensor, sizes: list[int]) -> Tensor:
    """Rows sorted by expert -> out [len(sizes), padded rows, d]: each expert's rows, then zeros."""
    start = 0
    for e, n in enumerate(sizes):
        out[e, :n] = rows[start : start + n]
        out[e, n:].zero_()
        start += n
    return out


def _unpad(out: Tensor, padded: Tensor, sizes: list[int]) -> None:
    """The inverse of `_pad`, into out [sum(sizes), d]."""
    start = 0
    for e, n in enumerate(sizes):
        out[start : start + n] = padded[e, :n]
        start += n


class _BufferPool:
    """CPU memory kept from call to call for the temporaries and saved activations of this module's
    own autograd Functions, which know when the last reader of each is done.

    Fresh memory is expensive on CPU: glibc gives large freed blocks back to the kernel, and each
    4 KiB page then faults again on its first write. Counted with getrusage, page faults were most
    of the difference between this layer and torchtitan's, and a bmm writing a fresh activation ran
    at half the speed of one writing reused memory. A buffer goes back (`give`) when its last reader
    is done: a temporary at the end of the call that made it, a saved activation at the end of the
    backward that read it. A buffer serves requests from half its size up to its size, so the pool
    holds about what one step had in use at once, kept between steps. On other devices the caching
    allocator already does this: `take` allocates and `give` ignores what it did not lend.
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[Tensor]] = {}
        self._lent: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> buffer

    def take(self, like: Tensor, *shape: int) -> Tensor:
        """An uninitialised tensor of `shape`, `like`'s dtype and device."""
        if like.device.type != "cpu":
            return like.new_empty(shape)
        n = math.prod(shape)
        free = self._free.setdefault((like.dtype, like.device), [])  # sorted by size
        # The smallest that fits leaves the larger ones to larger requests; a new one has a little
        # headroom: the next step's blocks are a few rows larger or smaller.
        i = bisect.bisect_left(free, n, key=Tensor.numel)
        flat = free.pop(i) if i < len(free) and free[i].numel() <= 2 * n else like.new_empty(n + n // 4)
        self._lent[id(flat)] = flat
        return flat[:n].view(shape)

    def give(self, *tensors: Tensor) -> None:
        """Take back tensors from `take` that nothing will read again (others, or twice: ignored)."""
        for t in tensors:
            flat = t._base
            if flat is not None and self._lent.get(id(flat)) is flat:
                del self._lent[id(flat)]
                bisect.insort(self._free[(flat.dtype, flat.device)], flat, key=Tensor.numel)


_POOL = _BufferPool()


def _last_backward() -> bool:
    """False inside a backward with retain_graph (or create_graph): its saved tensors are read again."""
    return not torch._C._autograd._get_current_graph_task_keep_graph()


class _PaddedSwiGLU(torch.autograd.Function):
    """SwiGLU of every expert as batched matmuls, block by block (`expert_blocks`); forward and
    backward by hand, so that temporaries and saved activations live in pooled memory
    (`_BufferPool`) and each elementwise pass writes where it is cheapest. Padding rows are zero
    in, zero out and add nothing to any gradient: this is exactly the per-expert function."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, sizes: list[int]) -> Tensor:
        (dim, hidden), take = w1.shape[1:], _POOL.take
        blocks, saved, start = expert_blocks(sizes), [], 0
        y = x.new_empty(x.shape[0], dim)
        for s, rows in blocks:
            n, shape = sum(sizes[s]), (s.stop - s.start, rows)
            xp = _pad(take(x, *shape, dim), x[start : start + n], sizes[s])
            a, b = torch.bmm(xp, w1[s], out=take(x, *shape, hidden)), torch.bmm(xp, w3[s], out=take(x, *shape, hidden))
            act = torch.ops.aten.silu.out(a, out=take(x, *shape, hidden))
            h = torch.mul(act, b, out=take(x, *shape, hidden))
            out = torch.bmm(h, w2[s], out=take(x, *shape, dim))
            _unpad(y[start : start + n], out, sizes[s])
            _POOL.give(out)
            saved += [xp, a, b, act, h]
            start += n
        ctx.save_for_backward(w1, w2, w3, *saved)
        ctx.sizes, ctx.blocks = sizes, blocks
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        w1, w2, w3, *saved = ctx.saved_tensors
        sizes, (dim, hidden), take = ctx.sizes, w1.shape[1:], _POOL.take
        gx, g1, g2, g3 = grad.new_empty(grad.shape[0], dim), *(torch.empty_like(w) for w in (w1, w2, w3))
        start, recycle = 0, _last_backward()
        for i, (s, rows) in enumerate(ctx.blocks):
            xp, a, b, act, h = saved[5 * i : 5 * i + 5]
            n, shape = sum(sizes[s]), (s.stop - s.start, rows)
            gy = _pad(take(grad, *shape, dim), grad[start : start + n], sizes[s])
            torch.bmm(h.transpose(1, 2), gy, out=g2[s])
            gh = torch.bmm(gy, w2[s].transpose(1, 2), out=take(grad, *shape, hidden))
            gb = torch.mul(act, gh, out=take(grad, *shape, hidden))
            # Into another buffer: in place (gh.mul_(b)), a bf16 product of two tensors runs at half speed.
            gh_b = torch.mul(gh, b, out=take(grad, *shape, hidden))
            ga = torch.ops.aten.silu_backward.grad_input(gh_b, a, grad_input=gh)
            torch.bmm(xp.transpose(1, 2), ga, out=g1[s])
            torch.bmm(xp.transpose(1, 2), gb, out=g3[s])
            gxp = torch.bmm(ga, w1[s].transpose(1, 2), out=gy)  # gy is read for the last time above
            _unpad(gx[start : start + n], gxp.baddbmm_(gb, w3[s].transpose(1, 2)), sizes[s])
            _POOL.give(gy, gh, gb, gh_b)
            if recycle:
                _POOL.give(xp, a, b, act, h)
            start += n
        return gx, g1, g2, g3, None


# -- token copies: to the experts and back -------------------------------------------------------
# Both directions are gathers: copies leave by `order // k` (copy p of the sorted order is a copy
# of row order[p] // k) and come back by `inverse` (inverse[t * k + j] is where token t's j-th copy
# sits), so a token's k copies are adjacent. No scatter-add (index_add, index_put) in forward or
# backward: ~4x cheaper on CPU, and deterministic on every device.


def _sum_copies(copies: Tensor, inverse: Tensor, k: int, weights: Tensor | None = None) -> Tensor:
    """copies [T*k, d] sorted by expert -> [T, d]: each token's copies (times `weights` [T, k]) summed."""
    unsorted = torch.index_select(copies, 0, inverse, out=_POOL.take(copies, inverse.numel(), copies.shape[-1]))
    by_token = unsorted.view(-1, k, copies.shape[-1])
    if weights is not None:
        by_token.mul_(weights.unsqueeze(-1))
    # Added copy by copy: `sum(1)` over a middle dimension of k is ~4x slower on CPU.
    summed = by_token[:, 0].clone() if k == 1 else torch.add(by_token[:, 0], by_token[:, 1])
    for j in range(2, k):
        summed.add_(by_token[:, j])
    _POOL.give(unsorted)
    return summed


class _CopyTokens(torch.autograd.Function):
    """rows [T, d] -> their k copies sorted by expert (`order`, the stable sort of the flat expert ids)."""

    @staticmethod
    def forward(ctx, rows: Tensor, order: Tensor, inverse: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return rows.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return _sum_copies(grad, inverse, ctx.k), None, None, None


class _CombineCopies(torch.autograd.Function):
    """Expert outputs of the copies (sorted by expert) -> each token's gate-weighted sum, [T, d]."""

    @staticmethod
    def forward(ctx, out: Tensor, weights: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(out, weights, order, inverse)
        return _sum_copies(out, inverse, weights.shape[1], weights)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out, weights, order, inverse = ctx.saved_tensors
        k = weights.shape[1]
        grad_out = grad.index_select(0, order // k)
        # d/d weight of a copy: its output . the token's gradient.
        products = torch.mul(grad_out, out, out=_POOL.take(out, *out.shape))
        grad_weights = products.sum(-1)
        _POOL.give(products)
        grad_out.mul_(weights.flatten()[order].unsqueeze(-1))
        return grad_out, grad_weights[inverse].view_as(weights), None, None


class GroupedExperts(nn.Module):
    """Routed experts as stacked weights: w1, w3 [E, dim, hidden], w2 [E, hidden, dim]."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.strategy: str | None = None  # None: `expert_strategy` picks per call
        self.grad_scale = 1.0  # set by supernode.trainer.parallel

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x: rows sorted by (local) expert; counts: rows per local expert."""
        # Under expert parallel the weights are DTensors sharded along E: compute on the local slice.
        # Experts outside FSDP (no replicas to shard over) miss its bf16 cast: match the input. Under
        # torch.autocast (`parallel.autocast_dtype`) cast both to its dtype, as torchtitan does:
        # autocast reaches neither `torch._grouped_mm` nor this module's own Function.
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        w1, w2, w3 = (
            _scale_grad(w.to_local() if isinstance(w, DTensor) else w, self.grad_scale).to(dtype)
            for w in (self.w1, self.w2, self.w3)
        )
        return expert_ffn(x.to(dtype), counts, w1, w2, w3, self.strategy)


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

    def __init__(
        self, dim: int, experts: int, top_k: int, hidden: int, shared_experts: int = 0, score: str = "softmax"
    ):
        super().__init__()
        self.experts_total, self.top_k = experts, top_k
        self.router = Router(dim, experts, top_k, score)
        self.experts = GroupedExperts(experts, dim, hidden)
        self.shared = SwiGLU(dim, hidden * shared_experts) if shared_experts else None
        self.dispatcher: TokenDispatcher = TokenDispatcher()  # supernode.trainer.parallel injects another
        self.grad_scale = 1.0  # set by supernode.trainer.parallel
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
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        routed = _CopyTokens.apply(rows, order, inverse, self.top_k)
        out, shared = d.compute(self.experts, routed, counts, lambda: self._shared(rows))
        combined = _CombineCopies.apply(out, weights.to(out.dtype), order, inverse)
        if shared is not None:
            combined = combined + shared
        return d.gather(combined)

    def _shared(self, rows: Tensor) -> Tensor | None:
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
        f = torch.zeros(g, e, device=ids.device).scatter_add_(
            1, group_ids, torch.ones_like(group_ids, dtype=torch.float)
        )
        f = f / f.sum(-1, keepdim=True).clamp(min=1)
        probs = (scores / scores.sum(-1, keepdim=True)).reshape(g, -1, e).mean(1)
        self.load_balance_loss = e * (f * probs).sum(-1).mean() * share
        self.z_loss = torch.logsumexp(logits, -1).square().mean() * share


class ExpertBalancer:
    """Aux-loss-free balancing, outside the model: at each optimizer step (a step pre-hook, see
    `attach`) the step's token counts of every MoE layer are summed over the ranks in one
    all-reduce, and each router's bias moves toward balance: up for under-loaded experts, down for
    over-loaded ones. The reduced counts stay on the device (`last_load`) for logging to read."""

    def __init__(self, layers: list[MoE], rate: float, group: ProcessGroup | None = None):
        """`group`: the ranks that route distinct tokens (default: every rank of the job)."""
        self.layers, self.rate = layers, rate
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.group = (group or dist.group.WORLD) if distributed else None
        self.last_load: Tensor | None = None

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
    def step(self, load: Tensor | None = None) -> Tensor:
        """One bias step from `load` [layers, experts] (default: `reduce()`); returns the load used."""
        load = self.reduce() if load is None else load
        if tuple(load.shape) != (len(self.layers), self.layers[0].experts_total if self.layers else 0):
            raise ValueError(
                f"load must have shape ({len(self.layers)}, "
                f"{self.layers[0].experts_total if self.layers else 0}), got {tuple(load.shape)}"
            )
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
