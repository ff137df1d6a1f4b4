"""`supernode plan`: the parallel plan and capacity figures."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ...core.capacity import UNCALIBRATED, Calibration
from ...core.catalog import GIB
from ...core.errors import EXIT_FAILED
from ...core.estimate import Layout
from ...core.plan import Plan, build_plan
from ...core.teams import cluster_queue as team_queue
from ...core.teams import namespace as team_namespace
from ...core.topology import scale_up_link
from ..args import add_stack_args, plain_console, stack_from_args
from .data import add_data_arg, check_plan_data


def register(sub) -> None:
    p = sub.add_parser("plan", help="the parallel plan and capacity figures of a stack")
    add_stack_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--full", action="store_true", help="with --json: the whole serialised plan")
    p.add_argument(
        "--calibration",
        type=Path,
        metavar="FILE",
        help="efficiencies measured by `supernode bench gpu --calibration-out FILE` (default: the stack's "
        "supernode:calibration, else uncalibrated defaults)",
    )
    add_data_arg(p)
    p.set_defaults(func=run)


def plan_json(plan: Plan) -> dict:
    """The summary, the stack's figures, this world's layout (flattened) and every world's."""
    stack_fields = {
        "instance_type",
        "accelerators_per_node",
        "params",
        "flops_per_token",
        "usable_hbm_gib",
        "suggestions",
        "calibration",
        "topology",
        "checkpoint",
        "cost_per_hour_usd",
        "spare_nodes",
        "spare_accelerators",
        "spare_cost_per_hour_usd",
        "pools",
        "termination_grace_s",
        "termination_grace_needed_s",
        "layouts",
    }
    layout_fields = {"nodes", "memory", "over_by_gib", "step", "pipeline", "placement", "domains"}
    layout_fields |= {"replica_domains", "replica_fits"}
    if plan.teams:  # a stack without teams prints what it printed before they existed
        stack_fields.add("teams")
    return (
        plan.summary()
        | json.loads(plan.model_dump_json(include=stack_fields))
        | json.loads(plan.layout.model_dump_json(include=layout_fields))
        | {"run_hours": plan.run_hours, "run_cost_usd": plan.run_cost_usd}
    )


def step_detail(plan: Plan) -> str:
    """The step as the planner adds it up (StepTime): exposed is what the trainer does not overlap."""
    s = plan.step
    terms = [
        f"compute {s.compute_s:.3f}",
        f"recompute {s.recompute_s:.3f}",
        f"exposed all-to-all {s.exposed_all_to_all_s:.3f}",
        f"exposed FSDP {s.exposed_fsdp_s:.3f}",
        f"TP {s.tensor_parallel_s:.3f}",
    ]
    if plan.degrees.pp > 1:
        terms += [f"p2p {s.p2p_s:.3f}", f"bubble {s.pipeline_bubble_s:.3f}"]
    return " + ".join(terms) + f" = {s.step_s:.3f} s"


def comm_detail(plan: Plan) -> str:
    """The traffic the step moves, each collective with the link it crosses, as the plan placed it."""
    s = plan.step

    def term(label: str, seconds: float, *keys: str) -> str:
        links = sorted({s.links[k] for k in keys if k in s.links})
        return f"{label} {seconds:.3f}" + (f" ({', '.join(links)})" if links else "")

    parts = [
        term("all-to-all", s.all_to_all_s, "all_to_all")
        + (f" + {s.recompute_all_to_all_s:.3f} recomputed" if s.recompute_all_to_all_s else ""),
        term("FSDP", s.fsdp_s, "fsdp", "fsdp_experts"),
        term("replicate", s.replicate_s, "replicate"),
        term("TP", s.tensor_parallel_s, "tensor_parallel"),
    ]
    if plan.degrees.pp > 1:
        parts.append(term("p2p", s.p2p_s, "p2p"))
    return ", ".join(parts) + " s"


def calibration_detail(plan: Plan) -> str:
    """Which efficiencies the step time rests on: a calibration's measured ones, or the defaults."""
    return plan.calibration.describe() if plan.calibration else UNCALIBRATED


def duration(hours: float) -> str:
    """A run's length with the precision it needs: a short dev run is minutes or seconds, not 0.0 h."""
    if hours >= 1:
        return f"{hours:,.1f} h"
    if hours * 60 >= 1:
        return f"{hours * 60:.1f} min"
    return f"{hours * 3600:.1f} s"


def money(usd: float) -> str:
    return f"${usd:,.0f}" if usd >= 100 else f"${usd:,.2f}"


SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "interleaved 1F1B"}


