"""Fabric check: collective bandwidth, latency and a node-pair matrix, gated by the plan's floor and
compared with a recorded baseline ("communication first, then compute, then the application").

    torchrun --nproc-per-node N -m supernode.trainer.node.fabric --plan /etc/supernode/plan.json [--sizes 1M,16M,256M]
    torchrun ... -m supernode.trainer.node.fabric --plan PLAN --baseline BASELINE.json --report LAST.json
    torchrun --nproc-per-node N -m supernode.trainer.node.fabric --min-busbw-gbytes-s 240        # a manual run

What it measures, rank 0 printing one JSON line each:
- all_reduce and all_to_all (the MoE collective) bus bandwidth over message sizes. Bus bandwidth
  follows nccl-tests (doc/PERFORMANCE.md): algbw = bytes / time, busbw = algbw x 2(n-1)/n for
  all_reduce, algbw x (n-1)/n for all_to_all, comparable to the link bandwidth whatever the rank
  count. Units are GB/s (10^9 bytes/s), as nccl-tests prints them.
- small-message all_reduce latency (the floor every step's synchronisation pays).
- the node-pair matrix: bandwidth and latency between every pair of nodes, local rank i of one node
  exchanging with local rank i of the other (every GPU's own NIC at once). Pairs run in rounds of
  disjoint pairs (round-robin tournament): n-1 rounds for n nodes (n when n is odd), not n(n-1)/2.
  A pair regresses when its bandwidth drops, or its latency grows, beyond `--regression` of its
  reference: the baseline's figure for the same two nodes; for a pair the baseline lacks (a node
  that replaced a failed one) the baseline's typical node (the median over nodes of each node's
  median pair); without a baseline, this run's typical node. Each figure is the median over
  iterations (a hiccup of a shared host is no finding). A new node that is not named is added to
  the baseline (its pairs that did not regress; the file rewritten atomically, `rebaselined` saying
  when and which), so a replaced node needs no manual re-baseline.
  A node is named when more than half of its compared pairs regressed (one bad link regresses one
  pair; a bad node regresses all of its pairs), and the line `fabric_regressed_node_count` is what
  the monitoring's log metric filter turns into an alarm.

With `--verdict-configmap NAMESPACE/NAME` (the scheduled re-check) rank 0 also records its verdict on
every node it measured in that ConfigMap, one key per node (health.fabric_entry: the time, named slow
or not), with a JSON merge patch: a node it did not measure keeps its last entry, which ages out. Each
node's health agent reads its own key and quarantines a node named slow until a later check passes
(docs/architecture.md, "Node life cycle"). A verdict that cannot be written fails the check.

The gate compares the best all_reduce busbw with the floor (the plan's `gate_floor_gbytes_s` under
--plan, as the gate Job runs it, or --min-busbw-gbytes-s) and fails when a node is named.
`--baseline PATH` compares with the report at PATH, or records this run there when none exists yet
(the deploy-time baseline: instance ids, GPU and EFA device counts, the matrix).

Exit codes: 0 passed, 1 below the floor or a node named, 2 bad flags or an unreadable baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from supernode.core.errors import EXIT_BAD_INPUT, BadInput
from supernode.core.faults import inject
from supernode.core.plan import Plan

from ..device import choose, synchronize
from . import health
from .agent import Kube, configmap_ref
from .inventory import instance_id

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun gives each rank
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    unit = t[-1] if t and t[-1] in UNITS else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: {text!r} is not a size such as 4096, 64K, 16M or 1G") from None
    if value < 4:
        raise argparse.ArgumentTypeError(f"--sizes: {text!r} is below 4 bytes (one float32)")
    return value


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def _op(name: str, buf: torch.Tensor, out: torch.Tensor) -> None:
    if name == "all_reduce":
        dist.all_reduce(buf)
    else:
        dist.all_to_all_single(out, buf)


def measure(op: str, nbytes: int, device: torch.device, warmup: int, iters: int) -> dict:
    """One (op, size) point: mean time per call over `iters` after `warmup`, and the bandwidths."""
    n = dist.get_world_size()
    elems = max(n, nbytes // 4 // n * n)  # float32, divisible by n for all_to_all's equal splits
    buf = torch.ones(elems, dtype=torch.float32, device=device)
    out = torch.empty_like(buf)
    for _ in range(warmup):
        _op(op, buf, out)
    synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        _op(op, buf, out)
    synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace, as in nccl-tests
    size = elems * 4
    algbw = size / elapsed.item() / 1e9
    return {
        "op": op,
        "bytes": size,
        "world_size": n,
        "time_us": round(elapsed.item() * 1e6, 2),
        "algbw_gb_s": round(algbw, 4),
        "busbw_gb_s": round(algbw * BUSBW_FACTOR[op](n), 4),
    }


def latency(device: torch.device, warmup: int, iters: int) -> dict:
    """Small-message (one float per rank) all_reduce latency: what a step's synchronisation costs at least."""
    point = measure("all_reduce", 4, device, warmup, iters)
    return {
        "latency": "all_reduce",
        "bytes": point["bytes"],
        "world_size": point["world_size"],
        "time_us": point["time_us"],
    }


