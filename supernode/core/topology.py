"""Where the parallel mesh lands on the hardware: NVLink domains, EFA between them.

A supernode is many GPUs with one globally addressed memory, where reaching another card's memory
costs differently inside an NVLink domain (NVLink, ~900 GB/s per direction per GPU) and across
domains (EFA, ~50 GB/s per GPU). The planner therefore places every mesh dimension explicitly:

- Rank order: ranks are numbered domain by domain (the trainer reorders them with `rank_order`, so
  this holds whatever order torchrun handed out), then as the layout orders them
  (`supernode.core.mesh.Mesh`: tp fastest, then dp_shard, dp_replicate, pp; the EP group carved out
  of dp_shard x tp), which gives every group its size and stride (docs/architecture.md §6).
- A group of `size` members `stride` ranks apart spans some domains; `place` reports the worst
  group of each dimension (every collective waits for its slowest group).
- Costs are hierarchical: a group spanning k domains with m members in each pays NVLink for its
  peers inside the domain and EFA for the rest (`all_to_all_seconds`, `ring_seconds`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, ConfigDict

from .mesh import Mesh

# NVLink inside a GPU domain, NeuronLink inside a Trainium one (the vendor's name, `scale_up_link`);
# "on-chip": a Trainium2 TP group among the logical NeuronCores of one chip (through its HBM).
Link = Literal["NVLink", "EFA", "NVLink+EFA", "NeuronLink", "NeuronLink+EFA", "on-chip"]


class GroupPlacement(BaseModel):
    """One mesh dimension's groups on the domains (the worst group of the dimension)."""

    model_config = ConfigDict(frozen=True)
    dim: str  # tp, ep, edp (expert data parallel), dp_shard, dp_replicate
    size: int
    stride: int  # ranks between consecutive members
    domains: int  # NVLink domains the worst group spans
    per_domain: int  # members of that group inside one domain (the fewest)

    @property
    def link(self) -> Link:
        if self.size == 1 or self.domains == 1:
            return "NVLink"
        return "EFA" if self.per_domain == 1 else "NVLink+EFA"

    @property
    def inside_domain(self) -> bool:
        return self.domains == 1


@lru_cache(maxsize=4096)  # the planner asks for the same spans for every candidate layout
def group_span(size: int, stride: int, world: int, domain: int) -> tuple[int, int]:
    """(domains, members per domain) of the worst group of `size` members `stride` ranks apart among
    `world` ranks numbered domain by domain in blocks of `domain`."""
    worst = (1, size)
    if size == 1:
        return worst
    for base in range(world):
        if (base // stride) % size:  # not the first member of a group
            continue
        per: dict[int, int] = defaultdict(int)
        for i in range(size):
            per[(base + i * stride) // domain] += 1
        span = (len(per), min(per.values()))
        worst = max(worst, span, key=lambda s: (s[0], -s[1]))
    return worst


def place(mesh: Mesh, domain: int) -> list[GroupPlacement]:
    """Each collective group of the layout on NVLink domains of `domain` GPUs."""
    world = mesh.world_size
    return [
        GroupPlacement(dim=dim, size=n, stride=s, domains=k, per_domain=m)
        for dim, (n, s) in mesh.groups().items()
        for k, m in [group_span(n, s, world, domain)]
    ]


def scale_up_link(link: Link, name: str) -> Link:
    """A placement's link named for the domain's interconnect (`InstanceType.link_name`): the
    placement speaks of NVLink, a Trainium domain's link is NeuronLink."""
    return link.replace("NVLink", name)  # type: ignore[return-value]


def nodes_spanned(g: GroupPlacement, world: int, node_ranks: int) -> int:
    """Instances the worst group of a dimension spans (`node_ranks` ranks per instance): inside a
    multi-instance domain, the link between instances can be slower than inside one (Trn2 UltraServer)."""
    return group_span(g.size, g.stride, world, node_ranks)[0]


def inside_chip(g: GroupPlacement, ranks_per_chip: int) -> bool:
    """Every group of the dimension lies on one accelerator chip: consecutive ranks (stride 1, as tp
    is laid out) in aligned blocks of a size dividing the chip's rank count (Trainium2: 4 logical cores)."""
    return ranks_per_chip > 1 and g.stride == 1 and ranks_per_chip % g.size == 0


def all_to_all_seconds(peer_bytes: float, g: GroupPlacement, nvlink: float, efa: float) -> float:
    """An all-to-all in which each rank sends `peer_bytes` in all to its size-1 peers, split evenly:
    the per_domain-1 peers inside its domain over NVLink, the others over EFA (one after the other:
    an upper bound). Bandwidths in bytes/s per GPU and direction."""
    if g.size == 1:
        return 0.0
    inside = peer_bytes * (g.per_domain - 1) / (g.size - 1)
    return inside / nvlink + (peer_bytes - inside) / efa


def ring_seconds(buffer_bytes: float, g: GroupPlacement, nvlink: float, efa: float) -> float:
    """A reduce-scatter or all-gather of a `buffer_bytes` buffer over the group, hierarchically as
    NCCL does across domains: a ring inside the domain (buffer x (m-1)/m over NVLink), then each of the
    m members moves its 1/m share across the k domains (buffer/m x (k-1)/k over EFA)."""
    if g.size == 1:
        return 0.0
    m, k = g.per_domain, math.ceil(g.size / g.per_domain)
    return buffer_bytes * (m - 1) / m / nvlink + buffer_bytes / m * (k - 1) / k / efa


def rank_order(domain_of_rank: Sequence[Hashable], group: int) -> list[int]:
    """The rank order for the trainer: the process torchrun numbered `order[i]` becomes rank i
    (supernode.trainer.parallel.renumber_by_domain), and the row-major meshes follow.

    `domain_of_rank[r]` is the NVLink domain of rank r (the node's `nvidia.com/gpu.clique` label, or
    anything equal exactly for GPUs of one domain). Ranks are grouped domain by domain (domains in
    order of their lowest rank, ranks ascending inside), so every aligned block of `group`
    consecutive positions, and with it every EP and TP group, lies inside one domain. `group` is
    lcm(ep, tp). Every rank computes the same order from the same all-gathered list. Raises
    ValueError when a domain's rank count is not a multiple of `group` (some group would cross)."""
    if group < 1:
        raise ValueError(f"group size must be at least 1, got {group}")
    by_domain: dict[Hashable, list[int]] = {}
    for r, d in enumerate(domain_of_rank):
        by_domain.setdefault(d, []).append(r)
    for d, ranks in by_domain.items():
        if len(ranks) % group:
            raise ValueError(
                f"NVLink domain {d!r} holds {len(ranks)} ranks, not a multiple of the EP/TP group "
                f"size {group}: a group would cross domains"
            )
    return [r for ranks in by_domain.values() for r in ranks]