def pipeline_detail(plan: Plan) -> str:
    """The bubble as the planner computes it, with the figures it comes from."""
    p = plan.pipeline
    m, v, pp = p.micro_batches, p.virtual_stages, p.pp
    return (
        f"{SCHEDULE_NAMES[p.schedule]}, pp {pp} x {v} virtual = {pp * v} stages, layers per stage "
        f"{p.stage_layers}; bubble (pp-1)/(m*v + pp-1) = {pp - 1}/({m}*{v} + {pp - 1}) = {p.bubble:.1%} of each "
        f"step idle (+{plan.step.pipeline_bubble_s:.3f} s) for m = {m} micro-batches per step; pp rank 0 holds "
        f"{p.in_flight} micro-batch x stage activations at the peak; "
        f"{p.p2p_bytes_per_rank / 1e6:,.1f} MB sent per rank per step; more micro-batches (or virtual stages) "
        "shrink the bubble"
    )


def placement_detail(plan: Plan) -> str:
    """Which mesh degrees live inside one NVLink domain and which cross EFA."""
    inside, across = [], []
    for g in plan.layout.placement:
        if g.size > 1:
            link = scale_up_link(g.link, plan.hardware.link_name)
            (inside if g.inside_domain else across).append(
                f"{g.dim} {g.size}" + ("" if g.inside_domain else f" over {g.domains} domains ({link})")
            )
    return f"inside a domain: {', '.join(inside) or 'none'}; across EFA: {', '.join(across) or 'none'}"


def elastic_detail(plan: Plan, e: Layout) -> str:
    """One elastic world as the plan laid it out: what changed from the planned layout and its cost."""
    if e.degrees is None or not e.fits:
        return f"[red]no layout: {e.reason}[/]"
    d = e.degrees
    padded = f" (+{e.padded_micro_batches} padded)" if e.padded_micro_batches else ""
    # A smaller world may train faster (its ep divides into the planned group, this one's does not).
    faster = [f.nodes for f in plan.layouts if f.fits and f.nodes < e.nodes and f.tokens_per_s > e.tokens_per_s]
    return (
        f"dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x tp {d.tp} x pp {d.pp}; ep {d.ep}; "
        f"{e.micro_batches_per_step} micro-batches per step{padded}; {e.memory_per_rank_gib:.1f} GiB/rank; "
        f"{e.step_s:.2f} s/step, {e.tokens_per_s / 1e3:,.0f}k tokens/s ({e.step_s / plan.step.step_s:.2f}x the step)"
        + (f"; slower than on {faster[-1]} nodes" if faster else "")
    )


Row = tuple[str, str, str]


def render(plan: Plan, console: Console) -> None:
    t = Table(title=f"supernode plan: {plan.stack}", show_header=True, header_style="bold")
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_column("detail")
    for row in (*_layout_rows(plan), *_memory_rows(plan), *_step_rows(plan), *_operations_rows(plan)):
        t.add_row(*row)
    console.print(t)
    for e in plan.layouts:
        if not e.fits and e.world_size != plan.world_size:
            console.print(
                f"[red]The elastic job may run on {e.nodes} nodes (training.minNodes {plan.min_nodes}) but has no "
                f"layout there: {e.reason}.[/]"
            )
    if not plan.fits:
        _print_fit_advice(plan, console)


def _layout_rows(plan: Plan) -> list[Row]:
    """The hardware, the layout on it, the model and where its groups land on the domains."""
    d, hw, topo = plan.degrees, plan.hardware, plan.topology
    rows = [
        (
            "hardware",
            f"{plan.nodes} x {plan.instance_type}",
            f"{plan.world_size} x {hw.accelerator} {plan.hbm_gib:.0f} GiB, "
            f"{hw.efa_interfaces} EFA x {hw.efa_gbps} Gb/s",
        ),
        (
            "layout",
            f"world {plan.world_size}",
            f"dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x "
            f"tp {d.tp} x pp {d.pp}; ep {d.ep}; AC {plan.parallel.activation_checkpointing}; "
            f"{plan.parallel.mixed_precision}; overlap {'on' if plan.parallel.overlap else 'off'}",
        ),
        (
            "parameters",
            f"{plan.params.total / 1e9:.2f} B",
            f"{plan.params.active / 1e9:.2f} B active per token; experts {plan.params.experts / 1e9:.2f} B",
        ),
        (
            f"{hw.link_name} domain",
            f"{topo.domain_gpus} {hw.rank_noun}s",
            f"{topo.ultra_server or 'one instance'}: {topo.nodes_per_domain} node(s), {topo.domain_hbm_gib:,.0f} GiB "
            f"HBM in one address space; the job spans {plan.layout.domains} domain(s)",
        ),
        ("placement", f"ep {d.ep}", placement_detail(plan)),
    ]
    if d.pp > 1:
        rows.append(("pipeline", f"bubble {plan.pipeline.bubble:.1%}", pipeline_detail(plan)))
    return rows


