"""Training metrics: JSON lines, Prometheus exposition, a progress bar and end-of-run plots.

Only rank 0 writes. Per logged step: loss, lr, grad norm, tokens/s, achieved FLOP/s per rank
(`plan.flops_per_token` x tokens/s) and MFU against the catalog's dense bf16 peak (GPU only: a
CPU has no catalog peak, so MFU is null there), the step time split into compute / exposed
communication (comm_clock.py CommClock: a collective overlapped by compute counts as compute) / data
wait, and the expert load per MoE layer as max/mean token share (1.0 is a perfect balance;
experts / topK, the ceiling the plot marks, means every token went to the same topK experts).

Checkpoint age: `supernode_train_last_checkpoint_timestamp_seconds` is when the newest complete
checkpoint was committed (its COMPLETE marker's mtime; `..._step` its step), so age = now - it. It is
read from the checkpoints directory, the commit's own record, at start (a resumed run shows its
checkpoint at once) and with every logged step (an async save commits in a later step's poll): a
stat of the few step directories `keep` leaves, nothing next to a step's time. NaN until there is
one, so no age is shown for a run that never checkpointed.
"""

from __future__ import annotations

import errno
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Gauge, start_http_server, write_to_textfile

from supernode.core import observability as obs
from supernode.core.checkpoints import COMPLETE, complete_checkpoints
from supernode.core.errors import BadInput
from supernode.core.observability import JSONL, read_records
from supernode.core.plan import Plan

from .log import LOG, write_through

PROM, LOSS_PNG, LOAD_PNG = "metrics.prom", "loss.png", "expert_load.png"


