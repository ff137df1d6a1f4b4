"""Async checkpoint stall against a synchronous save of the same state, side by side in one run.

    python -m bench.checkpoint [--dim 256 --layers 4 --experts 8 --window 8 --repeats 3]

The training loop runs `--window` real optimizer steps of `trainer.model.Transformer` (AdamW) with
one `trainer.checkpoint.Checkpointer.save` at the start. The stall is the time the loop is
blocked inside checkpoint calls: for a sync save the whole write and commit; for an async save the
planning, any wait for the staging copy (which overlaps the next forward/backward) before the
optimizer step, the commit, and the wait at the end of the window if the background write is still
running (the next save would block on it). Medians over `--repeats`; the goal is async <= 0.2 x sync.
For context each line also gives the window's wall time with and without a save (on a small
shared CPU the background write also competes with the steps for cores; that slowdown is there).
Prints one JSON line per mode and a summary line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from supernode.core.config import Model
from trainer.checkpoint import Checkpointer, train_state
from trainer.model import Transformer, loss_fn

GOAL = 0.2


class _Position:
    def state_dict(self) -> dict:
        return {"epoch": 0, "position": 0}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _model(args: argparse.Namespace) -> Model:
    return Model(layers=args.layers, dim=args.dim, heads=4, kv_heads=2, experts=args.experts, top_k=2,
                 expert_hidden=2 * args.dim, dense_hidden=4 * args.dim, vocab=256, seq_len=args.seq)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--window", type=int, default=8, help="training steps per measured window")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="checkpoint directory (default: a temporary one)")
    args = p.parse_args(argv)
    for name in ("dim", "layers", "experts", "seq", "batch", "window", "repeats"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be at least 1 (got {getattr(args, name)})", file=sys.stderr)
            return 2
    try:
        cfg = _model(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    root = args.out or work / "ckpt"
    dist.init_process_group("gloo", init_method=f"file://{work}/rdzv", rank=0, world_size=1,
                            timeout=timedelta(seconds=600))
    try:
        return _run(args, cfg, root)
    finally:
        dist.destroy_process_group()
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
        if ckpt is not None:  # as trainer.train does: the staged copy must be taken before the update
            c0 = time.perf_counter()
            ckpt.wait_for_staging()
            waited = time.perf_counter() - c0
        opt.step()
        opt.zero_grad(set_to_none=True)
        return waited

    step()  # optimizer state exists from here on: the checkpoint holds params + Adam moments
    state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
    state_mb += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                    if torch.is_tensor(v)) / 1e6
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
    results = {}
    for mode in ("sync", "async"):
        base, with_save, blocked = [], [], []
        for _ in range(args.repeats):
            base.append(window(None, sync=False)[0])
            total, b = window(ckpt, sync=mode == "sync")
            with_save.append(total)
            blocked.append(b)
        results[mode] = statistics.median(blocked)
        print(json.dumps({"bench": "checkpoint", "mode": mode, "state_mb": round(state_mb, 1),
                          "stall_s": round(results[mode], 4), "window_steps": args.window,
                          "window_s": round(statistics.median(base), 4),
                          "window_with_save_s": round(statistics.median(with_save), 4)}), flush=True)
    ratio = results["async"] / results["sync"] if results["sync"] > 0 else float("inf")
    print(json.dumps({"bench": "checkpoint", "async_over_sync_stall": round(ratio, 4), "goal": GOAL,
                      "met": ratio <= GOAL}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