def _memory_rows(plan: Plan) -> list[Row]:
    """One replica's state against its shard group's HBM, and a rank's memory against its GPU's."""
    d, hw, m = plan.degrees, plan.hardware, plan.memory
    fits_domain = "[green]fits[/]" if plan.layout.replica_fits else "[red]does not fit[/]"
    within = f"{plan.usable_hbm_gib:.1f} GiB usable ({plan.parallel.hbm_headroom:.0%} headroom)"
    fit = (
        f"[green]fits in {within}[/]"
        if plan.fits
        else f"[red]does not fit: over by {plan.over_by_gib:.1f} GiB of {within}[/]"
    )
    return [
        (
            "replica state",
            f"{plan.topology.replica_state_gib:,.0f} GiB",
            f"{fits_domain} the aggregate HBM of its {d.shard_group} shard-group {hw.rank_noun}s "
            f"({plan.layout.replica_domains} domain(s))",
        ),
        (
            "memory / rank",
            f"{plan.memory_per_rank_gib:.1f} GiB",
            f"states {m.model_states / GIB:.1f}, FSDP buffers {m.fsdp_buffers / GIB:.1f}, activations "
            f"{m.activations / GIB:.1f}, logits {m.logits / GIB:.1f}, reserve {m.runtime_reserve / GIB:.1f} GiB",
        ),
        ("HBM / rank", f"{plan.hbm_gib:.1f} GiB", fit),
    ]


def _step_rows(plan: Plan) -> list[Row]:
    """The step time, its communication, TP on a chip, every elastic world, MFU and calibration."""
    s, hw = plan.step, plan.hardware
    exposed = s.exposed_all_to_all_s + s.exposed_fsdp_s + s.tensor_parallel_s + s.p2p_s
    rows = [
        ("step time (est.)", f"{s.step_s:.3f} s", step_detail(plan)),
        ("communication", f"{exposed:.3f} s exposed", comm_detail(plan)),
    ]
    if (chip := s.chip_tensor_parallel) is not None and chip.tp > 1:
        on_chip = (
            f"{chip.inside_chip_s:.3f} s inside one chip" if chip.inside_chip_s is not None else "no chip holds it"
        )
        rows.append(
            (
                "TP on chip",
                f"tp {chip.tp}",
                f"{on_chip} against {chip.across_chips_s:.3f} s across chips over {hw.link_name} "
                f"({chip.ranks_per_chip} logical cores per chip; the plan costs "
                f"{'the first' if chip.inside_chip else 'the second'})",
            )
        )
    if len(plan.layouts) > 1:
        rows += [(f"elastic {e.nodes} nodes", f"world {e.world_size}", elastic_detail(plan, e)) for e in plan.layouts]
    rows.append(("MFU (est.)", f"{s.mfu:.1%}", f"{plan.flops_per_token / 1e9:.2f} GFLOP/token"))
    rows.append(("calibration", plan.calibration.accelerator if plan.calibration else "none", calibration_detail(plan)))
    return rows


