"""Decoder-only MoE transformer, written for one device (supernode.trainer.parallel distributes it).

RMSNorm, rotary position embeddings, grouped-query attention through `scaled_dot_product_attention`,
SwiGLU dense FFN layers and MoE FFN layers placed by `Model.is_moe(layer)`.

Documents (`training.documentMasking`): a window of the token stream holds the end of one document,
whole ones, the start of another, each ended by its EOS. Given the document index of each token
(`inputs_and_targets`), a token attends only to the earlier tokens of its own document and RoPE
positions restart at 0 with each document: a packed window computes what each of its documents
would alone. Without it the window is one causal sequence (what serving sees: one document).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.checkpoint import checkpoint

from supernode.core.config import Model
from supernode.core.inference import RMS_NORM_EPS

from .moe import MoE, SwiGLU


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = RMS_NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [b, s, heads, head_dim]; rotates the (even, odd) pairs of each head. cos/sin: the tables
    (position p at row p: positions 0..s-1 are taken), or per token [b, s, head_dim / 2]."""
    if cos.dim() == 2:
        cos, sin = cos[: x.shape[1]], sin[: x.shape[1]]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: Model):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(cfg.dim, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, cfg.dim, bias=False)
        # Per-head RMSNorm of q and k before RoPE (Qwen3's attention, so a softmax-router model
        # exports exactly as Qwen3MoeForCausalLM; see supernode.core.inference).
        self.q_norm = RMSNorm(hd) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd) if cfg.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        """mask: None for causal attention over the whole sequence, else [b, 1, s, s] (True: may attend)."""
        b, s, _ = x.shape
        # Head counts come from the (possibly tensor-parallel, i.e. local) projection widths.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: Model, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.moe = cfg.is_moe(layer)
        self.ffn: nn.Module = (
            MoE(cfg.dim, cfg.experts, cfg.top_k, cfg.expert_hidden, cfg.shared_experts, cfg.router)
            if self.moe
            else SwiGLU(cfg.dim, cfg.dense_hidden)
        )
        # Activation checkpointing (set by supernode.trainer.parallel): "selective" recomputes the FFN/MoE
        # in backward, "full" the whole block.
        self.checkpoint = "none"

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.checkpoint == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, mask, use_reentrant=False)
        return self._forward(x, cos, sin, mask)

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        h = self.ffn_norm(x)
        if self.moe:  # the MoE layer works on rows of tokens
            return x + self._ffn(h.flatten(0, -2)).view_as(h)
        return x + self._ffn(h)

    def _ffn(self, x: Tensor) -> Tensor:
        if self.checkpoint == "selective" and torch.is_grad_enabled():
            return checkpoint(self.ffn, x, use_reentrant=False)
        return self.ffn(x)


