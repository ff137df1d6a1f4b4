"""The Trainer: build, train step, checkpoint (shaped after torchtitan's).

`Trainer(plan, ...)` builds the model sharded from the first byte (`supernode.trainer.parallel.build_model`),
the optimizer, the LR schedule, the expert balancer (a step pre-hook of the optimizer), the data
loader and the checkpointer, with the training state registered with the checkpointer once.
`train_step` runs one optimizer step over the plan's micro-batches; the step's figures stay on the
device until the one vote all ranks take on the loss, the gradient norm and the stop requests.
With pp > 1 the model is this rank's pipeline stages (`supernode.trainer.pipeline`): the schedule runs the
micro-batches, the loss lives on the last stage, the gradient norm is summed across stages, and
the vote spans every stage, so all ranks skip or apply the same update.
The run's policy (logging, the non-finite streak, when to save, signals) is `supernode.trainer.train`'s.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from supernode.core.config import Training, stack_key
from supernode.core.errors import BadInput
from supernode.core.plan import Plan

from .checkpoint import Checkpointer, CheckpointMismatch, train_state
from .data.loader import TokenLoader
from .data.manifest import DataError
from .log import LOG
from .model import inputs_and_targets, loss_fn
from .moe import ExpertBalancer
from .parallel import Meshes, autocast_dtype, build_model
from .pipeline import build_pipeline

BETAS = (0.9, 0.95)
# Recorded in each checkpoint and compared on resume: these change the learning-rate curve or update.
HYPER_PARAMETERS = (
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "schedule",
    "steps",
    "weight_decay",
    "grad_clip",
    "document_masking",
)


def lr_factor(t: Training) -> Callable[[int], float]:
    """Multiplier of `t.lr` after `step` optimizer steps: linear warmup, then the plan's decay."""
    floor = t.min_lr_ratio

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
        return floor + (1 - floor) * decay

    return factor


