"""Pipeline parallel: the model split into stages by layer, run by a `torch.distributed.pipelining` schedule.

Learned from torchtitan, written our own. Stage s of S = pp x ppVirtualStages holds the layers the
Plan gives it (`Plan.pipeline.stage_layers`, from `supernode.core.layout.stage_layers`): the
embedding on the first stage, the final norm and the head on the last. Rank r of the pp mesh runs
stages r, r + pp, ... (the "loop" placement interleaved 1F1B expects). Each stage is parallelised
on the other mesh dims (TP -> EP -> AC -> FSDP2, `supernode.trainer.parallel.parallelize`), then
materialised and initialised in place: equal to the single-process model, parameter by parameter.

Names are the whole model's: a stage keeps each layer under its global index (`layers.5...`), so
the parameter names, the optimizer state and the checkpoint keys do not depend on the layout, and
a run saved at one (pp, dp) resumes at another, pp 1 included (`StageParts`).

The loss is the last stage's; every stage's auxiliary (load-balance, z) loss rides on its output
(`_AuxLoss`), so one backward through the schedule gives each MoE layer the gradient the
single-process step would. The schedule divides the gradients by the micro-batches, as the
accumulating loop of pp 1 does.

With document masking each micro-batch's document indices go to every stage as a keyword
argument of the schedule (split into micro-batches like the inputs; only activations travel
between stages), and each stage builds its attention mask and RoPE positions from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from supernode.core.config import Model, Parallel
from supernode.core.layout import stage_layers

from .model import Transformer, document_attention, inputs_and_targets
from .moe import MoE
from .parallel import Meshes, compute_dtype, parallelize

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}


class _AuxLoss(torch.autograd.Function):
    """The identity on a stage's output that gives the stage's auxiliary loss the gradient 1 in
    backward (Megatron's MoEAuxLossAutoScaler): the aux loss then joins the backward the schedule
    runs from the last stage's loss, on whichever rank its MoE layers live."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor) -> Tensor:
        ctx.aux_dtype, ctx.aux_device = aux.dtype, aux.device
        # A copy, not a view: FSDP warns about (and cannot hook in-place changes to) a view as a stage's output.
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=ctx.aux_device)


class Stage(nn.Module):
    """Layers `layers` of the model (taken from `model`, which may be on the meta device), the
    embedding if `first`, the norm and head if `last`. Parameter names equal the whole model's."""

    # The same name-keyed init and aux loss as the whole model: a stage is initialised equal to it.
    init_weights = Transformer.init_weights
    aux_loss = Transformer.aux_loss

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.first, self.last = first, last
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        """Tokens [b, s] on the first stage, else the previous stage's activations [b, s, dim];
        `documents` as `Transformer.forward`'s."""
        if self.embed is not None:
            x = self.embed(x)
        cos, sin, mask = document_attention(self.rope_cos, self.rope_sin, documents)
        for block in self.layers.values():
            x = block(x, cos, sin, mask)
        aux = self.aux_loss()  # of this forward's MoE layers
        if aux.requires_grad and torch.is_grad_enabled():
            x = _AuxLoss.apply(x, aux)
        if self.output is not None:
            x = self.output(self.norm(x)).float()
        return x

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers.values() if isinstance(b.ffn, MoE)]


class StageParts(nn.Module):
    """This rank's stages seen as one module with the whole model's names (the same submodules,
    registered again): what the optimizer, the gradient clipping and the checkpointer work on."""

    def __init__(self, stages: list[Stage]):
        super().__init__()
        self.cfg = stages[0].cfg
        self.embed = next((s.embed for s in stages if s.embed is not None), None)
        self.layers = nn.ModuleDict({k: b for s in stages for k, b in s.layers.items()})
        self.norm = next((s.norm for s in stages if s.norm is not None), None)
        self.output = next((s.output for s in stages if s.output is not None), None)
        self.stages = list(stages)  # a plain list: not registered a second time

    def forward(self, *args):
        raise RuntimeError("a pipelined model runs through its schedule (Pipeline.step)")

    def moe_layers(self) -> list[MoE]:
        return [m for s in self.stages for m in s.moe_layers()]

    def moe_layer_ids(self) -> list[int]:
        """The model-wide MoE index of each of `moe_layers()` (for the expert-load table)."""
        cfg = self.cfg
        moe_index = {layer: i for i, layer in enumerate(n for n in range(cfg.layers) if cfg.is_moe(n))}
        return [moe_index[int(k)] for s in self.stages for k, b in s.layers.items() if isinstance(b.ffn, MoE)]


