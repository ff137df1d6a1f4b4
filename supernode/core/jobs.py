"""A training job of the stack (issue 36, items 1 and 2): the job file and the job's own plan.

A job file names the job, its team and priority, and overrides the stack's model, parallel and
training sections and node count; `job_config` applies it to the stack and validates the result
with the stack's own schema and rules, so a job is valid exactly when the stack would be with its
keys, every problem reported at once with the job file's path (`model.dim`, `nodes.max`), exit 2.
`job_plan` then builds the job's Plan with the same planner against the stack's hardware, and
`refusals` names each figure that keeps it off the cluster (exit 1): memory, an elastic world with
no layout, or a grace period shorter than a step and a checkpoint write.

Jobs run on the stack's training node groups (the plan's instance type); a job asks for at most the
stack's training nodes. Where the stack declares teams (supernode:teams) the job's team is one of them
and the job asks at most what its team may ever get (its nominal quota + borrowing limit).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from .config import StackConfig, from_mapping
from .config.schema import ModelOverride, ParallelOverride, TrainingOverride, _Base, issues_from_validation
from .errors import ConfigError, Issue
from .inputs import MIB, InputError, load_yaml, read_bounded
from .layout import P
from .plan import Plan, build_plan
from .teams import NAME  # a job's name and its team's: one pattern (supernode.core.teams)

MAX_JOB_FILE_BYTES = MIB
PRIORITIES = ("low", "normal", "high")


class NodeRange(_Base):
    max: int = Field(ge=1, description="the job's training nodes (at most the stack's)")
    min: int | None = Field(
        default=None, ge=1, description="the fewest nodes the elastic job runs on (unset: not elastic)"
    )


class Branch(_Base):
    from_run: str = Field(min_length=1, description="the run whose checkpoint the job starts from")
    step: int = Field(ge=1, description="the step of that run the job starts from")


class JobSpec(_Base):
    """One training job on the stack's cluster: a name, a team and a priority, and the stack's
    sections it changes (a key left out keeps the stack's)."""

    name: str = Field(pattern=NAME, description="the job's name, unique in its team's namespace")
    team: str = Field(pattern=NAME, description="the team that owns the job and whose quota it uses")
    priority: Literal["low", "normal", "high"] = Field(
        default="normal", description="the job's queue priority: a higher one may preempt a lower one"
    )
    image: str | None = Field(default=None, min_length=1, description="the trainer image (default: the stack's)")
    nodes: NodeRange | None = Field(default=None, description="the job's node range (default: the stack's)")
    model: ModelOverride = Field(default=ModelOverride(), description="model keys overriding the stack's")  # type: ignore[valid-type]
    parallel: ParallelOverride = Field(  # type: ignore[valid-type]
        default=ParallelOverride(), description="parallel keys overriding the stack's"
    )
    training: TrainingOverride = Field(  # type: ignore[valid-type]
        default=TrainingOverride(), description="training keys overriding the stack's"
    )
    branch: Branch | None = Field(default=None, description="start from another run's step (fromRun, step)")


def read_job(path: Path) -> JobSpec:
    """A job file (YAML), validated: every problem at once with its key, ConfigError (exit 2)."""
    where = str(path)
    try:  # a job file is a few hundred bytes; bounded, without aliases or duplicate keys (supernode.core.inputs)
        data = load_yaml(read_bounded(path, MAX_JOB_FILE_BYTES, where), where)
    except InputError as e:
        raise ConfigError([Issue(path=where, message=str(e).removeprefix(f"{where}: "), missing=True)], where) from None
    return job_from_mapping(data, where)


def job_from_mapping(data: Any, source: str = "") -> JobSpec:
    if not isinstance(data, dict):
        raise ConfigError([Issue(path="job", value=data, message="expected a mapping (name, team, ...)")], source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        issues = issues_from_validation(e, "", data)
        raise ConfigError([i.model_copy(update={"path": i.path.lstrip(".")}) for i in issues], source) from None


def job_config(cfg: StackConfig, job: JobSpec, source: str = "") -> StackConfig:
    """The stack as the job runs it: its sections overridden by the job's keys and its training nodes
    the job's; validated by the stack's schema and rules, every problem named by its job-file key."""
    teams = [t.name for t in cfg.teams]
    if teams and job.team not in teams:  # a stack without teams takes any team name (no quota to check)
        raise ConfigError(
            [Issue(path="team", value=job.team, message=f"not one of the stack's teams ({', '.join(teams)})")],
            source,
        )
    data = cfg.to_mapping()
    for section in ("model", "parallel", "training"):
        data[section].update(getattr(job, section).model_dump(by_alias=True, exclude_none=True))
    issues: list[Issue] = []
    if job.nodes is not None:
        issues += _set_nodes(cfg, data, job)
    if job.image is not None:
        data["images"]["trainer"] = job.image
    if not issues:
        try:
            return from_mapping(data, source)
        except ConfigError as e:
            issues = [_job_issue(i) for i in e.issues]
    raise ConfigError(issues, source)


def _set_nodes(cfg: StackConfig, data: dict, job: JobSpec) -> list[Issue]:
    """The job's nodes on the stack's training groups, in their order; dpShard rescaled to the new
    world where the job does not set it (the other degrees kept)."""
    want = job.nodes.max
    if want > cfg.nodes:
        return [Issue(path="nodes.max", value=want, message=f"must be at most the stack's {cfg.nodes} training nodes")]
    low = job.nodes.min
    if low is not None and low > want:
        return [Issue(path="nodes.min", value=low, message=f"must be at most nodes.max ({want})")]
    left = want
    for group in data["acceleratorNodeGroups"]:
        if group["role"] == "training":
            group["nodes"], left = min(group["nodes"], left), left - min(group["nodes"], left)
    data["acceleratorNodeGroups"] = [g for g in data["acceleratorNodeGroups"] if g["role"] != "training" or g["nodes"]]
    data["training"]["minNodes"] = low
    if "dpShard" not in job.parallel.model_dump(by_alias=True, exclude_none=True):
        world = cfg.accelerators * want // cfg.nodes
        p = cfg.parallel.model_copy(update=job.parallel.model_dump(exclude_none=True))
        fixed = math.prod(p.factors(without="dp_shard").values())
        if world % fixed:
            return [
                Issue(
                    path="nodes.max",
                    value=want,
                    message=f"{world} ranks are not a multiple of the other degrees' {fixed}; set parallel.dpShard",
                )
            ]
        data["parallel"]["dpShard"] = p.degrees().rescaled(world).dp_shard
    return []


def _job_issue(issue: Issue) -> Issue:
    """A stack problem as the job file's key: `supernode:model.dim` is the job's `model.dim`; the
    training node groups and minNodes are the job's `nodes`."""
    path = issue.path.removeprefix(P)
    if path.startswith("acceleratorNodeGroups") or path == "training.minNodes":
        path = "nodes"
    return issue.model_copy(update={"path": path})


def job_plan(stack: str, cfg: StackConfig, job: JobSpec, root: str | Path = ".") -> Plan:
    """The job's Plan: the stack's planner on the job's config (`job_config`), as its team's (Plan.team)."""
    plan = build_plan(stack, job_config(cfg, job, f"job {job.name}"), root=root)
    return plan.model_copy(update={"team": job.team}) if cfg.teams else plan


def refusals(plan: Plan) -> list[str]:
    """Each figure that keeps the job off the cluster, named; empty when it may be submitted."""
    out = []
    if not plan.fits:
        out.append(
            f"memory: {plan.memory_per_rank_gib:.1f} GiB per rank is over the usable {plan.usable_hbm_gib:.1f} GiB "
            f"by {plan.over_by_gib:.1f} GiB"
        )
    out += [
        f"elastic: {e.nodes} nodes (world {e.world_size}) has no layout: {e.reason}"
        for e in plan.layouts
        if not e.fits and e.world_size != plan.world_size
    ]
    for pool in plan.teams:  # the job's devices in the pool against what its team may ever hold
        team = pool.team(plan.team or "")
        if team is not None and pool.stack_job_devices > team.max_devices:
            out.append(
                f"team quota: the job asks {pool.stack_job_devices} {pool.noun} ({plan.nodes} nodes), more than team "
                f"{team.name} may ever get: its nominal {team.nominal} + borrowing limit {team.borrowing_limit} = "
                f"{team.max_devices} {pool.noun} ({team.max_nodes} nodes)"
            )
    if plan.termination_grace_s < plan.termination_grace_needed_s:
        out.append(
            f"grace period: workload.terminationGraceS {plan.termination_grace_s} s is below the "
            f"{plan.termination_grace_needed_s} s a preempted pod needs (a step, a checkpoint write of "
            f"{plan.checkpoint.write_seconds:.0f} s and a margin)"
        )
    return out


# A job's states, both backends alike (the local store's and the PyTorchJob's with its Kueue Workload):
# queued (waiting for quota), running (admitted: holds its nodes), preempting (asked to stop for a higher
# priority job: it checkpoints, then is queued again), cancelling (asked to stop for good: it checkpoints,
# then is cancelled), and the three ends.
STATES = ("queued", "running", "preempting", "cancelling", "succeeded", "failed", "cancelled")
FINAL_STATES = ("succeeded", "failed", "cancelled")


class JobStatus(BaseModel):
    """One job as `supernode job list | describe` (and the management page) show it, from either
    backend: where it stands in the queue, what it holds, how far it is against its plan."""

    name: str
    team: str
    priority: str
    state: Literal["queued", "running", "preempting", "cancelling", "succeeded", "failed", "cancelled"]
    backend: Literal["local", "cluster"]
    submitted_at: float  # unix seconds
    queue_position: int | None = None  # 1 = admitted next; None once admitted or ended
    waited_s: float | None = None  # submitted (or last requeued) -> admitted, or -> now while queued
    nodes: int = 0  # nodes (local: processes) it holds now
    steps: int  # the plan's last step
    step: int | None = None  # the newest step in its metrics
    loss: float | None = None
    tokens_per_s: float | None = None
    plan_tokens_per_s: float | None = None
    last_checkpoint: int | None = None  # the step of its newest complete checkpoint
    run: str | None = None  # its run id (runs/<id>/run.json)
    parent: dict[str, Any] | None = None  # the run and step it branched from (run.json)
    preemptions: int = 0
    attempts: int = 0  # times it was admitted
    cost_usd: float | None = None  # nodes x hours held x the plan's hourly price (cluster)
    exit_code: int | None = None
    message: str = ""  # why it is where it is (refused, preempted by X, failed: ...)
