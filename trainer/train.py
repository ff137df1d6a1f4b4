"""The training loop, run under torchrun: the Plan decides the model, the layout and the schedule.

    torchrun --nproc-per-node N --max-restarts R -m supernode.trainer.train --plan plan.json --data DIR --out DIR

Every start resumes its run (supernode.core.runs: OUT/runs/<run id>/, `--run-id`, default the latest)
from its latest complete checkpoint, so when a rank dies and torchrun restarts the workers (up to
--max-restarts, from `training.max_restarts`), the job continues by itself. `--run-id NAME --from-run R
--step N` starts run NAME from run R's step N (weights, optimizer, data position). `--steps N`
stops after step N; the LR schedule always spans the plan's `training.steps`, so a run stopped and
resumed follows the same curve as one that never stopped. SIGTERM (torchrun forwards it; Kubernetes
sends it before eviction) and SIGINT finish the step, save a checkpoint and exit. Launch torchrun
with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the shared rendezvous store a restarted attempt
reads the failed attempt's addresses and cannot connect (pytorch/pytorch#135712).

Failures are classified. Bad input (plan, data, --steps, a checkpoint of another model or none that
verifies, an out directory another run holds), a full disk and a diverged run (non-finite loss for
`training.maxNonFiniteSteps` steps, or a run that ends on skipped steps) cannot be cured by a
restart: rank 0 prints one message and records it for the launcher (OUT/.exit-<run key>.json,
supernode.trainer.launch), and a worker torchrun restarts into the same run exits at once with the recorded
code. Anything else (a lost peer, a timeout) raises, and torchrun restarts the workers. Under a
launcher (SUPERNODE_LAUNCHER_PID set) workers exit 0 after recording, so torchrun neither restarts
nor prints a traceback, and the launcher exits with the recorded code.

No checkpoint is ever written of a step whose update was skipped (non-finite): its weights are an
earlier step's, so the run's latest checkpoint stays the last one trained through.

Exit codes: 0 done (or stopped by SIGTERM); 1 failure (full disk, divergence, a non-finite last
step); 2 bad input; 130 SIGINT.
"""

# ruff: noqa: E402 (the imports follow a worker's signal set-up)
from __future__ import annotations

import signal

if __name__ == "__main__":
    # A worker. torchrun forwards SIGINT/SIGTERM when it stops the run: until StopRequest is armed
    # at the first step, either signal ends this worker quietly by its default action (nothing
    # trained yet to save), not in a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import argparse
import json
import os
import socket
import sys
import time
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from supernode.core.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, BadInput, bad_input_lines
from supernode.core.faults import inject
from supernode.core.observability import PROFILE_EVERY, TrainerLine
from supernode.core.outdir import OutDirLock
from supernode.core.plan import Plan
from supernode.core.pretrained import is_remote
from supernode.core.processes import die_with_parent
from supernode.core.runs import RunChoice, prepare_run

from .checkpoint import CheckpointCorrupt, NoSpace
from .comm_clock import CommClock
from .device import choose, synchronize
from .divergence import Divergence, NonFinite
from .engine import Trainer
from .launch import AGENT_ENV, LAUNCHER_ENV, RUN_KEY_ENV, Heartbeat, exit_file, stall_count
from .log import LOG, setup
from .memory import measured_terms, planned_terms
from .metrics import Metrics
from .parallel import checked_layout, renumber_by_domain


def sampled(step: int, start: int, steps: int, log_every: int, profile_every: int) -> tuple[bool, bool]:
    """(logged, profiled) for a step: metrics every log_every steps, the profiler on the logged steps that
    are also one in profile_every; both on a run's first and last step, so every run shows where its
    loss and its communication share started and ended."""
    ends = step in (start + 1, steps)
    logged = step % log_every == 0 or ends
    return logged, logged and (step % profile_every == 0 or ends)


