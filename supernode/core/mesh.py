"""The parallel layout: the degrees, declared once, and where every rank and group sits in them.

`Mesh` is the one owner of the layout's arithmetic. The config's `Parallel` extends it with the
layout's options (pipeline schedule, activation checkpointing, precision), the Plan carries it as
`degrees`, the planner's suggestions are Meshes, `supernode.core.topology` places its groups on the
NVLink domains, and the trainer builds its device meshes from `device_meshes`.

Rank order, fastest first (`ORDER`, torchtitan's): tp, dp_shard, dp_replicate, pp:

    rank = ((r_pp * dp_replicate + r_dp_replicate) * dp_shard + r_dp_shard) * tp + r_tp

so each pipeline stage is a block of world/pp consecutive ranks. The EP group is `ep` consecutive
ranks carved out of dp_shard x tp, and the edp = dp_shard*tp/ep ranks `ep` apart inside that block
hold the same experts (FSDP shards them). ep is therefore not a factor of the world size.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class Mesh(BaseModel):
    model_config = ConfigDict(frozen=True)

    dp_replicate: int = Field(
        default=1, ge=1, description="data-parallel replicas (HSDP): each holds a full copy of the sharded state"
    )
    dp_shard: int = Field(default=1, ge=1, description="data-parallel ranks that shard the parameters (FSDP)")
    tp: int = Field(default=1, ge=1, description="tensor-parallel degree, within one NVLink domain")
    ep: int = Field(default=1, ge=1, description="expert-parallel degree: ranks the routed experts are divided over")
    pp: int = Field(default=1, ge=1, description="pipeline stages (layers split by stage; the outermost mesh dim)")

    # The dims whose product is the world, in rank order: each one's stride is the product of those before it.
    ORDER: ClassVar[tuple[str, ...]] = ("tp", "dp_shard", "dp_replicate", "pp")
    # The groups that run collectives, in the order the plan reports their placement. pp is not one:
    # neighbouring stages exchange activations point to point, `stride("pp")` ranks apart.
    COLLECTIVE_GROUPS: ClassVar[tuple[str, ...]] = ("tp", "ep", "edp", "dp_shard", "dp_replicate")

    def degrees(self) -> Mesh:
        """The degrees alone, without a subclass's options (the Plan's `degrees`)."""
        return Mesh(**{name: getattr(self, name) for name in Mesh.model_fields})

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, dim) for dim in self.ORDER)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the distinct streams of data the job reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Ranks that hold the same experts (FSDP shards them): dp_shard x tp / ep, dp_replicate excluded."""
        return self.dp_shard * self.tp // self.ep

    @property
    def shard_group(self) -> int:
        """Ranks that together hold one replica's training state: every degree but dp_replicate
        (dp_shard x tp x pp)."""
        return self.world_size // self.dp_replicate

    def size(self, dim: str) -> int:
        return self.edp if dim == "edp" else getattr(self, dim)

    def stride(self, dim: str) -> int:
        """Ranks between consecutive members of a `dim` group."""
        if dim == "ep":  # consecutive ranks at the start of the dp_shard x tp block
            return 1
        if dim == "edp":  # one member in each EP group of the block
            return self.ep
        return math.prod(getattr(self, faster) for faster in self.ORDER[: self.ORDER.index(dim)])

    def coordinate(self, rank: int, dim: str) -> int:
        """`rank`'s index along `dim` (its pipeline stage for pp, its EP shard for ep)."""
        return rank // self.stride(dim) % self.size(dim)

    def dp_rank(self, rank: int) -> int:
        """Which data stream `rank` reads: its dp_replicate and dp_shard coordinates as one (they are
        adjacent in the rank order); the tp ranks and the stages of one pipeline read the same one."""
        return rank // self.stride("dp_shard") % self.dp

    def groups(self) -> dict[str, tuple[int, int]]:
        """Each group that runs collectives as (size, stride)."""
        return {dim: (self.size(dim), self.stride(dim)) for dim in self.COLLECTIVE_GROUPS}

    def device_meshes(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """The trainer's device meshes as (dim name, size), outermost first: views of the one rank
        order, so every mesh agrees on where a rank sits. dense: attention, dense FFN, embeddings
        (TP + FSDP/HSDP); experts: the dp_shard x tp block as edp x ep; moe: that block flat, for the
        router and shared expert, whose gradients are reduced over dp_shard x tp."""
        dense = tuple((dim, getattr(self, dim)) for dim in reversed(self.ORDER))
        outer = tuple((dim, n) for dim, n in dense if dim not in ("dp_shard", "tp"))
        return {
            "dense": dense,
            "experts": outer + (("edp", self.edp), ("ep", self.ep)),
            "moe": outer + (("dp_shard_tp", self.dp_shard * self.tp),),
        }

    def factors(self, without: str = "") -> dict[str, int]:
        """The degrees whose product is the world size by their config keys (dpReplicate, ...), in
        declaration order, less `without`: for messages that show the product."""
        return {to_camel(dim): getattr(self, dim) for dim in Mesh.model_fields if dim in self.ORDER and dim != without}

    def rescaled(self, world: int) -> Self:
        """This layout for `world` ranks: dp_shard absorbs the change (rounded down, at least 1), the
        other degrees kept. How a stack's layout becomes a local run's."""
        return self.model_copy(update={"dp_shard": max(1, world // math.prod(self.factors("dp_shard").values()))})

    @classmethod
    def candidates(cls, world: int, max_tp: int, max_pp: int, experts: int) -> Iterator[Mesh]:
        """The planner's search space: every layout of `world` ranks with tp at most `max_tp` (an
        NVLink domain), pp at most `max_pp` (a layer per stage), dp_shard filling the world and ep
        dividing both `experts` and dp_shard x tp; by pp, tp, dp_replicate, ep ascending."""
        divisors = [n for n in range(1, world + 1) if world % n == 0]
        for pp, tp, rep in itertools.product(
            [d for d in divisors if d <= max_pp], [d for d in divisors if d <= max_tp], divisors
        ):
            if world % (tp * rep * pp):
                continue
            shard = world // (tp * rep * pp)
            for ep in [d for d in divisors if experts % d == 0 and (shard * tp) % d == 0]:
                yield cls(dp_replicate=rep, dp_shard=shard, tp=tp, ep=ep, pp=pp)
