"""Async checkpoint stall against a synchronous save; checksum cost split across ranks.

    python -m supernode.bench.checkpoint [--dim 256 --layers 4 --experts 8 --window 8 --repeats 3]
                               [--ranks 4] [--part all|stall|hash] [--stack prod]

Stall (`--part stall`):
The training loop runs `--window` real optimizer steps of `supernode.trainer.model.Transformer` (AdamW) with
one `supernode.trainer.checkpoint.Checkpointer.save` at the start. The stall is the time the loop is
blocked inside checkpoint calls: for a sync save the whole write and commit; for an async save the
planning, any wait for the staging copy (which overlaps the next forward/backward) before the
optimizer step, the commit, and the wait at the end of the window if the background write is still
running (the next save would block on it). Medians over `--repeats`; the goal is async <= 0.2 x sync.
For context each line also gives the window's wall time with and without a save (on a small
shared CPU the background write also competes with the steps for cores; that slowdown is there).
Prints one JSON line per mode and a summary line.

Checksums (`--part hash`): sha256 throughput of one core ("sha256"); then `--ranks` gloo ranks save
the same model FSDP-sharded with the real Checkpointer (each rank hashes the files it writes) and,
for that checkpoint, "hash_split" compares the commit's hashing before (rank 0 hashed every file)
and now (each rank its own files; the largest share is the wall time), and the restore check (rank 0
alone vs file i on rank i % ranks), each rank's share timed alone, as a rank with a core of its own
pays it, and all ranks at once on this machine's cores (best of `--repeats`: the least contended).
"projection" scales the measured core rate to the checkpoint and world size of `--stack`'s plan.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from supernode.core.checkpoints import checkpoint_problem, complete_checkpoints, read_marker
from supernode.core.config import Model, load_stack
from supernode.core.errors import bad_input_lines
from supernode.core.files import sha256_file
from supernode.core.plan import build_plan
from supernode.trainer.checkpoint import Checkpointer, train_state
from supernode.trainer.model import Transformer, loss_fn

GOAL = 0.2


class _Position:
    def state_dict(self) -> dict:
        return {"epoch": 0, "position": 0}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _model(args: argparse.Namespace) -> Model:
    return Model(
        layers=args.layers,
        dim=args.dim,
        heads=4,
        kv_heads=2,
        experts=args.experts,
        top_k=2,
        expert_hidden=2 * args.dim,
        dense_hidden=4 * args.dim,
        vocab=256,
        seq_len=args.seq,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supernode.bench.checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--window", type=int, default=8, help="training steps per measured window")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="checkpoint directory (default: a temporary one)")
    p.add_argument("--part", choices=("all", "stall", "hash"), default="all")
    p.add_argument("--ranks", type=int, default=4, help="gloo ranks that write the checkpoint the hash part measures")
    p.add_argument("--stack", default="prod", help="the stack whose checkpoint the measured rate is projected to")
    p.add_argument("--root", type=Path, default=Path("."), help="directory holding Pulumi.<stack>.yaml (default: .)")
    args = p.parse_args(argv)
    for name, least in (
        ("dim", 1),
        ("layers", 1),
        ("experts", 1),
        ("seq", 1),
        ("batch", 1),
        ("window", 1),
        ("repeats", 1),
        ("ranks", 2),
    ):
        if getattr(args, name) < least:
            print(f"error: --{name} must be at least {least} (got {getattr(args, name)})", file=sys.stderr)
            return 2
    try:
        cfg = _model(args)
        plan = build_plan(args.stack, load_stack(args.stack, args.root)) if args.part != "stall" else None
    except Exception as e:  # noqa: BLE001 - known bad input is one line, exit 2
        lines = bad_input_lines(e) or ([f"error: {e}"] if isinstance(e, ValueError) else None)
        if lines is None:
            raise
        print("\n".join(lines), file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    root = args.out or work / "ckpt"
    try:
        if args.part != "hash":
            dist.init_process_group(
                "gloo", init_method=f"file://{work}/rdzv", rank=0, world_size=1, timeout=timedelta(seconds=600)
            )
            try:
                _run(args, cfg, root)
            finally:
                dist.destroy_process_group()
        if args.part != "stall":
            _hashes(args, cfg, work, plan)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, cfg: Model, root: Path) -> int:
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len + 1))

    def step(ckpt: Checkpointer | None = None) -> float:
        """One training step; returns the seconds spent waiting for checkpoint staging."""
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        waited = 0.0
        if ckpt is not None:  # as supernode.trainer.train does: the staged copy must be taken before the update
            c0 = time.perf_counter()
            ckpt.wait_for_staging()
            waited = time.perf_counter() - c0
        opt.step()
        opt.zero_grad(set_to_none=True)
        return waited

    step()  # optimizer state exists from here on: the checkpoint holds params + Adam moments
    state_mb = _state_mb(model, opt)
    save_count = 0

    def window(ckpt: Checkpointer | None, sync: bool) -> tuple[float, float]:
        """(window seconds, seconds the loop was blocked in checkpoint calls: save, poll, wait)."""
        nonlocal save_count
        t0 = time.perf_counter()
        blocked = 0.0
        for i in range(args.window):
            if ckpt is not None:
                c0 = time.perf_counter()
                if i == 0:
                    save_count += 1
                    ckpt.save(save_count, sync=sync)
                ckpt.poll()
                blocked += time.perf_counter() - c0
            blocked += step(ckpt)
        if ckpt is not None:
            c0 = time.perf_counter()
            ckpt.wait()  # a write still running here would block the next save
            blocked += time.perf_counter() - c0
        return time.perf_counter() - t0, blocked

    ckpt = Checkpointer(root, keep=1, state=train_state(model, opt, sched, _Position()), async_save=True)
    window(ckpt, sync=False)  # warm-up: first DCP save plans and allocates staging buffers
    window(ckpt, sync=True)
    _stall_per_mode(args, window, ckpt, state_mb)
    return 0


def _state_mb(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """MB a checkpoint holds: the model's state and the optimizer's tensors (Adam moments)."""
    state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
    state_mb += (
        sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)) / 1e6
    )
    return state_mb


def _stall_per_mode(
    args: argparse.Namespace,
    window: Callable[..., tuple[float, float]],
    ckpt: Checkpointer,
    state_mb: float,
) -> None:
    """A line per mode (sync, async) as it is measured: the median stall over `--repeats` windows
    with a save, beside windows without one; then the async/sync ratio against the goal.
    `window(ckpt or None, sync=...)` is `_run`'s: (window seconds, seconds blocked in checkpoint calls)."""
    results = {}
    for mode in ("sync", "async"):
        base, with_save, blocked = [], [], []
        for _ in range(args.repeats):
            base.append(window(None, sync=False)[0])
            total, b = window(ckpt, sync=mode == "sync")
            with_save.append(total)
            blocked.append(b)
        results[mode] = statistics.median(blocked)
        print(
            json.dumps(
                {
                    "bench": "checkpoint",
                    "mode": mode,
                    "state_mb": round(state_mb, 1),
                    "stall_s": round(results[mode], 4),
                    "window_steps": args.window,
                    "window_s": round(statistics.median(base), 4),
                    "window_with_save_s": round(statistics.median(with_save), 4),
                }
            ),
            flush=True,
        )
    ratio = results["async"] / results["sync"] if results["sync"] > 0 else float("inf")
    print(
        json.dumps(
            {"bench": "checkpoint", "async_over_sync_stall": round(ratio, 4), "goal": GOAL, "met": ratio <= GOAL}
        ),
        flush=True,
    )