class StopRequest:
    """From the first step, SIGTERM and SIGINT set a flag; the loop acts on it at a step boundary,
    agreed by all ranks (no KeyboardInterrupt: Ctrl-C must not tear a step or a save apart).

    Before `arm()` the signals keep their default action, which the kernel carries out even while
    this rank waits in C++ (the process group's rendezvous, a restore's reads): a flag would only
    be read once that returns, and a peer the same signal ended while still importing torch never
    comes, so the rank would wait out the collective timeout (or torchrun's shutdown timeout) for
    a stop that has nothing to save."""

    def __init__(self) -> None:
        self.term = self.interrupt = False

    def arm(self) -> None:
        signal.signal(signal.SIGTERM, self._handler)
        signal.signal(signal.SIGINT, self._handler)

    @property
    def requested(self) -> int | None:
        """The signal asked for, if any (SIGINT over SIGTERM, as the loop reads them)."""
        return signal.SIGINT if self.interrupt else signal.SIGTERM if self.term else None

    def _handler(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            self.interrupt = True
        else:
            self.term = True


def _die_with_parent() -> None:
    """torchrun starts workers in a session of their own, so a SIGKILL to the launcher's process
    group would orphan them: this worker dies with its parent, the agent (supernode.trainer.launch
    names it, so a worker that starts after the agent died exits; a plain torchrun: its parent now)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        agent = os.environ.get(AGENT_ENV, "")
        die_with_parent(int(agent) if agent.isdigit() else None)


# -- outcomes that a restart cannot change ----------------------------------------------------


def _classify(exc: BaseException) -> tuple[int, list[str]] | None:
    """(exit code, lines) for a failure a restart would only repeat; None for a transient one."""
    lines = bad_input_lines(exc)
    if lines is not None:
        return EXIT_BAD_INPUT, lines
    if isinstance(exc, CheckpointCorrupt):
        return EXIT_BAD_INPUT, [f"error: {exc}"]
    if isinstance(exc, (NoSpace, NonFinite)):
        return EXIT_FAILED, [f"error: {exc}"]
    return None


def _run_key() -> str | None:
    """The key this worker's outcome is recorded under: its launcher's, else torchrun's run id
    (plain torchrun: its restarts still stop at a recorded failure); None alone, where nothing restarts."""
    return os.environ.get(RUN_KEY_ENV) or os.environ.get("TORCHELASTIC_RUN_ID")


# The run keys of every node's launcher, once the process group has formed (`_learn_run_keys`):
# rank 0 records an outcome under each, so a peer that saw only the broken connection finds it,
# and so does every node's launcher.
_run_keys: list[str] = []


def _learn_run_keys() -> None:
    keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(keys, _run_key())
    _run_keys[:] = sorted({k for k in keys if k})


def _recorded(out: Path) -> dict | None:
    """The outcome recorded for this worker's launcher (or torchrun run), if any."""
    key = _run_key()
    try:
        rec = json.loads(exit_file(out, key).read_text(encoding="utf-8")) if key else None
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


_reported = False


def _report(out: Path, code: int, lines: list[str], to_stderr: bool = True) -> None:
    """Rank 0 prints the lines once. One rank per node records the outcome, for restarts and the
    launchers: rank 0 under every node's launcher key, each other node's first rank under its own
    (a failure before the process group formed, which every rank meets alike). Not every rank: a
    sibling's record would stop rank 0 at its start (main's check for a finished run) unprinted."""
    global _reported
    if _reported:
        return
    _reported = True
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print("\n".join(lines), file=sys.stderr if to_stderr else sys.stdout, flush=True)
    own = _run_key()
    keys = set(_run_keys) if rank0 else set()
    if own and os.environ.get("LOCAL_RANK", "0") == "0":
        keys.add(own)
    record = json.dumps({"code": code, "lines": lines, "pid": os.getpid(), "host": socket.gethostname()})
    for key in sorted(keys):
        path = exit_file(out, key)
        tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # one per writer
        try:
            out.mkdir(parents=True, exist_ok=True)
            tmp.write_text(record, encoding="utf-8")
            tmp.replace(path)
        except OSError:
            pass  # the message is printed; only a restart's shortcut is lost


def _exit_code(code: int) -> int:
    """Under the launcher every recorded outcome exits 0: torchrun then neither restarts nor
    prints a traceback, and the launcher exits with the recorded code."""
    return EXIT_OK if os.environ.get(LAUNCHER_ENV) else code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m supernode.trainer.train", description=__doc__.split("\n")[0])
    p.add_argument(
        "--plan", type=Path, required=True, help="plan JSON (supernode plan --json --full, or the ConfigMap)"
    )
    p.add_argument("--data", type=Path, required=True, help="directory with manifest.json and token shards")
    p.add_argument(
        "--out", type=Path, required=True, help="its runs go here: runs/<run id>/ (run.json, checkpoints/, metrics)"
    )
    p.add_argument("--steps", type=int, default=None, help="stop after this step (default: the plan's steps)")
    # Not --run: torchrun's parser would take it for an abbreviation of its own --run-path, even after -m.
    p.add_argument("--run-id", default=None, help="the run to resume, or a new run's name (default: the latest run)")
    p.add_argument(
        "--from-run", default=None, help="with --step and --run-id NAME: run NAME starts from this run's step"
    )
    p.add_argument("--step", type=int, default=None, help="the step of --from-run to start from")
    p.add_argument("--log-every", type=int, default=1, help="metrics every N steps (cheap counters)")
    p.add_argument(
        "--profile-every",
        type=int,
        default=PROFILE_EVERY,
        help=f"torch.profiler on one logged step in N (default {PROFILE_EVERY}; also the first and last): the "
        "exposed-communication share it measures stands for the logged steps until the next sample",
    )
    p.add_argument("--sync-checkpoint", action="store_true", help="blocking saves instead of async")
    p.add_argument("--prometheus-port", type=int, default=None, help="serve /metrics on this port (rank 0)")
    p.add_argument(
        "--prometheus-addr",
        default="127.0.0.1",
        help="address /metrics listens on (default loopback; in a pod, its IP)",
    )
    p.add_argument("--progress", action="store_true", help="rich progress bar (rank 0)")
    p.add_argument("--plots", action="store_true", help="PNG plots of loss and expert load at the end")
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="the local copy of training.initFrom (default: its path; an s3:// one is downloaded and verified "
        "by the cluster job's init container, which passes this)",
    )
    return p