def _finite_or_none(value):
    """JSON has no NaN/Infinity: a non-finite number is written as null (a diverged step stays parseable)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def load_imbalance(expert_load: torch.Tensor) -> list[float]:
    """max/mean token share per MoE layer from a [layers, experts] count tensor."""
    counts = expert_load.detach().double()
    mean = counts.mean(dim=1).clamp_min(1e-12)
    return [round(float(x), 4) for x in counts.max(dim=1).values / mean]


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int  # tokens of the global batch
    step_s: float
    compute_s: float
    comm_s: float
    data_s: float
    tokens_per_s: float
    flops_per_s_per_rank: float
    mfu: float | None
    expert_load_max_over_mean: list[float]
    time: float
    skipped: bool = False  # non-finite loss or gradient norm: the update was not applied


class Metrics:
    def __init__(
        self,
        out_dir: str | Path,
        plan: Plan,
        world_size: int,
        device_type: str,
        rank: int = 0,
        prometheus_port: int | None = None,
        progress: bool = False,
        total_steps: int = 0,
        start_step: int = 0,
        prometheus_addr: str = "127.0.0.1",
        checkpoints: Path | None = None,
    ):
        """`checkpoints`: the checkpointer's root, whose newest complete checkpoint the age gauges show."""
        self.out = Path(out_dir)
        self.checkpoints = checkpoints
        self.plan, self.world, self.rank = plan, world_size, rank
        self.peak = plan.hardware.peak_flops if device_type != "cpu" else None  # MFU on any accelerator
        self.records: list[StepRecord] = []
        self.checkpoint_step: int | None = None  # the newest complete checkpoint's (_checkpoint_gauges)
        self._line_at = time.monotonic()  # the last metrics line on stdout (one per METRICS_LINE_EVERY_S)
        self._progress = self._task = None
        self.http = None
        self._write_failed = False
        if rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        self.registry = CollectorRegistry()
        # The observability contract's gauges: the scrape, the alarms and the dashboard read them by these names.
        self.gauges = {
            m: Gauge(m.name, m.help, [m.label] if m.label else [], registry=self.registry) for m in obs.TRAINER_METRICS
        }
        self.gauges[obs.CHECKPOINT_TIME].set(float("nan"))
        self.gauges[obs.CHECKPOINT_STEP].set(float("nan"))
        self._checkpoint_gauges()
        if prometheus_port is not None:
            try:
                self.http, _ = start_http_server(prometheus_port, addr=prometheus_addr, registry=self.registry)
            except OSError as e:
                why = (
                    "is in use by another process" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
                )
                raise BadInput(
                    f"--prometheus-port {prometheus_port} on {prometheus_addr} {why}: pick another "
                    "port or stop what listens there"
                ) from None
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
            self._progress.start()
            console = self._progress.console
            write_through(lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))

    def _truncate_after(self, step: int) -> None:
        """A resumed run repeats the steps after its checkpoint: drop their old records (and a torn
        last line). Rewritten through a temporary file, so a failure here loses no record."""
        path = self.out / JSONL
        if not path.exists():
            return
        kept = [r for r in read_records(path) if r["step"] <= step]
        tmp = path.with_name(JSONL + ".tmp")
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            tmp.replace(path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._write_error(e)

    def _write_error(self, e: OSError) -> None:
        """Metrics are not worth a run: a failed write is reported once and training goes on."""
        if not self._write_failed:
            self._write_failed = True
            LOG.info(f"warning: metrics not written to {self.out} ({e.strerror or e}); training continues")

    def log(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float,
        tokens: int,
        step_s: float,
        compute_s: float,
        comm_s: float,
        data_s: float,
        expert_load: torch.Tensor | None,
        skipped: bool = False,
    ) -> StepRecord | None:
        if self.rank != 0:
            return None
        tps = tokens / step_s
        flops = self.plan.flops_per_token * tps / self.world
        rec = StepRecord(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens=tokens,
            step_s=step_s,
            compute_s=compute_s,
            comm_s=comm_s,
            data_s=data_s,
            tokens_per_s=tps,
            flops_per_s_per_rank=flops,
            mfu=flops / self.peak if self.peak else None,
            expert_load_max_over_mean=load_imbalance(expert_load) if expert_load is not None else [],
            time=time.time(),
            skipped=skipped,
        )
        self.records.append(rec)
        record = {k: _finite_or_none(v) for k, v in asdict(rec).items()}
        line = json.dumps(record, allow_nan=False) + "\n"
        try:
            with (self.out / JSONL).open("a", encoding="utf-8") as f:
                f.write(line)
            self._prometheus(rec)
        except OSError as e:
            self._write_error(e)
        if time.monotonic() - self._line_at >= obs.METRICS_LINE_EVERY_S:
            self._line_at = time.monotonic()
            extra = {"checkpoint_step": self.checkpoint_step}
            LOG.info(obs.TrainerLine.METRICS + json.dumps(record | extra, allow_nan=False))
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=f"loss {loss:.3f}  {tps:,.0f} tok/s")
        return rec

    def _prometheus(self, rec: StepRecord) -> None:
        mfu = rec.mfu if rec.mfu is not None else float("nan")
        for metric, value in (
            (obs.LOSS, rec.loss),
            (obs.LR, rec.lr),
            (obs.GRAD_NORM, rec.grad_norm),
            (obs.TOKENS_PER_S, rec.tokens_per_s),
            (obs.FLOPS_PER_S_PER_RANK, rec.flops_per_s_per_rank),
            (obs.MFU, mfu),
            (obs.STEP_SECONDS, rec.step_s),
            (obs.STEP, rec.step),
            (obs.STEP_OVER_PLAN, rec.step_s / self.plan.step.step_s),
        ):
            self.gauges[metric].set(value)
        for phase in ("compute", "comm", "data"):
            self.gauges[obs.PHASE_SECONDS].labels(phase).set(getattr(rec, phase + "_s"))
        for layer, v in enumerate(rec.expert_load_max_over_mean):
            self.gauges[obs.EXPERT_LOAD].labels(str(layer)).set(v)
        self._checkpoint_gauges()
        write_to_textfile(str(self.out / PROM), self.registry)

    def memory(self, measured: dict[str, int], planned: dict[str, int]) -> None:
        """Rank 0's memory by term beside the plan's (trainer/memory.py), as gauges and one
        message line, so a run shows where the plan's memory estimate is off."""
        if self.rank != 0:
            return
        for term, value in measured.items():
            self.gauges[obs.MEMORY_BYTES].labels(term).set(value)
            self.gauges[obs.PLAN_MEMORY_BYTES].labels(term).set(planned[term])
        LOG.info(
            "memory per rank, measured / plan: "
            + ", ".join(f"{t} {measured[t] / 2**20:,.1f} / {planned[t] / 2**20:,.1f} MiB" for t in measured)
        )

    def stall_restarts(self, count: int) -> None:
        if self.rank == 0:
            self.gauges[obs.STALL_RESTARTS].set(count)

    def checkpoint_stall(self, seconds: float) -> None:
        """How long the step's checkpoint save blocked training (an async save: the staging copy; a
        sync one: the whole write), the "checkpoint" phase; exported with the next step's figures."""
        if self.rank == 0:
            self.gauges[obs.PHASE_SECONDS].labels("checkpoint").set(seconds)

    def _checkpoint_gauges(self) -> None:
        """The newest complete checkpoint's commit time and step (unchanged when there is none)."""
        found = complete_checkpoints(self.checkpoints) if self.checkpoints is not None else []
        if found:
            step, path = found[-1]
            self.gauges[obs.CHECKPOINT_TIME].set((path / COMPLETE).stat().st_mtime)
            self.gauges[obs.CHECKPOINT_STEP].set(step)
            self.checkpoint_step = step

    def close(self, plots: bool = False) -> None:
        if self.rank != 0:
            return
        if self._progress is not None:
            self._progress.stop()
            write_through(None)
        # The run's last save commits after its step was logged (a sync save, or an async one that
        # ckpt.close() waited for): the file must end on that checkpoint, not the one before it.
        self._checkpoint_gauges()
        try:
            write_to_textfile(str(self.out / PROM), self.registry)
        except OSError as e:
            self._write_error(e)
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        if plots:
            try:
                plot(self.out / JSONL, self.out, load_ceiling(self.plan.model.experts, self.plan.model.top_k))
            except OSError as e:
                self._write_error(e)


