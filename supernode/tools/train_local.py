"""The local trainer's process (`supernode train --local`): `python -m supernode.trainer.launch --standalone
... -m supernode.trainer.train`, torchrun under the cluster's own launcher, whose exit code is the run's
outcome (a failure the workers recorded: 2 bad input, 1 failed), and the run's summary at the end.

The launcher runs in a session of its own that dies with this process (PR_SET_PDEATHSIG; the workers die
with it), and SIGINT/SIGTERM are forwarded to it: torchrun hands the signal to the workers, which finish
the step, checkpoint and stop; in start-up, the run just stops. Either way exit 130, no traceback. The
sibling of supernode.tools.serve, which does the same for a local server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from supernode.core.errors import EXIT_FAILED, EXIT_INTERRUPTED
from supernode.core.observability import JSONL, read_records  # a torn last line must not break the summary
from supernode.core.plan import Plan
from supernode.core.processes import die_with_parent
from supernode.core.runs import RunChoice


def launch_command(
    plan: Plan, plan_path: Path, data: Path, out: Path, steps: int, log_every: int, run: str
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "supernode.trainer.launch",
        "--standalone",
        "--nproc-per-node",
        str(plan.world_size),
        "--max-restarts",
        str(plan.training.max_restarts),
        "-m",
        "supernode.trainer.train",
        "--plan",
        str(plan_path),
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--run-id",
        run,
        "--log-every",
        str(log_every),
        "--progress",
        "--plots",
    ]


def _child_setup() -> None:
    """In supernode.trainer.launch, before exec: SIGKILL it when this process dies (it runs in its own session,
    so a kill of this process group would not reach it), and hold SIGINT/SIGTERM blocked until it
    has its handlers: a signal forwarded during Python's start-up then waits instead of becoming a
    KeyboardInterrupt traceback (or being lost)."""
    die_with_parent()
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))


def launch(
    stack: str,
    plan: Plan,
    plan_path: Path,
    data: Path,
    out: Path,
    steps: int,
    log_every: int,
    launcher_env: str,
    choice: RunChoice,
) -> int:
    """Run the launcher to the end of the run; its exit code (130 where a signal stopped it)."""
    m, d = plan.model, plan.degrees
    print(
        f"training {stack} (local): {plan.params.total / 1e6:.2f} M parameters ({m.layers} layers, dim {m.dim}, "
        f"{m.experts} experts top-{m.top_k}) on {plan.world_size} CPU processes, dp_shard {d.dp_shard} x tp {d.tp}, "
        f"ep {d.ep}; steps {steps} of {plan.training.steps}, checkpoint every {plan.training.checkpoint_interval}",
        flush=True,
    )
    # A restarted attempt must not read the dead attempt's addresses from a shared rendezvous store
    # (pytorch/pytorch#135712): without this, torchrun's restarts fail to connect.
    env = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        **{launcher_env: str(os.getpid())},  # the lock's holder: this process, on the run's behalf
    )
    started: list[subprocess.Popen] = []
    forwarded: list[int] = []

    def forward(signum, frame) -> None:
        if not forwarded:
            print(
                f"\n{signal.Signals(signum).name}: stopping (a step under way is finished and checkpointed)", flush=True
            )
        forwarded.append(signum)
        for proc in started:
            proc.send_signal(signum)

    # Installed before the launcher starts, so no moment drops a signal: one that comes before it
    # exists is sent as soon as it does (it waits, blocked, until supernode.trainer.launch can take it).
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Its own session: a Ctrl-C reaches only this process, which hands it to supernode.trainer.launch
        # (torchrun's agent), which hands it to the workers once they run.
        proc = subprocess.Popen(
            launch_command(plan, plan_path, data, out, steps, log_every, choice.run),
            env=env,
            start_new_session=True,
            preexec_fn=_child_setup,
        )
        started.append(proc)
        if forwarded:
            proc.send_signal(forwarded[-1])
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if rc < 0:  # killed by a signal supernode.trainer.launch does not handle (SIGKILL: out of memory?)
        print(f"training was killed by signal {-rc} ({signal.strsignal(-rc)})", file=sys.stderr, flush=True)
        return EXIT_FAILED
    if rc >= 128:  # supernode.trainer.launch stopped on a signal (exit 128 + it): interrupted, whichever
        return EXIT_INTERRUPTED
    if rc == 0:
        summary(choice.dir, plan, choice.checkpoints)
    return rc  # else a worker or torchrun printed why (2 bad input; 1 a failure)


def summary(out: Path, plan: Plan, checkpoints: Path | None = None) -> None:
    """`out`: the run's directory (its metrics and plots); `checkpoints`: its checkpoints."""
    records = read_records(out / JSONL)
    recs = [r for r in records if isinstance(r.get("loss"), (int, float))]
    # A step whose update was skipped (non-finite) has no loss: the summary must not hide it.
    skipped = sum(1 for r in records if r.get("skipped"))
    note = f"{skipped} non-finite step(s) skipped; " if skipped else ""
    if recs:
        first, last = recs[0], recs[-1]
        print(
            f"loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']}); {note}"
            f"{last['tokens_per_s']:,.0f} tokens/s; metrics {out / JSONL}, plots {out}/loss.png, "
            f"{out}/expert_load.png; checkpoints {checkpoints or out / 'checkpoints'}"
        )
        # The median step (the first one compiles and warms up) next to the plan's estimate: the same
        # ratio the trainer exports as supernode_train_step_time_over_plan for the drift alarm.
        timed = [r["step_s"] for r in recs if isinstance(r.get("step_s"), (int, float))]
        if not timed:
            return
        steps = sorted(timed[1:] or timed)
        measured = steps[len(steps) // 2]
        print(
            f"step time {measured:.3g} s measured (median) vs {plan.step.step_s:.3g} s planned: "
            f"x{measured / plan.step.step_s:.2f} of the plan"
            + (" (the local CPU run is not the plan's hardware)" if plan.local else "")
        )