def _operations_rows(plan: Plan) -> list[Row]:
    """The checkpoint, the grace period it needs, the pools training shares and the cost."""
    c, s = plan.checkpoint, plan.step
    enough = plan.termination_grace_s >= plan.termination_grace_needed_s
    rows = [
        (
            "checkpoint",
            f"{c.checkpoint_bytes / 1e9:.1f} GB",
            f"needs {c.required_mb_s:.0f} MB/s; FSx "
            f"{c.fsx_capacity_gib} GiB -> {c.fsx_throughput_mb_s:.0f} MB/s, writes in {c.write_seconds:.0f} s"
            f"{' (sized by planner)' if c.sized_by_planner else ''}",
        ),
        (
            "grace period",
            f"{plan.termination_grace_s} s",
            f"{'[green]covers[/]' if enough else '[red]below[/]'} the {plan.termination_grace_needed_s} s a "
            f"preempted pod needs: a step {s.step_s:.1f} s + a checkpoint write {c.write_seconds:.0f} s + margin "
            "(workload.terminationGraceS)",
        ),
    ]
    for pool in plan.pools:
        rows.append(
            (
                f"pool {pool.accelerator}",
                f"{pool.devices} {pool.noun}",
                f"{'[green]adds up[/]' if pool.adds_up else '[red]does not add up[/]'}: {pool.reason}; training "
                f"runs on {pool.training_min} to {pool.training_max} {pool.noun} (training.minNodes "
                f"{plan.min_nodes} to {plan.nodes} nodes), lends {pool.training_lending_limit}"
                + (f", never its {pool.spare_devices} spare {pool.noun}" if pool.spare_devices else "")
                + (
                    f", borrows up to {pool.training_borrowing_limit} of serving's idle share (preemptible)"
                    if pool.training_borrowing_limit
                    else ""
                ),
            )
        )
    rows += _team_rows(plan)
    spares = (
        f"; of it {plan.spare_nodes} spare node(s) ${plan.spare_cost_per_hour_usd:,.2f}/h" if plan.spare_nodes else ""
    )
    rows.append(
        (
            "cost",
            f"${plan.cost_per_hour_usd:,.2f}/h",
            f"{plan.training.steps} steps ~ {duration(plan.run_hours)} ~ {money(plan.run_cost_usd)} on demand{spares}",
        )
    )
    return rows


def _team_rows(plan: Plan) -> list[Row]:
    """Each team's share of each pool (supernode:teams), and whether the quotas add up."""
    rows: list[Row] = []
    for tp in plan.teams:
        rows.append(
            (
                f"teams {tp.accelerator}",
                f"{tp.nominal_total} {tp.noun}",
                f"{'[green]adds up[/]' if tp.adds_up else '[red]does not add up[/]'}: {tp.reason}",
            )
        )
        for t in tp.teams:
            rows.append(
                (
                    f"  team {t.name}",
                    f"{t.nominal} {tp.noun}",
                    f"{t.training_percent:g}% of training's share ({t.pool_percent:g}% of the pool), {t.nodes} "
                    f"nodes; borrows up to {t.borrowing_limit}, lends up to {t.lending_limit}, weight {t.weight:g}; "
                    f"holds at most {t.max_devices} {tp.noun} ({t.max_nodes} nodes) in {team_namespace(t.name)}, "
                    f"queue {team_queue(t.name, tp.accelerator)}"
                    + (" (also the stack's own job)" if t.name == tp.stack_job_team else ""),
                )
            )
    return rows


def _print_fit_advice(plan: Plan, console: Console) -> None:
    """Why the planned layout does not fit, and the layouts of the same world that do."""
    console.print(
        f"[red]The plan needs {plan.memory_per_rank_gib:.1f} GiB per rank but the GPU has "
        f"{plan.hbm_gib:.1f} GiB, {plan.usable_hbm_gib:.1f} GiB with {plan.parallel.hbm_headroom:.0%} "
        f"headroom.[/]"
    )
    if not plan.suggestions:
        console.print(
            "No layout of this world size fits: add nodes, use larger-memory GPUs, "
            "or shrink micro batch / sequence length."
        )
        return
    console.print(
        "Layouts with the same world size that fit (EP inside the NVLink domain first, then fastest; "
        "none slower and larger than another):"
    )
    for sug in plan.suggestions:
        virtual = f", ppVirtualStages {sug.pp_virtual_stages}" if sug.pp_virtual_stages > 1 else ""
        pipe = f" ({sug.pp_schedule}{virtual})" if sug.pp > 1 else ""
        console.print(
            f"  dpReplicate {sug.dp_replicate}, dpShard {sug.dp_shard}, tp {sug.tp}, ep {sug.ep}, "
            f"pp {sug.pp}{pipe}, activationCheckpointing {sug.activation_checkpointing}, "
            f"microBatch {sug.micro_batch} ({sug.micro_batches} per step): "
            f"{sug.memory_gib} GiB, ~{sug.step_s} s/step"
            f"{'' if sug.ep_inside_domain else ', EP crosses NVLink domains'}",
            markup=False,
        )


def run(args) -> int:
    stack, cfg = stack_from_args(args)
    calibration = Calibration.read(args.calibration, "--calibration") if args.calibration else None
    plan = build_plan(stack, cfg, calibration, root=args.root)
    check_plan_data(plan, args.data)
    if args.json:
        print(plan.to_json() if args.full else json.dumps(plan_json(plan), indent=2))
    else:
        render(plan, plain_console())
    # As the preview's memory-fit and memory-fit-elastic policies: every world the job may run at fits.
    return 0 if plan.fits and all(e.fits for e in plan.layouts) else EXIT_FAILED
