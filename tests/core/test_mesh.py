"""The layout object: the degrees declared once, the rank order and every group's size and stride
against the formula by hand, the local rescale and the planner's search space."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from supernode.core.config import Parallel, load_stack
from supernode.core.estimate import Layout
from supernode.core.mesh import Mesh
from supernode.core.plan import Plan, build_plan
from supernode.core.search import Suggestion

ROOT = Path(__file__).resolve().parents[2]
DEGREES = ["dp_replicate", "dp_shard", "tp", "ep", "pp"]


def test_the_degrees_are_declared_once():
    assert list(Mesh.model_fields) == DEGREES
    for shape in (Parallel, Suggestion):
        assert issubclass(shape, Mesh) and list(shape.model_fields)[:5] == DEGREES
    # The plan holds the degrees once, in each layout's Parallel (`degrees` reads them from there).
    assert "degrees" not in Plan.model_fields and "degrees" not in Layout.model_fields
    # The config keeps its camelCase keys; the plan serialises the bare degrees in their order.
    assert [Parallel.model_fields[d].alias for d in DEGREES] == ["dpReplicate", "dpShard", "tp", "ep", "pp"]
    plan = build_plan("prod", load_stack("prod", ROOT))
    assert list(json.loads(plan.to_json())["layouts"][-1]["parallel"])[:5] == DEGREES
    assert type(plan.degrees) is Mesh and plan.degrees == plan.parallel.degrees()


def test_rank_coordinates_follow_the_order_tp_dp_shard_dp_replicate_pp():
    mesh = Mesh(dp_replicate=2, dp_shard=3, tp=2, ep=3, pp=2)
    assert mesh.world_size == 24 and mesh.dp == 6 and mesh.edp == 2 and mesh.shard_group == 12
    ranks = itertools.product(range(2), range(2), range(3), range(2))  # pp, dp_replicate, dp_shard, tp
    for rank, (pp, rep, shard, tp) in enumerate(ranks):
        assert rank == ((pp * 2 + rep) * 3 + shard) * 2 + tp
        coords = {d: mesh.coordinate(rank, d) for d in ("tp", "dp_shard", "dp_replicate", "pp")}
        assert coords == {"tp": tp, "dp_shard": shard, "dp_replicate": rep, "pp": pp}
        assert mesh.dp_rank(rank) == rep * 3 + shard
        # EP: 3 consecutive ranks of the dp_shard x tp block; edp: the block's ranks 3 apart.
        block = rank % 6
        assert (mesh.coordinate(rank, "ep"), mesh.coordinate(rank, "edp")) == (block % 3, block // 3)
    assert mesh.groups() == {"tp": (2, 1), "ep": (3, 1), "edp": (2, 3), "dp_shard": (3, 2), "dp_replicate": (2, 6)}
    assert mesh.stride("pp") == 12  # a pipeline's neighbouring stages: one stage's ranks apart


def test_device_meshes_are_views_of_the_one_order():
    mesh = Mesh(dp_replicate=2, dp_shard=2, tp=2, ep=4, pp=3)
    assert mesh.device_meshes() == {
        "dense": (("pp", 3), ("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)),
        "experts": (("pp", 3), ("dp_replicate", 2), ("edp", 1), ("ep", 4)),
        "moe": (("pp", 3), ("dp_replicate", 2), ("dp_shard_tp", 4)),
    }


def test_the_local_rescale_fills_the_world_with_dp_shard():
    p = Parallel(dp_replicate=2, dp_shard=8, tp=2, ep=4, mixed_precision="fp32")
    assert p.factors() == {"dpReplicate": 2, "dpShard": 8, "tp": 2, "pp": 1}
    assert p.factors(without="dp_shard") == {"dpReplicate": 2, "tp": 2, "pp": 1}
    small = p.rescaled(12)
    assert type(small) is Parallel and small.mixed_precision == "fp32"
    assert (small.dp_replicate, small.dp_shard, small.tp, small.ep, small.world_size) == (2, 3, 2, 4, 12)
    assert p.rescaled(2).dp_shard == 1  # rounded down, at least 1


def test_the_search_space_is_every_layout_of_the_world():
    found = list(Mesh.candidates(8, max_tp=2, max_pp=2, experts=4))
    assert all(m.world_size == 8 and m.tp <= 2 and m.pp <= 2 for m in found)
    assert all(4 % m.ep == 0 and (m.dp_shard * m.tp) % m.ep == 0 for m in found)
    assert len(set(found)) == len(found)
    # pp, tp, dp_replicate, ep ascending: the first are the plain data-parallel layouts
    assert found[:3] == [Mesh(dp_shard=8), Mesh(dp_shard=8, ep=2), Mesh(dp_shard=8, ep=4)]
    assert Mesh(dp_replicate=2, dp_shard=1, tp=2, ep=2, pp=2) in found
