"""The layout search: every layout of the plan's world that fits, and the ones worth suggesting.

Each candidate is costed by the same `estimate.cost` as the stack's own layout (the same layout
validator, fit test and step time), so a suggestion is a layout the plan would accept as it stands.
"""

from __future__ import annotations

import itertools

from .capacity import AC_MODES, Calibration, ParamCounts
from .catalog import InstanceType
from .config import Model, Parallel, Training
from .estimate import cost
from .mesh import Mesh


class Suggestion(Mesh):
    """A layout the planner found to fit: its degrees, the options it was costed with, the figures."""

    activation_checkpointing: str
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    micro_batch: int = 1  # training.microBatch
    micro_batches: int = 1  # per step: globalBatch / (microBatch x dp), the gradient accumulation
    memory_gib: float
    step_s: float
    ep_inside_domain: bool = True  # every EP group on one NVLink domain


def micro_batch_options(t: Training) -> list[int]:
    """Micro-batches the search tries: the stack's, every power of two below it (less activation
    memory, more accumulation) and the next one above (fewer gathers per step where memory allows)."""
    return sorted({t.micro_batch} | {2**k for k in range(t.micro_batch.bit_length() + 1)})


def pareto(found: list[Suggestion]) -> list[Suggestion]:
    """The suggestions no other one beats on step time and memory both (equal on one and better on
    the other beats); of equal figures, the first in `found`'s order. Sorted by step time."""
    front: list[Suggestion] = []
    for s in sorted(found, key=lambda s: (s.step_s, s.memory_gib)):  # stable: `found`'s order breaks ties
        if not front or s.memory_gib < front[-1].memory_gib:
            front.append(s)
    return front


def fitting_layouts(
    m: Model,
    p: Parallel,
    t: Training,
    hw: InstanceType,
    pc: ParamCounts,
    domain: int | None = None,
    calibration: Calibration | None = None,
) -> list[Suggestion]:
    """Every layout with the same world size that fits within the usable HBM (`Mesh.candidates`, each
    with the pipeline schedules, activation checkpointing modes and micro-batches), simplest first;
    tp up to the domain's GPUs. A candidate whose batch would need zero-weight padding is no layout
    for the planned world (the config requires dp to divide it). `pc`: the model's counts."""
    domain = domain or hw.accelerators
    world, out = p.world_size, []
    for mesh in Mesh.candidates(world, max_tp=domain, max_pp=m.layers, experts=m.experts):
        # Pipelines: 1f1b, and interleaved with 2 virtual stages where the layers allow (gpipe has
        # 1f1b's bubble and holds more activations: never better).
        schedules = [("1f1b", 1)] + ([("interleaved1f1b", 2)] if 1 < mesh.pp and 2 * mesh.pp <= m.layers else [])
        for (schedule, virtual), ac, mb in itertools.product(schedules, AC_MODES, micro_batch_options(t)):
            options = dict(pp_schedule=schedule, pp_virtual_stages=virtual, activation_checkpointing=ac)
            cand = p.model_copy(
                update=mesh.model_dump() | options | dict(pp_first_stage_fewer_layers=0, pp_last_stage_fewer_layers=0)
            )
            train = t.model_copy(update={"micro_batch": mb})
            layout = cost(m, cand, train, hw, pc, world // hw.accelerators, domain, calibration, fitting_only=True)
            if layout.fits and not layout.padded_micro_batches:
                out.append(
                    Suggestion(
                        **mesh.model_dump(),
                        **options,
                        micro_batch=mb,
                        micro_batches=layout.micro_batches_per_step,
                        memory_gib=round(layout.memory_per_rank_gib, 2),
                        step_s=round(layout.step_s, 4),
                        ep_inside_domain=layout.group("ep").inside_domain,
                    )
                )
    # Simplest first, so that of equal (rounded) figures the simpler layout is kept: fewer stages,
    # the plain schedule, less tp, less replication, less recomputation, smaller EP groups, the
    # stack's own micro-batch.
    out.sort(
        key=lambda s: (
            s.pp,
            s.pp_virtual_stages,
            s.tp,
            s.dp_replicate,
            AC_MODES.index(s.activation_checkpointing),
            s.ep,
            s.micro_batch != t.micro_batch,
        )
    )
    return out


def suggest(
    m: Model,
    p: Parallel,
    t: Training,
    hw: InstanceType,
    pc: ParamCounts,
    limit: int = 3,
    domain: int | None = None,
    calibration: Calibration | None = None,
) -> list[Suggestion]:
    """The fitting layouts (`fitting_layouts`) worth offering: only the Pareto front of step time and
    memory (no suggestion is slower and larger than another), EP inside the NVLink domain first,
    then fastest, as NVIDIA's GB200 recipes place it (docs/hardware.md: EP in the NVL domain, DP/FSDP
    across domains)."""
    front = pareto(fitting_layouts(m, p, t, hw, pc, domain, calibration))
    front.sort(key=lambda s: (not s.ep_inside_domain, s.step_s, s.memory_gib))  # stable: ties stay simplest first
    return front[:limit]