# -- the node-pair matrix ---------------------------------------------------------------------------
SLOW_RANK_DELAY_S = 0.25  # SUPERNODE_INJECT_FAULT=slow-rank@R: rank R waits this long before each send


def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of n units exactly once, in rounds of disjoint pairs (the circle method of a
    round-robin tournament): n-1 rounds for even n, n for odd n (each round one unit sits out)."""
    units: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(units)
    rounds = []
    for _ in range(m - 1):
        pairs = [
            (min(a, b), max(a, b))
            for a, b in zip(units[: m // 2], reversed(units[m // 2 :]))
            if a is not None and b is not None
        ]
        rounds.append(sorted(pairs))
        units = [units[0], units[-1], *units[1:-1]]  # keep the first, rotate the rest
    return [r for r in rounds if r]


def node_identity() -> dict[str, Any]:
    """What names this node in a report: the Kubernetes node (downward API NODE_NAME) or host name,
    the EC2 instance id (Nitro publishes it as the DMI board asset tag, readable without the
    instance metadata service, which pods may not reach), and the GPU and EFA device counts."""
    efa = Path("/sys/class/infiniband")
    return {
        "node": os.environ.get("NODE_NAME") or socket.gethostname(),
        "instance_id": instance_id(),
        "gpus": torch.cuda.device_count(),
        "efa": len(list(efa.iterdir())) if efa.is_dir() else 0,
    }


def _send(t: torch.Tensor, peer: int, delay_s: float) -> None:
    if delay_s:
        time.sleep(delay_s)
    dist.send(t, peer)


def _pair_times(
    peer: int, first: bool, nbytes: int, device: torch.device, warmup: int, iters: int, delay_s: float
) -> tuple[float, float]:
    """(seconds per exchange of `nbytes` each way, seconds one way for one float) with `peer`. The
    bulk exchange runs both directions at once; latency is half a ping-pong's round trip."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    out, tiny = torch.empty_like(buf), torch.ones(1, dtype=torch.float32, device=device)

    def sync() -> None:
        synchronize(device)

    def exchange() -> None:
        if delay_s:
            time.sleep(delay_s)
        for req in (dist.isend(buf, peer), dist.irecv(out, peer)):
            req.wait()

    def ping() -> None:
        if first:
            _send(tiny, peer, delay_s)
            dist.recv(tiny, peer)
        else:
            dist.recv(tiny, peer)
            _send(tiny, peer, delay_s)

    def timed(fn) -> float:
        """The median of per-iteration times: one hiccup of a shared host is not a slow link."""
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    for _ in range(warmup):
        exchange()
        ping()
    sync()
    return timed(exchange), timed(ping) / 2