def train(args: argparse.Namespace, stop: StopRequest) -> int:
    planned = Plan.read(args.plan)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # The plan's accelerator picks device and backend (supernode.trainer.device); a local plan runs on
    # what the host has.
    choice = choose(planned.device)
    # The core's layout validator on the planned layout, before any collective: a mismatch must not
    # hang. tp stays in a node. Then the layout for the world this job got (an elastic job restarted
    # on fewer or more nodes): the plan's, never one computed here; BadInput if it has none.
    checked_layout(planned, planned.world_size, planned.accelerators_per_node if choice.accelerated else None)
    plan = planned.for_world(world)
    t, steps = plan.training, args.steps or plan.training.steps
    if steps < 1:
        raise BadInput(f"--steps must be at least 1 (got {steps})")
    for flag in ("log_every", "profile_every"):
        if getattr(args, flag) < 1:
            raise BadInput(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    device, backend, timeout = choice.device, choice.backend, timedelta(seconds=t.collective_timeout_s)
    heartbeat = Heartbeat(t.stall_restart_s)  # from here on a worker that stops progressing is restarted
    heartbeat.beat("start")
    dist.init_process_group(backend, timeout=timeout)
    setup(dist.get_rank())  # rank 0's lines on stdout; the other ranks quiet
    heartbeat.beat("the process group")
    lock = OutDirLock(args.out)
    try:
        LOG.info(layout_line(planned, plan))
        _learn_run_keys()
        renumber_by_domain(world, plan.layout.placement, backend, timeout)
        _own_out_dir(args.out, lock)
        return _run(args, plan, steps, device, stop, _select_run(args, plan), heartbeat)
    except Exception as e:
        outcome = _classify(e)
        if outcome is not None:  # recorded before the process group goes, so peers that fail on
            _report(args.out, *outcome)  # the broken connection find it and stay quiet
        raise
    finally:
        heartbeat.stop()
        dist.destroy_process_group()
        lock.release()


def layout_line(planned: Plan, plan: Plan) -> str:
    """What rank 0 says at the start: the layout for the world this job got, and whether that is
    an elastic one (another world than planned: the same global batch, by more or fewer rounds)."""
    d = plan.degrees
    degrees = f"dp_replicate {d.dp_replicate}, dp_shard {d.dp_shard}, tp {d.tp}, ep {d.ep}, pp {d.pp}"
    nodes = "" if plan.local else f"{plan.nodes} node(s), "
    line = (
        f"layout for world {plan.world_size} ({nodes}{plan.world_size} rank(s)): {degrees}; "
        f"{plan.micro_batches_per_step} micro-batch(es) per step per rank, {plan.padded_micro_batches} padded; "
        f"global batch {plan.training.global_batch} kept"
    )
    if plan is planned:
        return line
    return f"{line}; elastic: the plan's world is {planned.world_size} ({planned.micro_batches_per_step} per rank)"


def _own_out_dir(out: Path, lock: OutDirLock) -> None:
    """One run per out directory (else two runs interleave checkpoints and metrics). Rank 0 takes
    the lock; the launcher (`supernode train`) may hold it on this run's behalf."""
    holder = None
    if dist.get_rank() == 0:
        holder = lock.acquire()
        if holder is not None:
            pid, host = OutDirLock.holder_pid(out)
            if pid is not None and str(pid) == os.environ.get(LAUNCHER_ENV) and host == socket.gethostname():
                holder = None
    found = [holder]
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        raise BadInput(
            f"--out {out} is in use by another run ({found[0]}); wait for it to end, or train into another --out"
        )


def _select_run(args: argparse.Namespace, plan: Plan) -> RunChoice:
    """Rank 0 picks (and creates) the run under OUT's lock; every rank trains into the same one."""
    picked: list = [None]
    if dist.get_rank() == 0:
        try:
            picked[0] = prepare_run(
                args.out,
                plan.stack,
                plan.model.model_dump(mode="json"),
                args.run_id,
                args.from_run,
                args.step,
                say=LOG.info,
                run_flag="--run-id",
            )
        except BadInput as e:
            picked[0] = str(e)
    dist.broadcast_object_list(picked, src=0)
    if isinstance(picked[0], str):
        raise BadInput(picked[0])
    return picked[0]


def _run(
    args: argparse.Namespace,
    plan: Plan,
    steps: int,
    device: torch.device,
    stop: StopRequest,
    run: RunChoice,
    heartbeat: Heartbeat,
) -> int:
    LOG.info(run.line())
    trainer = Trainer(plan, device, args.data, run.dir, plan.training.async_checkpoint and not args.sync_checkpoint)
    metrics: Metrics | None = None
    step = 0
    with ExitStack() as cleanup:  # unwound in reverse: the checkpointer's last save commits, then metrics close
        cleanup.callback(lambda: metrics is not None and metrics.close(plots=args.plots and step == steps))
        ckpt = cleanup.enter_context(trainer.checkpointer)
        if run.parent_step is not None:
            ckpt.branch(run.parent_step)
        heartbeat.beat("the model build")
        start = step = _restore(trainer, args, plan, run, steps)
        heartbeat.beat(f"the restore (step {start})")
        if start == steps:
            LOG.info(
                f"run {run.run} in {args.out} is already at step {start}: nothing to train (give a larger --steps)"
            )
            return EXIT_OK
        metrics = _open_metrics(args, plan, run, trainer, steps, start)
        loop = _Steps(args, trainer, metrics, stop, heartbeat, start, steps)
        stop.arm()
        for step in range(start + 1, steps + 1):
            code = loop.step(step)
            if code is not None:
                return code
        return EXIT_OK


def _restore(trainer: Trainer, args: argparse.Namespace, plan: Plan, run: RunChoice, steps: int) -> int:
    """The step this start resumes from (its checkpoint, a parent run's, or step 0's weights: initFrom)."""
    start, changed = trainer.restore()
    if start > steps:
        raise BadInput(
            f"--steps {steps}: run {run.run} in {args.out} is already at step {start}; give --steps above "
            f"{start} to train on, or start a fresh run (--run new)"
        )
    if changed:
        LOG.info(changed)
    if start == 0 and plan.training.init_from:  # a checkpoint of the run wins: its weights are further along
        _init_from(trainer, plan, args.init_from)
    return start


def _open_metrics(
    args: argparse.Namespace, plan: Plan, run: RunChoice, trainer: Trainer, steps: int, start: int
) -> Metrics:
    """The run's metrics (each run its own: a fresh run or a branch must not rewrite another's), and the
    lines a start says: earlier stalls, a restart hazard, where it starts."""
    world, device = dist.get_world_size(), trainer.device
    metrics = Metrics(
        run.dir,
        plan,
        world,
        device.type,
        dist.get_rank(),
        args.prometheus_port,
        progress=args.progress,
        total_steps=steps,
        start_step=start,
        prometheus_addr=args.prometheus_addr,
        checkpoints=trainer.checkpointer.root,  # the checkpoint-age gauges follow its commits
    )
    stalls = stall_count(args.out)
    metrics.stall_restarts(stalls)
    if stalls:
        LOG.info(f"{stalls} stalled worker(s) restarted in {args.out} so far ({args.out}/stalls.jsonl)")
    if (
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"
    ):
        LOG.info(
            "warning: torchrun restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, "
            "else a restarted attempt reads stale addresses (pytorch/pytorch#135712) and cannot connect"
        )
    LOG.info(
        f"{f'{TrainerLine.RESUMED} {start}' if start else TrainerLine.STARTED}; "
        f"training to step {steps} on {world} {device.type} rank(s), layout {plan.degrees.model_dump()}"
    )
    return metrics


class _Steps:
    """The steps of one start, each asked in turn (`step`): train, measure, log, count a skipped update,
    save when due, act on a stop. What they share: the divergence streak, the latest sampled
    communication share, the test hooks (read once)."""

    def __init__(
        self,
        args: argparse.Namespace,
        trainer: Trainer,
        metrics: Metrics,
        stop: StopRequest,
        heartbeat: Heartbeat,
        start: int,
        steps: int,
    ) -> None:
        self.args, self.trainer, self.metrics, self.stop, self.heartbeat = args, trainer, metrics, stop, heartbeat
        self.start, self.steps = start, steps
        plan = trainer.plan
        self.divergence = Divergence(plan.training.max_non_finite_steps)
        self.comm_share = 0.0
        self.tokens_per_step = plan.training.global_batch * plan.model.seq_len
        # Test hooks: the loss (and so every gradient) is NaN from this step on; the first attempt hangs
        # at this step outside any collective (the restarted one does not).
        self.nan_from = int(inject("nan") or 0)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.stall_at = int(inject("stall") or 0) if first_attempt else 0

    def step(self, step: int) -> int | None:
        """Run step `step`; the exit code where the run ends here (a stop), None to go on."""
        trainer, metrics, ckpt, device = self.trainer, self.metrics, self.trainer.checkpointer, self.trainer.device
        # Also the first and last steps, so a run always shows where its loss started and ended.
        logged, profiled = sampled(step, self.start, self.steps, self.args.log_every, self.args.profile_every)
        t0 = time.perf_counter()
        while step == self.stall_at:
            time.sleep(3600)
        micro = trainer.loader.next_step()
        data_s = time.perf_counter() - t0
        poison = bool(self.nan_from) and step >= self.nan_from
        with CommClock(profiled, cuda=device.type == "cuda") as clock:
            r = trainer.train_step(micro, self.stop.term, self.stop.interrupt, poison=poison)
            synchronize(device)  # the step's time includes its queued device work
        step_s = time.perf_counter() - t0
        if step == self.start + 1:  # the first update allocated the optimizer state: the terms are all there
            metrics.memory(measured_terms(trainer.model, trainer.optimizer, device), planned_terms(trainer.plan))
        ckpt.poll()
        self.heartbeat.beat(f"step {step}")
        if profiled:
            self.comm_share = clock.seconds() / step_s
        if logged or r.skipped:
            comm_s = self.comm_share * step_s  # measured on this step, or the latest sampled share
            metrics.log(
                step,
                loss=r.loss,
                lr=trainer.scheduler.get_last_lr()[0],
                grad_norm=r.grad_norm,
                tokens=self.tokens_per_step,
                step_s=step_s,
                compute_s=max(0.0, step_s - data_s - comm_s),
                comm_s=comm_s,
                data_s=data_s,
                expert_load=None if r.skipped else trainer.expert_load(),
                skipped=r.skipped,
            )
        divergence = self.divergence
        divergence.count(step, r.loss, r.grad_norm, r.skipped)
        stopping, last = r.stop_term or r.stop_interrupt, step == self.steps
        divergence.check(step, ckpt.last_saved, last)
        saved = ckpt.maybe_save(step, last, stopping, trained=not divergence.streak)
        if saved:
            metrics.checkpoint_stall(ckpt.last_stall_s)
            LOG.info(
                f"step {step}: loss {r.loss:.4f}{TrainerLine.CHECKPOINT}"
                f"{'written' if stopping or last else 'started (async)'}, "
                f"training blocked {ckpt.last_stall_s * 1e3:.0f} ms"
            )
        if not stopping:
            return None
        why = "" if saved else f" ({divergence.skipped(step)} not finite; {divergence.kept(ckpt.last_saved)})"
        if r.stop_interrupt:
            done = "checkpoint written" if saved else "no checkpoint written"
            lines = [f"interrupted at step {step}; {done}{why}; run again to resume"]
            _report(self.args.out, EXIT_INTERRUPTED, lines, to_stderr=False)
            return EXIT_INTERRUPTED
        done = "with a checkpoint" if saved else "without a checkpoint"
        LOG.info(f"SIGTERM: stopped after step {step} {done}{why}; run again to resume")
        return EXIT_OK


def _init_from(trainer: Trainer, plan: Plan, local_copy: Path | None) -> None:
    """Step 0's weights from the pretrained directory (verified first); the optimizer and the data
    position start fresh, as they would from a random initialisation."""
    from .hf.load import load_pretrained

    source = plan.training.init_from
    if local_copy is None and is_remote(source):
        raise BadInput(
            f"training.initFrom {source}: an s3:// prefix is read from a local copy; download it "
            f"(aws s3 sync {source} DIR) and pass --init-from DIR"
        )
    directory = local_copy or Path(source)
    if not directory.is_dir():
        raise BadInput(f"training.initFrom {directory}: not a directory")
    t0 = time.perf_counter()
    load_pretrained(
        trainer.model, plan.model, directory, plan.training.init_from_sha256, "local.model" if plan.local else "model"
    )
    LOG.info(f"step 0 starts from the weights in {directory} (verified, loaded in {time.perf_counter() - t0:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    stop = StopRequest()
    args = build_parser().parse_args(argv)
    earlier = _recorded(args.out)
    if earlier is not None and earlier.get("code"):  # torchrun restarted us into a run that already ended
        return _exit_code(int(earlier["code"]))
    try:
        code = train(args, stop)
    except Exception as e:
        outcome = _classify(e)
        if outcome is None:
            earlier = _recorded(args.out)
            if earlier is not None and earlier.get("code"):  # a peer stopped the run; this rank saw only
                return _exit_code(int(earlier["code"]))  # the broken connection
            if stop.requested is not None:  # a peer the same stop ended before it armed its StopRequest
                name = signal.Signals(stop.requested).name
                print(f"{name}: stopped before the ranks could agree on a step to checkpoint", file=sys.stderr)
                return 128 + stop.requested
            raise  # transient (a lost peer, a timeout): torchrun restarts the workers
        _report(args.out, *outcome)
        return _exit_code(outcome[0])
    return _exit_code(code)


if __name__ == "__main__":
    sys.exit(main())