class Transformer(nn.Module):
    """Weights are left uninitialised (the model may be built on the meta device): call
    `init_weights(seed)` before use; `supernode.trainer.parallel.build_model` builds it sharded from the start."""

    def __init__(self, cfg: Model):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.embed.weight
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # `to_empty` (and `to`) replace each module's parameters one by one, which unties shared
        # ones: the output projection would get a tensor of its own. Tie them again.
        super()._apply(fn, recurse)
        if self.cfg.tie_embeddings and self.output.weight is not self.embed.weight:
            self.output.weight = self.embed.weight
        return self

    def forward(self, tokens: Tensor, documents: Tensor | None = None) -> Tensor:
        """Logits [b, s, vocab] of tokens [b, s]; `documents` [b, s]: each token's document index in
        its window (see `inputs_and_targets`), None for one causal sequence."""
        if tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.seqLen {self.cfg.seq_len}")
        x = self.embed(tokens)
        cos, sin, mask = document_attention(self.rope_cos, self.rope_sin, documents)
        for block in self.layers:
            x = block(x, cos, sin, mask)
        return self.output(self.norm(x)).float()

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers if isinstance(b.ffn, MoE)]

    def aux_loss(self) -> Tensor:
        """Weighted load-balance and z-loss of the last forward, summed over MoE layers."""
        total = torch.zeros((), device=self.rope_cos.device)
        for moe in self.moe_layers():
            if self.cfg.load_balance_coef:
                total = total + self.cfg.load_balance_coef * moe.load_balance_loss
            if self.cfg.z_loss_coef:
                total = total + self.cfg.z_loss_coef * moe.z_loss
        return total

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic for a seed, whatever the device and the layout: each rank draws only the
        values of the shards it holds (see `init_normal_`), so a model built on the meta device,
        parallelised and materialised with `to_empty` is initialised without ever being whole.

        Also (re)computes the RoPE tables and zeroes the routers' state (the meta device leaves
        buffers empty).
        """
        cos, sin = rope_tables(self.cfg.seq_len, self.cfg.head_dim, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.layers)  # residual-path outputs, as in GPT-2
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            init_normal_(p, out_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else std, seed, name)
        for moe in self.moe_layers():
            moe.router.bias.zero_()
            moe.tokens_per_expert.zero_()


# A parameter is drawn in blocks of whole rows (dim 0) of about this many elements, each block from
# a generator seeded by (seed, parameter name, block): a shard is filled from the blocks it overlaps.
INIT_BLOCK_ELEMENTS = 1 << 20


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def init_normal_(p: Tensor, std: float, seed: int, name: str) -> None:
    """Fill `p` (a plain tensor, or this rank's shards of a DTensor) with N(0, std) values that
    depend only on (seed, name) and the global position: equal on every layout. A rank draws the
    row blocks its shard overlaps, one at a time (a row-wise tensor-parallel shard, split along
    dim 1, draws whole rows: at most tp times its size, one block at a time)."""
    if isinstance(p, DTensor):
        local = p.to_local()
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        if tuple(shape) != tuple(local.shape):
            raise RuntimeError(
                f"{name}: local shard {tuple(local.shape)} is not the region {tuple(shape)} its placements describe"
            )
    else:
        local, offset = p, (0,) * p.dim()
    if local.numel() == 0:
        return
    full = tuple(p.shape)
    row = math.prod(full[1:])
    per_block = max(1, INIT_BLOCK_ELEMENTS // max(1, row))
    start, stop = offset[0], offset[0] + local.shape[0]
    cols = (slice(None),) + tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))
    for block in range(start // per_block, (stop - 1) // per_block + 1):
        lo = block * per_block
        rows = torch.randn(
            (min(per_block, full[0] - lo), *full[1:]),
            generator=torch.Generator().manual_seed(_block_seed(seed, name, block)),
        )
        a, b = max(start, lo), min(stop, lo + rows.shape[0])
        local[a - start : b - start].copy_((rows[a - lo : b - lo][cols] * std).to(local.dtype))


IGNORE = -100  # a target the loss does not count (cross_entropy's ignore_index)


def inputs_and_targets(windows: Tensor, eos: int | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Inputs, next-token targets and, given the EOS id (`training.documentMasking`), the document
    index of each input token, of windows [b, seq + 1]. A document ends with its EOS (the model
    learns to predict it), so the token after an EOS starts the next document: the target at an
    EOS, the next document's first token, would be predicted across the boundary and is IGNORE."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    if eos is None:
        return inputs, targets, None
    ends = (inputs == eos).long()
    return inputs, targets.masked_fill(ends.bool(), IGNORE), ends.cumsum(-1) - ends


def document_attention(cos: Tensor, sin: Tensor, documents: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(cos, sin, mask) for the blocks. Without documents: the RoPE tables and no mask (SDPA's
    causal kernel). With documents [b, s]: each token's RoPE row at its position in its document,
    and the mask [b, 1, s, s] of the earlier tokens of the same document.

    A dense boolean mask through SDPA, not FlexAttention's block mask (what torchtitan uses):
    FlexAttention has no backward on CPU (torch 2.13), where every test runs. The cost shows at
    prod scale: the mask is s^2 bytes per sequence (16 MiB at prod's seqLen 4096, 1 GiB at 32k),
    and SDPA given a mask cannot use FlashAttention on GPU: the memory-efficient kernel computes
    every block, the upper triangle and other documents' included, twice the causal kernel's
    attention FLOPs, +7% of the prod model's step FLOPs. A block mask would skip those blocks;
    it is the way to long sequences."""
    if documents is None:
        return cos, sin, None
    s = documents.shape[1]
    idx = torch.arange(s, device=documents.device)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    positions = idx - torch.where(starts, idx, 0).cummax(-1).values
    mask = (documents[:, :, None] == documents[:, None, :]) & (idx[:, None] >= idx[None, :])
    return cos[positions], sin[positions], mask[:, None]


def loss_fn(logits: Tensor, targets: Tensor, counted: Tensor | float | None = None) -> Tensor:
    """Next-token cross-entropy summed over the counted targets (not IGNORE) and divided by
    `counted`; default: the counted targets here, i.e. their mean. logits [b, s, vocab], targets [b, s].
    The trainer passes the step's counted targets per micro-batch (`trainer.counted_per_micro_batch`):
    every counted token of the step then weighs the same, wherever documents end."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return total / (counted if counted is not None else (targets != IGNORE).sum().clamp(min=1))