def load_ceiling(experts: int, top_k: int) -> float:
    """The highest max/mean expert load top-k routing allows: an expert gets a token at most once, so
    at most 1/top_k of the routed slots, against a mean of 1/experts."""
    return experts / top_k


def expert_load_figure(recs: list[dict], ceiling: float | None = None):
    """The expert-load plot: max/mean per MoE layer by step, the balance (1) and, given, the top-k
    ceiling (`load_ceiling`), so a curve's distance from collapse can be read off."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for layer in range(len(recs[-1]["expert_load_max_over_mean"])):
        pts = [
            (r["step"], r["expert_load_max_over_mean"][layer])
            for r in recs
            if len(r["expert_load_max_over_mean"]) > layer
        ]
        ax.plot(*zip(*pts), label=f"MoE layer {layer}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    if ceiling is not None:
        ax.axhline(
            ceiling, color="red", linestyle=":", linewidth=1.0, label=f"top-k ceiling {ceiling:g} (experts / topK)"
        )
    ax.set(xlabel="step", ylabel="max / mean expert tokens", title="expert load (1 = balanced)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot(jsonl: Path, out_dir: Path, ceiling: float | None = None) -> list[Path]:
    """PNG plots of the loss and of the expert load (all records of the file, resumed runs included);
    `ceiling`: the expert load's top-k ceiling, marked on its plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_records(jsonl)
    if not recs:
        return []
    steps = [r["step"] for r in recs]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["loss"] for r in recs], marker=".")
    ax.set(xlabel="step", ylabel="loss", title="training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / LOSS_PNG, dpi=100)
    plt.close(fig)
    fig = expert_load_figure(recs, ceiling)
    fig.savefig(out_dir / LOAD_PNG, dpi=100)
    plt.close(fig)
    return [out_dir / LOSS_PNG, out_dir / LOAD_PNG]