def measure_pairs(ranks_per_node: int, nbytes: int, device: torch.device, warmup: int, iters: int) -> dict | None:
    """The node-pair matrix (on rank 0; None elsewhere): nodes (identities) and, per pair, the
    node-to-node bandwidth (the local links' sum) and latency (the worst local link)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    unit, local, units = rank // ranks_per_node, rank % ranks_per_node, world // ranks_per_node
    delay_s = SLOW_RANK_DELAY_S if inject("slow-rank") == str(rank) else 0.0
    rounds = pair_rounds(units)
    mine = []
    for r, pairs in enumerate(rounds):
        for a, b in pairs:
            if unit in (a, b):
                other = b if unit == a else a
                bw_s, lat_s = _pair_times(
                    other * ranks_per_node + local, unit == a, nbytes, device, warmup, iters, delay_s
                )
                mine.append({"round": r, "a": a, "b": b, "local": local, "bw_s": bw_s, "lat_s": lat_s})
        dist.barrier()  # rounds never overlap: each pair has the links to itself
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"unit": unit, "local": local, "identity": node_identity(), "times": mine})
    if rank != 0:
        return None
    nodes = [g["identity"] for g in gathered if g["local"] == 0]
    names = [n["node"] for n in nodes]
    if len(set(names)) < len(names):  # several units on one host (a local run): tell them apart
        names = [f"{name}#{u}" for u, name in enumerate(names)]
    slowest: dict[tuple[int, int, int], dict] = {}  # (a, b, local) -> the slower side's view of the link
    for g in gathered:
        for t in g["times"]:
            key = (t["a"], t["b"], t["local"])
            seen = slowest.setdefault(key, t)
            slowest[key] = {**t, "bw_s": max(seen["bw_s"], t["bw_s"]), "lat_s": max(seen["lat_s"], t["lat_s"])}
    matrix = []
    for r, pairs in enumerate(rounds):
        for a, b in pairs:
            links = [slowest[(a, b, lo)] for lo in range(ranks_per_node)]
            gb_s = sum(4 * max(1, nbytes // 4) / link["bw_s"] / 1e9 for link in links)
            matrix.append(
                {
                    "pair": [names[a], names[b]],
                    "round": r,
                    "gb_s": round(gb_s, 4),
                    "latency_us": round(max(link["lat_s"] for link in links) * 1e6, 2),
                }
            )
    return {
        "nodes": [{**n, "node": name} for n, name in zip(nodes, names)],
        "rounds": len(rounds),
        "bytes": 4 * max(1, nbytes // 4),
        "pairs": matrix,
    }


def _key(p: dict) -> tuple[str, str]:
    a, b = p["pair"]
    return (a, b) if a <= b else (b, a)


def typical(pairs: list[dict]) -> dict[str, float]:
    """The typical node's figures: the median over nodes of each node's median pair, which one bad
    node (or link) cannot drag down. Empty without pairs."""
    per_node: dict[str, list[dict]] = {}
    for p in pairs:
        for n in p["pair"]:
            per_node.setdefault(n, []).append(p)
    return (
        {
            k: statistics.median(statistics.median(q[k] for q in ps) for ps in per_node.values())
            for k in ("gb_s", "latency_us")
        }
        if per_node
        else {}
    )


def compare(pairs: list[dict], threshold: float, baseline: list[dict] | None = None) -> dict:
    """Which pairs regressed beyond `threshold` (a fraction) of their reference, and which nodes:
    those with more than half of their compared pairs regressed. The reference is the baseline's
    pair of the same two nodes; a pair the baseline lacks (a node that joined since, e.g. one that
    replaced a failed node) is held to the baseline's fleet figures (`typical` over its pairs),
    with the same threshold. Without a baseline every pair is held to this run's typical node."""
    if baseline is not None:
        ref, fleet = {_key(p): p for p in baseline}, typical(baseline)
        compared = [(p, ref.get(_key(p), fleet)) for p in pairs if _key(p) in ref or fleet]
        known = {n for p in baseline for n in p["pair"]}
        new_nodes = sorted({n for p in pairs for n in p["pair"]} - known)
    else:
        fleet, new_nodes = typical(pairs), []
        compared = [(p, fleet) for p in pairs]
    regressed, counts, totals = [], {}, {}
    for p, r in compared:
        slow = p["gb_s"] < (1 - threshold) * r["gb_s"] or p["latency_us"] * (1 - threshold) > r["latency_us"]
        for n in p["pair"]:
            totals[n] = totals.get(n, 0) + 1
            counts[n] = counts.get(n, 0) + slow
        if slow:
            regressed.append({**p, "reference_gb_s": r["gb_s"], "reference_latency_us": r["latency_us"]})
    suspects = sorted(n for n in totals if counts[n] * 2 > totals[n])
    return {
        "reference": "baseline" if baseline is not None else "typical-node",
        "compared_pairs": len(compared),
        "unbaselined_pairs": len(pairs) - len(compared),
        "new_nodes": new_nodes,
        "regressed_pairs": regressed,
        "suspect_nodes": suspects,
        "fabric_regressed_node_count": len(suspects),
    }