def clip_grad_norm(
    params: Iterable[torch.nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Global gradient norm over every shard (a device tensor: no host sync), then clip. Parameters
    live on different meshes (dense, experts, router), and DTensor norms only combine within one
    mesh and placement, so the norm is taken per group and the groups' squares are summed; with
    pipeline stages (`pp_group`), also over the stages."""
    groups: dict = defaultdict(list)
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups[key].append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).double())
    if not norms and pp_group is None:
        return torch.zeros((), dtype=torch.float64)
    square = torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64)
    if pp_group is not None:
        dist.all_reduce(square, group=pp_group)
    total = square.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grads in groups.values():
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef.to(grads[0].dtype))
    return total


def counted_per_micro_batch(
    micro: list[torch.Tensor], eos: int | None, device: torch.device, real: int | None = None, real_share: float = 1.0
) -> torch.Tensor | float:
    """The divisor of each micro-batch's summed cross-entropy (`loss_fn`'s `counted`): the step's counted
    targets over every rank and real micro-batch, per micro-batch slot of one rank. A micro-batch's
    loss is then its share of the step's mean, and the data-parallel mean of the micro-batches'
    gradients is the gradient of the global sum over the global count: every counted token weighs
    the same, not a mean of means that would weigh a token of a micro-batch or rank with more
    document ends more.

    At an elastic layout with padding (`Plan.padded_micro_batches`) only the first `real` of this
    rank's micro-batches are data and `real_share` is the real slots' share of all of them
    (global micro-batches / (dp x rounds)): the count is of the real ones, still spread over every
    slot, so the gradient is the global batch's mean exactly as at the planned layout.

    Without `eos` every target counts: micro_batch x seq_len per real micro-batch, a plain mean, no
    collective. With it, one all-reduce of a scalar over all ranks, left on the device (no host
    sync): tensor- and pipeline-parallel ranks hold copies of their data-parallel rank's windows,
    so the mean over all ranks is the mean over the data-parallel ranks."""
    if eos is None:
        return float(micro[0].shape[0] * (micro[0].shape[1] - 1)) * real_share
    # A rank may hold no real micro-batch (dp above the global batch's micro-batches): it counts 0.
    counted = sum(((mb[:, :-1] != eos).sum() for mb in micro[:real]), torch.zeros((), dtype=torch.long)).to(device)
    dist.all_reduce(counted)
    return counted.clamp(min=1).float() / (dist.get_world_size() * len(micro))


def adamw(model: torch.nn.Module, t: Training, device: torch.device) -> torch.optim.AdamW:
    """The trainer's optimizer (the benchmarks build the same). On CUDA the fused kernels: measured on
    one H200 (dev model, 0.9 B parameters), foreach AdamW was 24% of the step's GPU time and the fused
    step 0.168 s against 0.185-0.255 s; the state and its checkpoint are the same either way."""
    return torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=BETAS, weight_decay=t.weight_decay, fused=device.type == "cuda"
    )


def apply_hyper_parameters(
    t: Training, saved: dict, step: int, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR
) -> str | None:
    """A resume with changed hyper-parameters applies the plan's values (the checkpoint's optimizer
    and scheduler state would silently keep the old lr); returns the line that says so."""
    ours = {k: getattr(t, k) for k in HYPER_PARAMETERS}
    if not isinstance(saved, dict):
        return None
    changed = {k: (saved[k], v) for k, v in ours.items() if k in saved and saved[k] != v}
    if not changed:
        return None
    factor = lr_factor(t)(scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"], group["lr"], group["weight_decay"] = t.lr, t.lr * factor, t.weight_decay
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    diff = ", ".join(f"training.{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
    return f"checkpoint of step {step} was trained with other settings: {diff}; the plan's values apply from step {step + 1}"  # noqa: E501


@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the global batch's counted targets
    grad_norm: float
    skipped: bool  # non-finite loss or gradient norm on some rank: no update
    stop_term: bool  # some rank got SIGTERM / SIGINT
    stop_interrupt: bool


class Trainer:
    def __init__(
        self,
        plan: Plan,
        device: torch.device,
        data: Path,
        out: Path,
        async_checkpoint: bool,
    ):
        t, layout = plan.training, plan.parallel
        # An elastic layout whose dp does not divide the global batch runs zero-weight micro-batches
        # (`Plan.padded_micro_batches`; never with pp > 1, which the plan refuses): their share of the
        # step's slots is what the real ones make up for.
        slots = plan.micro_batches_per_step * layout.dp
        self.real_share = (slots - plan.padded_micro_batches) / slots
        self.plan, self.device = plan, device
        rank = dist.get_rank()
        torch.manual_seed(t.seed + rank)
        mesh = Meshes.build(layout, device.type)
        self.autocast = autocast_dtype(layout, mesh, device.type)
        if self.autocast is not None:
            LOG.info(
                f"parallel.mixedPrecision bf16 by torch.autocast: this layout has no data parallelism "
                f"(dpReplicate x dpShard = 1 over {layout.world_size} ranks) for FSDP's mixed precision"
            )
        self.pipeline, self.pp_group, self._poison = None, None, False
        if layout.pp > 1:
            self.pipeline = build_pipeline(
                plan.model,
                layout,
                device,
                t.seed,
                t.micro_batch,
                plan.micro_batches_per_step,
                self._stage_loss,
                mesh=mesh,
                sizes=plan.pipeline.stage_layers,
            )
            self.model = self.pipeline.parts  # the stages under the whole model's names
            self.pp_group = mesh.pp.get_group()
        else:
            self.model = build_model(plan.model, layout, device, t.seed, mesh)
        self.optimizer = adamw(self.model, t, device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(t))
        # The counts of a stage's layers are summed over the ranks of that stage.
        self.balancer = ExpertBalancer(self.model.moe_layers(), plan.model.bias_update_rate, group=mesh.stage_group)
        self.balancer.attach(self.optimizer)  # the router biases move with every applied update
        try:
            self.loader = TokenLoader(
                data,
                plan.model.seq_len,
                t.global_batch,
                t.micro_batch,
                layout.dp_rank(rank),
                layout.dp,
                t.seed,
                vocab=plan.model.vocab,
                blend=t.data,
                documents=t.document_masking,
                vocab_key=stack_key("model.vocab", plan.local),
                padded_micro_batches=plan.padded_micro_batches,
            )
        except DataError as e:
            raise BadInput(str(e)) from None
        meta = {"model": plan.model.model_dump(mode="json"), "training": {k: getattr(t, k) for k in HYPER_PARAMETERS}}
        self.checkpointer = Checkpointer(
            out / "checkpoints",
            keep=t.keep_checkpoints,
            async_save=async_checkpoint,
            state=train_state(self.model, self.optimizer, self.scheduler, self.loader),
            meta=meta,
            interval=t.checkpoint_interval,
            weights_finite=self.finite_params,
        )

    def restore(self) -> tuple[int, str | None]:
        """(the step resumed from, 0 for none; the line saying which settings changed, if any)."""
        try:
            start = self.checkpointer.restore()
        except CheckpointMismatch as e:
            raise BadInput(str(e)) from None
        saved = self.checkpointer.restored_meta.get("training")
        return start, (
            apply_hyper_parameters(self.plan.training, saved, start, self.optimizer, self.scheduler) if start else None
        )

    def _autocast(self):
        """bf16 autocast where FSDP's mixed precision does not apply (`autocast_dtype`), else nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def train_step(
        self, micro: list[torch.Tensor], stop_term: bool, stop_interrupt: bool, poison: bool = False
    ) -> StepResult:
        """Forward/backward over the micro-batches, clip, one all-reduce of (loss, votes), then the
        update (the balancer's pre-hook reduces the expert counts once) or, if any rank saw a
        non-finite figure, no update. `poison`: a test hook, the loss becomes NaN."""
        model, accum, device, eos = self.model, len(micro), self.device, self.loader.eos
        real = self.loader.real_micro_batches  # the rest are padding: run, weighed zero
        loss_sum = torch.zeros((), device=device)
        self._poison = poison
        counted = counted_per_micro_batch(micro, eos, device, real, self.real_share)
        if self.pipeline is not None:  # the schedule runs the micro-batches; the losses are the last stage's
            with self._autocast():  # the schedule interleaves forwards and backwards: both under it
                losses = self.pipeline.step(torch.cat(micro).to(device, non_blocking=True), eos, counted)
            for loss in losses:
                loss_sum += loss.detach()
        else:
            # Each micro-batch's gradients are reduce-scattered as its backward ends (FSDP2's default),
            # so a rank only ever holds its gradient shard. Skipping the reduce-scatter until the last
            # micro-batch would save that traffic but keep every parameter's unsharded fp32 gradient
            # across the accumulation: +40 GiB per rank at prod (10.8 B unsharded parameters x 4 B),
            # which the plan's memory (sharded gradients) does not have room for.
            routed = None  # the routed-token counts before the padding, which must not move the router biases
            for i, mb in enumerate(micro):
                if i == real:
                    routed = [m.tokens_per_expert.clone() for m in model.moe_layers()]
                inputs, targets, documents = inputs_and_targets(mb.to(device, non_blocking=True), eos)
                with self._autocast():  # the forward only: backward ops take the dtypes their forward had
                    loss = self._stage_loss(model(inputs, documents), targets, counted)
                # The auxiliary losses are a mean over the real micro-batches (1/accum each without
                # padding). Padding still runs its backward, zero-weighted rather than skipped, so
                # every rank joins the same reduce-scatters.
                weight = 1.0 if i < real else 0.0
                ((loss + model.aux_loss() / self.real_share) / accum * weight).backward()
                if weight:
                    loss_sum += loss.detach()
            for m, kept in zip(model.moe_layers(), routed or ()):
                m.tokens_per_expert.copy_(kept)
        grad_norm = clip_grad_norm(model.parameters(), self.plan.training.grad_clip, self.pp_group).to(device)
        # One collective for the global loss, the stop votes and the non-finite vote, before the
        # update: every rank skips or applies it, and stops at the same step. Its .tolist() is the
        # step's one host synchronisation.
        bad = ~(torch.isfinite(grad_norm) & torch.isfinite(loss_sum))
        sync = torch.stack(
            [
                loss_sum / accum,
                torch.tensor(float(stop_term), device=device),
                torch.tensor(float(stop_interrupt), device=device),
                bad.float(),
            ]
        )
        dist.all_reduce(sync)
        loss_total, term, interrupt, bad_ranks, norm = torch.cat([sync, grad_norm.reshape(1)]).tolist()
        self.checkpointer.wait_for_staging()  # an async save copies the weights while this step computed
        skipped = bad_ranks > 0
        if skipped:  # a non-finite update would poison the weights and every later checkpoint
            self.optimizer.zero_grad(set_to_none=True)
            self.balancer.reset()  # the counts of a step that is not applied
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # the schedule follows the step count either way
        # Every rank of the last stage holds its data-parallel slice's loss (tensor-parallel ranks alike).
        return StepResult(
            loss=loss_total / (dist.get_world_size() // self.plan.parallel.pp),
            grad_norm=norm,
            skipped=skipped,
            stop_term=term > 0,
            stop_interrupt=interrupt > 0,
        )

    def _stage_loss(self, logits: torch.Tensor, targets: torch.Tensor, counted=None) -> torch.Tensor:
        loss = loss_fn(logits, targets, counted)
        return loss * float("nan") if self._poison else loss

    def expert_load(self) -> torch.Tensor | None:
        """The last applied step's global token counts per MoE layer and expert, on the host (log steps
        only; with pp > 1 a collective: every stage adds its layers' rows to the whole table)."""
        load = self.balancer.last_load
        if self.pipeline is None or load is None:
            return None if load is None else load.cpu()
        cfg = self.plan.model
        table = torch.zeros(cfg.moe_layers, cfg.experts, dtype=torch.long, device=self.device)
        ids = self.model.moe_layer_ids()
        if ids:
            table[ids] = load.to(self.device, torch.long)
        dist.all_reduce(table, group=self.pp_group)
        return table.cpu()

    def finite_params(self) -> bool:
        """All ranks agree whether every weight is finite (checked before a checkpoint is written)."""
        # One reduction on the device, one host read: not a sync per parameter.
        finite = torch.stack(
            [torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all() for p in self.model.parameters()]
        ).all()
        flag = (~finite).float().to(self.device)
        dist.all_reduce(flag)
        return flag.item() == 0