def rank_stages(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages pp rank `pp_rank` runs: r, r + pp, ... (loop placement)."""
    return [pp_rank + v * pp for v in range(virtual)]


@dataclass
class Pipeline:
    """This rank's stages, their module view and the schedule that runs one optimizer step."""

    parts: StageParts
    schedule: object
    has_first: bool
    has_last: bool
    micro_batches: int

    def step(self, tokens: Tensor, eos: int | None = None, counted: Tensor | float | None = None) -> list[Tensor]:
        """Forward and backward of one step's tokens [micro_batches x micro_batch, seq + 1]; returns
        the last stage's loss per micro-batch (empty elsewhere). Gradients are left on the stages.
        `eos`: attend within documents (`inputs_and_targets`); `counted`: the loss's divisor (`loss_fn`)."""
        losses: list[Tensor] = []
        inputs, targets, documents = inputs_and_targets(tokens, eos)
        args = (inputs,) if self.has_first else ()
        kwargs = {} if documents is None else {"documents": documents}
        self.schedule.step(
            *args,
            target=targets if self.has_last else None,
            losses=losses,
            loss_kwargs=None if counted is None else {"counted": counted},
            **kwargs,
        )
        return losses


def build_pipeline(
    cfg: Model,
    parallel: Parallel,
    device: torch.device,
    seed: int,
    micro_batch: int,
    micro_batches: int,
    loss_fn: Callable[..., Tensor],
    mesh: Meshes | None = None,
    sizes: list[int] | None = None,
) -> Pipeline:
    """This rank's stages, each built like `supernode.trainer.parallel.build_model` (meta device, parallelise,
    `to_empty`, init in place), and the plan's schedule over `micro_batches` micro-batches of
    `micro_batch` sequences. `sizes`: layers per stage (the Plan's `pipeline.stage_layers`; default
    the core's split of the same config)."""
    mesh = mesh or Meshes.build(parallel, device.type)
    virtual = parallel.pp_virtual_stages
    total = parallel.stages
    sizes = sizes or stage_layers(
        cfg.layers, total, parallel.pp_first_stage_fewer_layers, parallel.pp_last_stage_fewer_layers
    )
    if len(sizes) != total or sum(sizes) != cfg.layers or min(sizes) < 1:
        raise ValueError(f"stage layers {sizes} do not split {cfg.layers} layers over {total} stages")
    starts = [sum(sizes[:s]) for s in range(total + 1)]
    pp_mesh = mesh.pp
    pp_rank = pp_mesh.get_local_rank() if pp_mesh is not None else 0
    with torch.device("meta"):
        whole = Transformer(cfg)
    dtype = compute_dtype(mesh, parallel, device.type)
    seq = cfg.seq_len
    stages, pipe_stages = [], []
    for s in rank_stages(pp_rank, parallel.pp, virtual):
        stage = Stage(whole, range(starts[s], starts[s + 1]), first=s == 0, last=s == total - 1)
        parallelize(stage, parallel, mesh, device.type)
        stage.to_empty(device=device)
        stage.init_weights(seed)
        stages.append(stage)
        # Shapes given up front: the schedule then skips its metadata-inference forward and backward,
        # which would also count routed tokens and move no weights.
        # Activations carry gradients back (requires_grad: the schedule sizes the gradient buffers by it).
        with torch.device("meta"):
            inputs = (
                torch.empty(micro_batch, seq, dtype=torch.long)
                if s == 0
                else torch.empty(micro_batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
            )
            outputs = (
                torch.empty(micro_batch, seq, cfg.vocab, dtype=torch.float32, requires_grad=True)
                if s == total - 1
                else torch.empty(micro_batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
            )
        pipe_stages.append(
            PipelineStage(
                stage,
                s,
                total,
                device,
                input_args=inputs,
                output_args=outputs,
                group=pp_mesh.get_group() if pp_mesh is not None else None,
            )
        )
    kind = SCHEDULES[parallel.pp_schedule]
    if kind is ScheduleInterleaved1F1B:
        schedule = kind(pipe_stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=True)
    else:
        schedule = kind(pipe_stages[0], n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=True)
    return Pipeline(
        parts=StageParts(stages),
        schedule=schedule,
        has_first=any(s.first for s in stages),
        has_last=any(s.last for s in stages),
        micro_batches=micro_batches,
    )