def extend_baseline(baseline: dict, matrix: dict, found: dict, when: float) -> dict | None:
    """The baseline with the healthy new nodes added, or None when there are none: their identities,
    and those of their pairs that did not regress (a pair with a bad old node is left out and stays
    held to the fleet figures). The old nodes' pairs are kept as recorded; `rebaselined` says when
    and which nodes were added."""
    healthy = [n for n in found["new_nodes"] if n not in found["suspect_nodes"]]
    if not healthy:
        return None
    slow = {_key(p) for p in found["regressed_pairs"]}
    known = {_key(p) for p in baseline["pairs"]}
    added = [p for p in matrix["pairs"] if set(p["pair"]) & set(healthy) and _key(p) not in slow | known]
    return {
        **baseline,
        "pairs": baseline["pairs"] + added,
        "nodes": baseline.get("nodes", []) + [n for n in matrix["nodes"] if n["node"] in healthy],
        "rebaselined": baseline.get("rebaselined", []) + [{"time": when, "nodes": healthy, "pairs": len(added)}],
    }


def verdict_patch(namespace: str, name: str, matrix: dict, found: dict, when: float) -> dict:
    """The JSON merge patch (application/merge-patch+json) of the verdict ConfigMap: an entry for
    every node of the pair matrix, named slow or not (a merge patch leaves the other keys, the nodes
    this run did not measure, as they were)."""
    regressed: dict[str, int] = {}
    for p in found["regressed_pairs"]:
        for n in p["pair"]:
            regressed[n] = regressed.get(n, 0) + 1
    measured: dict[str, int] = {}
    for p in matrix["pairs"]:
        for n in p["pair"]:
            measured[n] = measured.get(n, 0) + 1
    suspects = set(found["suspect_nodes"])
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace},
        "data": {
            n: health.fabric_entry(when, n in suspects, f"{regressed.get(n, 0)} of {count} pairs regressed")
            for n, count in sorted(measured.items())
        },
    }


