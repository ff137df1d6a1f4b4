"""The GPU benchmark, end to end in one command (a few minutes; budget 8): MoE layer, memory, MFU.

    python -m supernode.bench.gpu [--stack dev] [--root DIR]          # or: supernode bench gpu [...]

Run it on a GPU machine (the trainer image on a p5 pod, or any host with CUDA and this checkout).
Without CUDA it stops at once: exit 2 and a message on stderr (nothing to measure). One JSON line
per measurement, in this order:
1. `moe_layer_mfu`: forward+backward of `supernode.trainer.moe.MoE` alone in bf16 on GPU 0 (grouped_mm on
   sm90+), MFU against the catalog's dense bf16 peak (`supernode.bench.gpu_moe.layer_mfu`).
2. `moe_layer_expert_parallel` (only with > 1 GPU): the same layer with its experts split over
   every GPU of the machine (ep = GPUs, NCCL all-to-all through `supernode.trainer.dispatcher`), each rank
   routing its own tokens: step time, tokens/s and MFU per rank.
3. `memory_per_rank` (one line per rank): `bench memory` against the planner on GPUs, the model
   built by `supernode.trainer.parallel.build_model` and stepped once (`supernode.bench.memory.measure`), every term
   as {"plan": bytes, "measured": bytes} plus the allocator's peak. With at least the plan's world
   size of GPUs, the stack's full plan; otherwise the stack's model and training on the GPUs here
   (dpShard = GPUs, ep = GPUs when it divides the experts, tp = pp = 1): `layout` says which.
4. `model_mfu`: the same layout trains `--steps` timed steps (after 2 warm-up steps): tokens/s per
   GPU and MFU = tokens/s x the plan's flops_per_token / the GPU's dense bf16 peak.

With `--calibration-out FILE` it then writes the figures the planner's step time takes from a
calibration (`supernode.core.capacity.Calibration`, read by `supernode plan --calibration FILE` or
the stack key `supernode:calibration`): the matmul efficiency from (1) and the NVLink all-to-all
efficiency derived from (2) against (1) (`calibration_from`); EFA is not measured on one machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch

BUDGET_S = 480  # the whole run must finish in 8 minutes on one GPU machine


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():  # before anything slow: this benchmark measures GPUs only
        print(
            "error: python -m supernode.bench.gpu needs a CUDA GPU and this machine has none "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); run it on a GPU node, "
            "e.g. a p5 pod with the trainer image",
            file=sys.stderr,
        )
        return 2
    problems = _argument_problems(args)
    if problems:
        ap.error("; ".join(problems))  # exit 2
    planned = _stack_plan(args)
    if planned is None:
        return 2
    _measure(args, *planned)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m supernode.bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--stack", default="dev", help="stack whose plan the memory and MFU parts build")
    ap.add_argument("--root", type=Path, default=Path("."), help="directory holding Pulumi.<stack>.yaml")
    ap.add_argument("--tokens", type=int, default=16384, help="MoE layer: tokens per GPU")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=10, help="MoE layer: timed forward+backward passes")
    ap.add_argument("--steps", type=int, default=10, help="model MFU: timed training steps")
    ap.add_argument(
        "--calibration-out",
        type=Path,
        metavar="FILE",
        help="write the calibration the planner reads (supernode plan --calibration FILE)",
    )
    return ap


def _argument_problems(args: argparse.Namespace) -> list[str]:
    problems = [
        f"--{k} must be >= 1 (got {getattr(args, k)})"
        for k in ("tokens", "dim", "hidden", "experts", "topk", "repeat", "steps")
        if getattr(args, k) < 1
    ]
    if args.topk > args.experts:
        problems.append(f"--topk must be at most --experts ({args.experts}) (got {args.topk})")
    if args.calibration_out is not None and not args.calibration_out.parent.is_dir():
        problems.append(f"--calibration-out {args.calibration_out}: no such directory")
    return problems


def _stack_plan(args: argparse.Namespace):
    """(plan, layout) for the GPUs here (`gpu_plan`), or None once stderr says why the stack has none."""
    from supernode.core.errors import ConfigError

    try:
        return gpu_plan(args.stack, args.root, torch.cuda.device_count())
    except FileNotFoundError as e:
        print(f"error: --stack {args.stack}: {e.filename} not found", file=sys.stderr)
        return None
    except ConfigError as e:
        print(f"error: --stack {args.stack}: no layout of its model fits the GPUs here:\n{e}", file=sys.stderr)
        return None


def _measure(args: argparse.Namespace, plan, layout: str) -> None:
    """Every measurement in the order the module's docstring lists, one JSON line each as it comes,
    then the calibration (with --calibration-out) and the run's wall time against its budget."""
    from supernode.bench.gpu_moe import layer_mfu, peak_flops

    start = time.monotonic()
    accelerator, peak = peak_flops(torch.cuda.get_device_name())
    lines: list[dict] = []

    def emit(line: dict) -> None:
        lines.append(line)
        print(json.dumps(line), flush=True)

    emit(layer_mfu(args, peak))
    torch.cuda.empty_cache()
    for line in _expert_parallel(args, peak):
        emit(line)
    for line in _spawn(_model_worker, plan.world_size, "cuda", plan.model_dump_json(), layout, args.steps, peak):
        emit(line)
    if args.calibration_out is not None:
        cal = calibration_from(lines, accelerator, torch.cuda.get_device_name())
        write_calibration(args.calibration_out, cal)
        emit(
            {
                "measurement": "calibration",
                "path": str(args.calibration_out),
                **cal.model_dump(exclude={"measurements"}),
            }
        )
    elapsed = time.monotonic() - start
    print(
        json.dumps(
            {
                "measurement": "gpu_bench_wall",
                "seconds": round(elapsed, 1),
                "budget_s": BUDGET_S,
                "within_budget": elapsed <= BUDGET_S,
            }
        ),
        flush=True,
    )


