"""A Hugging Face model directory -> the sharded model at step 0 (`training.initFrom`): the export's inverse.

`load_pretrained(model, m, directory)` runs on every rank after the model is built sharded
(supernode.trainer.parallel.build_model: meta device, parallelised, `to_empty`, `init_weights`):
1. config.json must describe `m` (supernode.core.pretrained.check_compatible: a differing or
   inexpressible field is bad input naming it);
2. the manifest verifies (`check`): the ranks split the files (rank r hashes file i when i mod world = r) and
   agree on the first problem, so every rank raises the same BadInput naming the file;
3. each parameter's local shard is filled from the tensors it covers, read lazily with
   `safe_open(...).get_slice`: a rank reads only its rows/columns (and, for stacked experts, only its
   experts), never a whole model. The region a shard covers is the one `init_weights` fills
   (`compute_local_shape_and_global_offset`), so every layout the trainer runs loads.

The mapping inverts supernode.trainer.hf.export.hf_names: RoPE halves back to (even, odd) pairs per
head (whole heads are read around the shard's rows), per-expert `nn.Linear` weights [out, in] stacked
into [E, in, out], `e_score_correction_bias` into the router's selection bias (Qwen3: zero). Weights
are cast to the parameter's dtype (the fp32 master weights). Checkpoints that store the experts fused
(`mlp.experts.gate_up_proj` [E, 2 * hidden, dim] and `mlp.experts.down_proj` [E, dim, hidden], as
transformers 5 holds them in memory) load too.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from supernode.core.config.schema import Model
from supernode.core.errors import BadInput
from supernode.core.inference import GLM4_MOE
from supernode.core.pretrained import SINGLE_WEIGHTS, check_compatible, read_manifest, verify_files, weight_files

Region = tuple[slice, ...]


def check(directory: Path, m: Model, manifest_sha256: str | None = None, key: str = "model") -> str:
    """The architecture, once config.json fits `m` and the manifest (and its pin) verifies, its files
    hashed by the ranks in turn. Every rank raises the same BadInput when any rank found a problem
    (a directory one node lacks included: no rank is left waiting in a collective)."""
    dist_on = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist_on else (0, 1)
    arch = ""
    try:
        arch = check_compatible(directory, m, key)
        problem = verify_files(directory, read_manifest(directory, manifest_sha256), (rank, world))
        problem = f"training.initFrom: {problem}" if problem else None
    except BadInput as e:
        problem = str(e)
    problems: list[str | None] = [problem]
    if dist_on:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise BadInput(first)
    return arch


class _Reader:
    """Lazily opened safetensors files of the directory; slices of a tensor by HF name."""

    def __init__(self, directory: Path, stack: ExitStack):
        from safetensors import safe_open

        self.dir, self.stack, self.open = directory, stack, safe_open
        self.where = weight_files(directory)
        self.files: dict[str, object] = {}
        if not self.where:  # a single model.safetensors (transformers' save_pretrained of a small model)
            self.where = {k: SINGLE_WEIGHTS for k in self._file(SINGLE_WEIGHTS).keys()}

    def _file(self, name: str):
        if name not in self.files:
            from safetensors import SafetensorError

            try:
                self.files[name] = self.stack.enter_context(self.open(str(self.dir / name), "pt"))
            except (SafetensorError, OSError) as e:  # a header that lies about its tensors, or no file
                raise BadInput(f"training.initFrom {self.dir / name}: not a readable safetensors file ({e})") from None
        return self.files[name]

    def has(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> list[int]:
        return list(self._file(self.where[name]).get_slice(name).get_shape())

    def read(self, name: str, region: Region) -> Tensor:
        if name not in self.where:
            raise BadInput(f"training.initFrom {self.dir}: tensor {name} is missing (the index lists no file for it)")
        return self._file(self.where[name]).get_slice(name)[region]


def _region(p: Tensor) -> tuple[Tensor, Region]:
    """(this rank's local tensor, the global region it holds) of a parameter or buffer."""
    if isinstance(p, DTensor):
        local = p.to_local()
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        if tuple(shape) != tuple(local.shape):
            raise RuntimeError(f"local shard {tuple(local.shape)} is not the region {tuple(shape)} it describes")
        return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return p, tuple(slice(0, n) for n in p.shape)


def _rope_rows(reader: _Reader, name: str, region: Region, head_dim: int) -> Tensor:
    """Rows `region[0]` in our (even, odd) RoPE layout of a q/k weight (or per-head norm) stored in
    halves: the whole heads around them are read, re-interleaved, and cut."""
    rows = region[0]
    first, last = rows.start // head_dim, (rows.stop - 1) // head_dim
    hf = reader.read(name, (slice(first * head_dim, (last + 1) * head_dim), *region[1:]))
    heads = hf.reshape(-1, 2, head_dim // 2, *hf.shape[1:])  # [heads, half, pair index, ...]
    ours = heads.transpose(1, 2).reshape(hf.shape)  # (x_i, y_i) pairs: even = first half, odd = second
    lo = rows.start - first * head_dim
    return ours[lo : lo + rows.stop - rows.start]


def _experts(reader: _Reader, layer: str, which: str, region: Region) -> Tensor:
    """Our stacked [E, in, out] slice from per-expert [out, in] weights (or the fused [E, ...] ones)."""
    experts, inner, outer = region
    proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[which]
    per_expert = f"{layer}mlp.experts.{experts.start}.{proj}.weight"
    if reader.has(per_expert):
        return torch.stack(
            [
                reader.read(f"{layer}mlp.experts.{e}.{proj}.weight", (outer, inner)).t()
                for e in range(experts.start, experts.stop)
            ]
        )
    if which == "w2" and reader.has(f"{layer}mlp.experts.down_proj"):  # fused: [E, dim, hidden]
        return reader.read(f"{layer}mlp.experts.down_proj", (experts, outer, inner)).transpose(1, 2)
    fused = f"{layer}mlp.experts.gate_up_proj"  # [E, 2 * hidden, dim]: gate rows, then up rows
    if reader.has(fused):
        hidden = reader.shape(fused)[1] // 2
        rows = outer if which == "w1" else slice(outer.start + hidden, outer.stop + hidden)
        return reader.read(fused, (experts, rows, inner)).transpose(1, 2)
    raise BadInput(f"training.initFrom {reader.dir}: no tensor {per_expert} (nor fused experts) for layer {layer}")


def _source(key: str, m: Model, arch: str) -> Callable[[_Reader, Region], Tensor]:
    """How to read our parameter or buffer `key`'s region from the directory."""
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if key in top:
        return lambda r, reg: r.read(top[key], reg)
    parts = key.split(".")
    layer, rest = f"model.layers.{parts[1]}.", ".".join(parts[2:])
    plain = {
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "ffn.w1.weight": "mlp.gate_proj.weight",
        "ffn.w3.weight": "mlp.up_proj.weight",
        "ffn.w2.weight": "mlp.down_proj.weight",
        "ffn.router.gate.weight": "mlp.gate.weight",
        "ffn.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
        "ffn.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
    }
    rope = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }
    if rest in plain:
        return lambda r, reg: r.read(layer + plain[rest], reg)
    if rest in rope:
        return lambda r, reg: _rope_rows(r, layer + rope[rest], reg, m.head_dim)
    if rest == "ffn.router.bias":
        if arch == GLM4_MOE:
            return lambda r, reg: r.read(layer + "mlp.gate.e_score_correction_bias", reg)
        return lambda r, reg: torch.zeros(reg[0].stop - reg[0].start)  # Qwen3 has no selection bias
    if rest in ("ffn.experts.w1", "ffn.experts.w3", "ffn.experts.w2"):
        return lambda r, reg: _experts(r, layer, parts[-1], reg)
    raise BadInput(f"model tensor {key!r} has no counterpart in {arch}")


@torch.no_grad()
def load_pretrained(
    model: nn.Module, m: Model, directory: Path, manifest_sha256: str | None = None, key: str = "model"
) -> int:
    """Fill `model`'s local shards (parameters and the routers' selection biases) from the verified
    Hugging Face directory; -> the number of elements this rank read. `key`: the stack section `m`
    came from (model, or local.model), for the messages."""
    directory = Path(directory)
    arch = check(directory, m, manifest_sha256, key)
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n.endswith("router.bias"))]
    read = 0
    with ExitStack() as stack:
        reader = _Reader(directory, stack)
        for name, p in tensors:
            local, region = _region(p)
            if local.numel() == 0:
                continue
            value = _source(name, m, arch)(reader, region)
            if tuple(value.shape) != tuple(local.shape):
                raise BadInput(
                    f"training.initFrom {directory}: {name} reads as {list(value.shape)} where this rank holds "
                    f"{list(local.shape)}; config.json does not describe the tensors beside it"
                )
            local.copy_(value.to(local.dtype))
            read += value.numel()
    return read