def read_report(path: Path, flag: str) -> dict:
    """A report this module wrote (the baseline), or BadInput naming the flag and what is wrong."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise BadInput(f"{flag} {path}: cannot be read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError):
        raise BadInput(
            f"{flag} {path}: not JSON; give a report written by supernode.trainer.node.fabric --report"
        ) from None
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("pairs"), list)
        or not all(isinstance(p, dict) and {"pair", "gb_s", "latency_us"} <= set(p) for p in doc["pairs"])
    ):
        raise BadInput(
            f'{flag} {path}: not a fabric report (no "pairs" list of pair/gb_s/latency_us); '
            "give a report written by supernode.trainer.node.fabric --report"
        )
    return doc


def write_report(path: Path, doc: dict) -> None:
    """Atomically (a reader never sees half a baseline)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def plan_floor(path: str) -> float:
    """The gate floor (GB/s) of a plan file, as `supernode plan --json --full` or the plan ConfigMap holds it."""
    plan = Plan.read(path)
    if plan.gate_floor_gbytes_s is None:
        raise BadInput(
            f"--plan {path}: the plan has no interconnect gate floor (gate_floor_gbytes_s is null: the "
            f"catalog publishes no all_reduce baseline for {plan.instance_type}); pass --min-busbw-gbytes-s"
        )
    return plan.gate_floor_gbytes_s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m supernode.trainer.node.fabric", description=__doc__.split("\n")[0])
    floor = p.add_mutually_exclusive_group(required=True)
    floor.add_argument(
        "--plan",
        metavar="PATH",
        help="gate on the plan's floor (gate_floor_gbytes_s): how the interconnect gate Job runs it",
    )
    floor.add_argument(
        "--min-busbw-gbytes-s",
        type=float,
        metavar="GB_S",
        help="gate on this floor instead (a manual run): the best all_reduce bus bandwidth must "
        "reach this many GB/s (10^9 bytes/s)",
    )
    p.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help="comma-separated message sizes (default: 1M..1G on GPU, 64K..16M on CPU)",
    )
    p.add_argument(
        "--pair-bytes",
        type=parse_size,
        default=None,
        help="bytes each way per node-pair exchange (default: 64M on GPU, 1M on CPU)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks per node of the pair matrix (default: torchrun's LOCAL_WORLD_SIZE)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        metavar="PATH",
        help="compare the pair matrix with this report; record this run there if it does not exist",
    )
    p.add_argument("--report", type=Path, metavar="PATH", help="write this run's report (JSON) here")
    p.add_argument(
        "--verdict-configmap",
        type=configmap_ref("--verdict-configmap"),
        metavar="NAMESPACE/NAME",
        help="record the verdict on each measured node in this ConfigMap (in a pod: its service account patches it)",
    )
    p.add_argument(
        "--regression",
        type=float,
        default=0.2,
        help="a pair regresses below (1 - this) x its reference bandwidth, or its latency above "
        "the reference / (1 - this) (default 0.2)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout-s", type=int, default=600, help="collective timeout")
    return p