# -- checksums: rank 0 alone vs each rank its own files -----------------------------------------------


def _sha256_gb_s(mb: int, repeats: int) -> tuple[float, float]:
    """(best, median) GB/s of sha256 on one core, in the 4 MiB blocks sha256_file reads."""
    data = memoryview(os.urandom(mb << 20))
    rates = []
    for _ in range(max(repeats, 3)):
        h, t0 = hashlib.sha256(), time.perf_counter()
        for i in range(0, len(data), 1 << 22):
            h.update(data[i : i + (1 << 22)])
        rates.append(len(data) / (time.perf_counter() - t0) / 1e9)
    return max(rates), statistics.median(rates)


def _save_rank(rank: int, world: int, work: str, cfg: Model) -> None:
    """One of `world` ranks: the bench model FSDP-sharded, with Adam moments, saved once (sync)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{work}/rdzv-save", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    try:
        torch.manual_seed(0)
        model = Transformer(cfg)
        model.init_weights(0)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for param in model.parameters():  # Adam moments without a forward pass: the state a save holds
            param.grad = torch.zeros_like(param)
        opt.step()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        ckpt = Checkpointer(
            Path(work) / "sharded",
            keep=1,
            state=train_state(model, opt, sched, _Position()),
            async_save=False,
        )
        ckpt.save(1, sync=True)
        ckpt.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _hash_all(paths: list[Path]) -> None:
    for path in paths:
        sha256_file(path)


def _check_share(path: Path, rank: int, world: int) -> float:
    t0 = time.perf_counter()
    if checkpoint_problem(path, (rank, world)) is not None:
        raise RuntimeError(f"{path} does not verify")
    return time.perf_counter() - t0


def _hashes(args: argparse.Namespace, cfg: Model, work: Path, plan) -> None:
    rate, median = _sha256_gb_s(256, args.repeats)
    print(
        json.dumps(
            {
                "bench": "checkpoint",
                "measure": "sha256",
                "gb_s_per_core": round(rate, 3),
                "gb_s_per_core_median": round(median, 3),
                "buffer_mb": 256,
                "cores": os.cpu_count(),
            }
        ),
        flush=True,
    )
    n = args.ranks
    mp.start_processes(_save_rank, args=(n, str(work), cfg), nprocs=n, start_method="spawn", join=True)
    ((_, path),) = complete_checkpoints(work / "sharded")
    names = sorted(read_marker(path)["files"])
    size = {name: (path / name).stat().st_size for name in names}
    own = [
        [name for name in names if name.startswith(f"__{r}_") or (r == 0 and name == ".metadata")] for r in range(n)
    ]  # what each rank writes, so hashes while writing

    def best(fn, *a) -> float:  # the least contended run: a core's cost, not the neighbours' load
        return min(_timed(fn, *a) for _ in range(args.repeats))

    rank0_all = best(_hash_all, [path / name for name in names])
    per_rank = [best(_hash_all, [path / name for name in mine]) for mine in own]
    check_all = best(checkpoint_problem, path)
    check_share = [best(checkpoint_problem, path, (r, n)) for r in range(n)]
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_check_share, [path] * n, range(n), [n] * n))  # warm: imports, page cache
        together = min(max(pool.map(_check_share, [path] * n, range(n), [n] * n)) for _ in range(args.repeats))
    total = sum(size.values())
    print(
        json.dumps(
            {
                "bench": "checkpoint",
                "measure": "hash_split",
                "ranks": n,
                "files": len(names),
                "checkpoint_mb": round(total / 1e6, 1),
                "rank_mb": [round(sum(size[f] for f in m) / 1e6, 1) for m in own],
                "commit_rank0_all_s": round(rank0_all, 4),
                "commit_per_rank_s": [round(t, 4) for t in per_rank],
                "commit_speedup": round(rank0_all / max(per_rank), 2),
                "restore_rank0_all_s": round(check_all, 4),
                "restore_per_rank_s": [round(t, 4) for t in check_share],
                "restore_speedup": round(check_all / max(check_share), 2),
                "restore_all_ranks_at_once_s": round(together, 4),
                "cores": os.cpu_count(),
            }
        ),
        flush=True,
    )
    ckpt_bytes, world = plan.checkpoint.checkpoint_bytes, plan.world_size
    print(
        json.dumps(
            {
                "bench": "checkpoint",
                "measure": "projection",
                "stack": plan.stack,
                "checkpoint_gb": round(ckpt_bytes / 1e9, 1),
                "ranks": world,
                "per_rank_gb": round(ckpt_bytes / world / 1e9, 3),
                "gb_s_per_core": round(rate, 3),
                "rank0_all_s": round(ckpt_bytes / rate / 1e9, 1),
                "per_rank_s": round(ckpt_bytes / world / rate / 1e9, 2),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