def _expert_parallel(args: argparse.Namespace, peak: float) -> list[dict]:
    """The layer with its experts over every GPU here: a line per rank, a skipped line when the GPUs
    do not divide the experts, none on one GPU."""
    gpus = torch.cuda.device_count()
    if gpus <= 1:
        return []
    if args.experts % gpus:
        return [
            {
                "measurement": "moe_layer_expert_parallel",
                "skipped": True,
                "reason": f"--experts {args.experts} is not divisible by the {gpus} GPUs",
            }
        ]
    return _spawn(_ep_worker, gpus, "cuda", args, peak)


def calibration_from(lines: list[dict], accelerator: str, device: str, measured_at: str | None = None):
    """The planner's calibration from this run's lines (no GPU needed: the tests feed it lines).

    - matmul_efficiency: `moe_layer_mfu`, the MFU of the bf16 MoE layer's forward+backward on one GPU
      (compute alone: what the plan's compute term divides the peak by).
    - nvlink_efficiency: `moe_layer_expert_parallel` runs the same layer, the same tokens per GPU,
      with its experts over ep GPUs; the slowest rank's step less the one-GPU step is the time its
      all-to-alls add (the bench layer has no shared expert, so nothing hides them). Its four
      all-to-alls move 4 x tokens x topk x dim x 2 B x (ep-1)/ep per rank (the plan's
      all_to_all_bytes_per_rank for one layer); over that time, against the catalog's one-direction
      NVLink bandwidth. None when not measured (one GPU, skipped) or not in (0, 1].
    - efa_efficiency: None, `bench gpu` runs on one machine.
    """
    from supernode.core.capacity import Calibration
    from supernode.core.catalog import CATALOG

    (layer,) = [x for x in lines if x.get("measurement") == "moe_layer_mfu"]
    ep_lines = [x for x in lines if x.get("measurement") == "moe_layer_expert_parallel" and not x.get("skipped")]
    used = [layer, *ep_lines]
    nvlink = None
    if ep_lines:
        first, ep = ep_lines[0], ep_lines[0]["ep"]
        exposed = max(x["step_s"] for x in ep_lines) - layer["step_s"]
        moved = 4 * first["tokens_per_rank"] * first["topk"] * first["dim"] * 2 * (ep - 1) / ep
        hw = next(t for t in CATALOG.values() if t.accelerator == accelerator)
        if exposed > 0:
            figure = moved / exposed / (hw.nvlink_gbytes_s * 1e9 / 2)
            nvlink = round(figure, 4) if 0 < figure <= 1 else None
    return Calibration(
        accelerator=accelerator,
        device=device,
        measured_at=measured_at or datetime.now(UTC).isoformat(timespec="seconds"),
        matmul_efficiency=layer["mfu"],
        nvlink_efficiency=nvlink,
        measurements=used,
    )


def write_calibration(path: Path, calibration) -> None:
    """The calibration as `Calibration.read` reads it back (without `path`: the reader sets it)."""
    Path(path).write_text(calibration.model_dump_json(indent=2, exclude={"path"}) + "\n", encoding="utf-8")


def gpu_plan(stack: str, root: Path, gpus: int):
    """(plan, layout): the stack's full plan when this machine has its world size of GPUs, else its
    model and training laid out on the `gpus` here: dpShard = gpus, ep = gpus where that divides the
    experts (else 1), tp = pp = dpReplicate = 1, the stack's precision and checkpointing."""
    from supernode.core.config import from_mapping, load_stack
    from supernode.core.plan import build_local_plan, build_plan

    cfg = load_stack(stack, root)
    full = build_plan(stack, cfg)
    if gpus >= full.world_size:
        return full, "full plan"
    data = cfg.to_mapping()
    p = cfg.parallel
    ep = gpus if cfg.model.experts % gpus == 0 else 1
    data["local"] = {
        "nproc": gpus,
        "model": {},
        "training": {},
        "parallel": {
            "dpReplicate": 1,
            "dpShard": gpus,
            "tp": 1,
            "ep": ep,
            "pp": 1,
            "mixedPrecision": p.mixed_precision,
            "activationCheckpointing": p.activation_checkpointing,
        },
    }
    plan = build_local_plan(stack, from_mapping(data, f"{stack} on {gpus} GPU(s)"), device="cuda")
    return plan, f"the stack's model on {gpus} GPU(s) (dpShard={gpus}, ep={ep}); its full plan needs {full.world_size}"