def checked_inputs(args: argparse.Namespace) -> tuple[float, int, dict | None]:
    """The gate floor, the ranks per node and the baseline report (None when there is none yet); a
    BadInput before any rank joins a collective."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    floor = plan_floor(args.plan) if args.plan is not None else args.min_busbw_gbytes_s
    if floor < 0 or args.iters < 1 or args.warmup < 0:
        raise BadInput("the bus-bandwidth floor must be >= 0, --iters >= 1, --warmup >= 0")
    if not 0 < args.regression < 1:
        raise BadInput(f"--regression {args.regression}: give a fraction between 0 and 1, e.g. 0.2")
    if per_node < 1 or world % per_node:
        raise BadInput(f"--ranks-per-node {per_node}: must divide the world size {world}")
    baseline = read_report(args.baseline, "--baseline") if args.baseline and args.baseline.exists() else None
    missing = [v for v in TORCHRUN_ENV if v not in os.environ]
    if missing:  # else init_process_group's env:// rendezvous fails with a traceback
        raise BadInput(
            f"supernode.trainer.node.fabric runs under torchrun ({', '.join(missing)} not set): "
            "torchrun --nproc-per-node N -m supernode.trainer.node.fabric ..."
        )
    return floor, per_node, baseline


def measure_collectives(
    sizes: list[int], device: torch.device, warmup: int, iters: int, say: Callable[[dict], None]
) -> tuple[float, list[dict], dict]:
    """Every rank: all_reduce and all_to_all over `sizes`, then the latency; the best all_reduce
    bus bandwidth (what the gate compares with the floor), the points and the latency line."""
    best, points = 0.0, []
    for op in ("all_reduce", "all_to_all"):
        for size in sizes:
            points.append(measure(op, size, device, warmup, iters))
            if op == "all_reduce":
                best = max(best, points[-1]["busbw_gb_s"])
            say(points[-1])
    lat = latency(device, warmup, iters)
    say(lat)
    return best, points, lat


def write_reports(
    args: argparse.Namespace,
    report: dict,
    baseline: dict | None,
    matrix: dict,
    found: dict,
    say: Callable[[dict], None],
) -> bool:
    """Rank 0: this run's report, the baseline recorded (none yet) or extended (a new node); False
    when a file could not be written."""
    extended = extend_baseline(baseline, matrix, found, report["time"]) if baseline else None
    try:
        if args.report:
            write_report(args.report, report)
        if args.baseline and baseline is None:
            write_report(args.baseline, report)
            say({"fabric_baseline": "recorded", "path": str(args.baseline), "nodes": len(matrix["nodes"])})
        if extended is not None:
            write_report(args.baseline, extended)
            say({"fabric_baseline": "extended", "path": str(args.baseline), **extended["rebaselined"][-1]})
    except OSError as e:  # a lost report is a failed check, said once; the peers still exit
        print(f"error: report not written: {e.filename}: {e.strerror}", file=sys.stderr, flush=True)
        return False
    return True


def record_verdict(
    configmap: tuple[str, str], matrix: dict, found: dict, when: float, say: Callable[[dict], None]
) -> bool:
    """Rank 0: the verdict on each measured node, patched into `configmap`; False when it was not."""
    try:
        body = verdict_patch(*configmap, matrix, found, when)
        Kube().patch_configmap(body)
        say({"fabric_verdict": "recorded", "configmap": "/".join(configmap), "nodes": len(body["data"])})
    except (BadInput, OSError, ValueError) as e:  # the nodes' agents would act on an old verdict
        print(f"error: verdict not recorded in {'/'.join(configmap)}: {e}", file=sys.stderr, flush=True)
        return False
    return True


def judge(
    args: argparse.Namespace,
    floor: float,
    per_node: int,
    baseline: dict | None,
    measured: tuple[float, list[dict], dict],
    matrix: dict,
    say: Callable[[dict], None],
) -> bool:
    """Rank 0: compare the pair matrix, write the reports and the verdict, print the gate line;
    whether the check passed."""
    best, points, lat = measured
    for p in matrix["pairs"]:
        say(p)
    found = compare(matrix["pairs"], args.regression, baseline["pairs"] if baseline else None)
    say({"fabric_check": "pairs", "rounds": matrix["rounds"], "pairs": len(matrix["pairs"]), **found})
    passed = best >= floor and not found["suspect_nodes"]
    report = {
        "time": time.time(),
        "world_size": dist.get_world_size(),
        "ranks_per_node": per_node,
        "collectives": points,
        "latency": lat,
        **matrix,
        "compare": found,
    }
    written = write_reports(args, report, baseline, matrix, found, say)
    recorded = args.verdict_configmap is None or record_verdict(
        args.verdict_configmap, matrix, found, report["time"], say
    )
    passed = passed and written and recorded
    say(
        {
            "gate": "all_reduce_busbw",
            "best_busbw_gb_s": best,
            "min_busbw_gb_s": floor,
            "suspect_nodes": found["suspect_nodes"],
            "passed": passed,
        }
    )
    return passed


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed the problem
        return EXIT_BAD_INPUT if e.code else 0
    try:
        floor, per_node, baseline = checked_inputs(args)
        # the plan's accelerator (a manual run without --plan: a GPU if there is one)
        choice = choose(Plan.read(args.plan).hardware.torch_device if args.plan is not None else None)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    device, gpu = choice.device, choice.accelerated
    sizes = args.sizes or ([2**k for k in range(20, 31, 2)] if gpu else [2**k for k in range(16, 25, 4)])
    pair_bytes = args.pair_bytes or (64 << 20 if gpu else 1 << 20)
    # The device's own collectives (NCCL, or Neuron's over NeuronLink and EFA): what the gate measures.
    dist.init_process_group(choice.device_backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        rank = dist.get_rank()
        say = (lambda doc: print(json.dumps(doc), flush=True)) if rank == 0 else (lambda doc: None)
        measured = measure_collectives(sizes, device, args.warmup, args.iters, say)
        matrix = measure_pairs(per_node, pair_bytes, device, args.warmup, args.iters)
        passed = measured[0] >= floor  # the best all_reduce bus bandwidth
        if rank == 0:
            passed = judge(args, floor, per_node, baseline, measured, matrix, say)
        verdict = torch.tensor([int(passed)], device=device)
        dist.broadcast(verdict, src=0)  # every rank exits as rank 0 judged
        return 0 if verdict.item() else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
