"""Offline preview cost: seconds to preview prod and a stack with 4x its node groups and nodes.

Both are measured in the same run, alternating, so machine noise hits both alike; the ratio
should be about 4 if the cost grows linearly with the resources registered.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from supernode.core.config import StackConfig, load_stack
from supernode.tools.preview import run_program


def scaled(cfg: StackConfig, factor: int) -> StackConfig:
    """`factor` times the node groups, each with `factor` times the nodes; layout scaled to match."""
    data = cfg.model_dump(by_alias=False)
    groups = []
    for i in range(factor):
        for g in data["accelerator_node_groups"]:
            groups.append(dict(g, name=f"{g['name']}-{i}", nodes=g["nodes"] * factor))
    data["accelerator_node_groups"] = groups
    data["parallel"]["dp_shard"] *= factor * factor
    data["training"]["global_batch"] *= factor * factor
    return StackConfig.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="supernode bench preview", description=__doc__)
    ap.add_argument("--stack", default="prod")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    base = load_stack(args.stack)
    big = scaled(base, args.factor)
    times: dict[str, list[float]] = {"base": [], "big": []}
    counts, groups = {}, {"base": len(base.accelerator_node_groups), "big": len(big.accelerator_node_groups)}
    run_program(args.stack, base)  # warm imports
    for _ in range(args.repeat):
        for label, cfg in (("base", base), ("big", big)):
            t0 = time.perf_counter()
            result = run_program(args.stack, cfg)
            times[label].append(time.perf_counter() - t0)
            counts[label] = len(result.resources)
    for label in ("base", "big"):
        print(
            json.dumps(
                {
                    "bench": "preview",
                    "stack": args.stack,
                    "variant": label,
                    "resources": counts[label],
                    "node_groups": groups[label],
                    "nodes": (base if label == "base" else big).nodes,
                    "seconds_median": round(statistics.median(times[label]), 4),
                    "seconds_all": [round(t, 4) for t in times[label]],
                }
            )
        )
    ratio = statistics.median(times["big"]) / statistics.median(times["base"])
    # Cost per extra node group: the launch templates carry one interface per network card (32 on p5).
    per_group = (statistics.median(times["big"]) - statistics.median(times["base"])) / (groups["big"] - groups["base"])
    print(
        json.dumps(
            {
                "bench": "preview",
                "ratio_seconds": round(ratio, 3),
                "ratio_resources": round(counts["big"] / max(1, counts["base"]), 3),
                "factor": args.factor,
                "seconds_per_extra_node_group": round(per_group, 4),
            }
        )
    )
    return 0