# -- spawned ranks (NCCL, one GPU each; gloo on CPU for the tests) --------------------------------


def _spawn(worker, world: int, device_type: str, *args) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(
            _entry, args=(world, workdir, device_type, worker, args), nprocs=world, start_method="spawn", join=True
        )
        lines: list[dict] = []
        for rank in range(world):
            lines += json.loads(Path(workdir, f"rank{rank}.json").read_text())
    return lines


def _entry(rank: int, world: int, workdir: str, device_type: str, worker, args: tuple) -> None:
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group(
            "cuda:nccl,cpu:gloo",
            init_method=f"file://{workdir}/rendezvous",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=300),
            device_id=device,
        )
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/rendezvous",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=300),
        )
    try:
        lines = worker(rank, world, device, *args)
        Path(workdir, f"rank{rank}.json").write_text(json.dumps(lines))
    finally:
        dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ep_worker(rank: int, world: int, device: torch.device, args: argparse.Namespace, peak: float) -> list[dict]:
    import torch.distributed as dist

    from supernode.bench.moe import moe_layer_flops
    from supernode.trainer.dispatcher import AllToAllDispatcher
    from supernode.trainer.moe import MoE

    torch.manual_seed(0)  # every rank the same full layer, then its slice of the experts
    layer = MoE(args.dim, args.experts, args.topk, args.hidden).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, args.dim**-0.5)
    per = args.experts // world
    for name in ("w1", "w2", "w3"):
        full = getattr(layer.experts, name)
        setattr(layer.experts, name, torch.nn.Parameter(full.detach()[rank * per : (rank + 1) * per].clone()))
    layer.dispatcher = AllToAllDispatcher(dist.group.WORLD)
    gen = torch.Generator(device=device).manual_seed(10 + rank)
    x = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16, generator=gen, requires_grad=True)
    upstream = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=gen)
    for _ in range(3):
        (layer(x) * upstream).sum().backward()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.repeat):
        (layer(x) * upstream).sum().backward()
    _sync(device)
    step = (time.perf_counter() - start) / args.repeat
    flops = moe_layer_flops(args.tokens, args.dim, args.hidden, args.experts, args.topk)
    return [
        {
            "measurement": "moe_layer_expert_parallel",
            "rank": rank,
            "ep": world,
            "backend": dist.get_backend(),
            "tokens_per_rank": args.tokens,
            "dim": args.dim,
            "hidden": args.hidden,
            "experts": args.experts,
            "topk": args.topk,
            "dtype": "bfloat16",
            "step_s": round(step, 6),
            "tokens_per_s": round(args.tokens / step, 1),
            "mfu": round(flops / step / peak, 4),
        }
    ]


def _model_worker(
    rank: int, world: int, device: torch.device, plan_json: str, layout: str, steps: int, peak: float
) -> list[dict]:
    from supernode.bench.memory import measure
    from supernode.core.plan import Plan
    from supernode.trainer.engine import adamw
    from supernode.trainer.model import loss_fn
    from supernode.trainer.parallel import build_model, checked_layout

    plan = Plan.model_validate_json(plan_json)
    memory = measure(rank, world, plan, device)
    memory["layout"] = layout
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t = plan.training
    model = build_model(plan.model, checked_layout(plan, world), device, t.seed)
    optimizer = adamw(model, t, device)  # the trainer's own
    tokens = torch.randint(
        0, plan.model.vocab, (t.micro_batch, plan.model.seq_len + 1), generator=torch.Generator().manual_seed(rank)
    ).to(device)

    def step() -> None:
        (loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) + model.aux_loss()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    step_s = (time.perf_counter() - start) / steps
    per_gpu = t.micro_batch * plan.model.seq_len / step_s
    # Data-parallel ranks read distinct tokens; tensor-parallel ranks share theirs (tp = 1 in the GPU layout).
    per_gpu /= plan.degrees.tp * plan.degrees.pp
    mfu = {
        "measurement": "model_mfu",
        "stack": plan.stack,
        "rank": rank,
        "world_size": world,
        "layout": layout,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "micro_batch": t.micro_batch,
        "seq_len": plan.model.seq_len,
        "flops_per_token": plan.flops_per_token,
        "step_s": round(step_s, 5),
        "tokens_per_s_per_gpu": round(per_gpu, 1),
        "mfu": round(per_gpu * plan.flops_per_token / peak, 4),
        "planned_mfu": round(plan.step.mfu, 4),
    }  # the planner's estimate for its layout (the full plan's on p5)
    return [memory, mfu]


if __name__ == "__main__":
    raise SystemExit(main())
