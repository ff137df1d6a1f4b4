"""How training and serving share the accelerators: the pool arithmetic (issue 26, item 1).

A pool is the accelerator nodes of one accelerator (the Kueue ResourceFlavors of
components/k8s/queues.py). Its node groups are either training's (`role: training`, the
job's world) or serving's reserved share (`role: serving`). The arithmetic that must hold, so that
neither starves the other (docs/architecture.md, "How training and serving share the accelerators"):

- training's minimum + serving's minimum <= the pool's devices;
- training's maximum fits training's share less its spares, serving's minimum fits serving's
  share, so serving's `replicasMin` never needs a device training runs on;
- serving's scale-out beyond its share borrows only what training lends: its share less its
  spares and its minimum (`training_lending_limit`), which Kueue's reclaimWithinCohort takes back
  when training needs it, so a preempted or waiting training job is re-admitted without a person;
- training borrows serving's idle share, preemptibly: serving lends its share less its minimum
  (`serving_lending_limit`) and takes it back the same way when it scales out;
- no device is unreachable (`stranded` 0, issue 38): training's queue admits any job of whole nodes,
  so its share is always reachable; every device of serving's share is serving's at its maximum or on
  a whole serving node that training's whole-node pods may borrow. A serving share beyond serving's
  maximum by less than a node (one p5 for 2 replicas x tp 1: 6 GPUs) is stranded.

Training's maximum is the plan's world; its minimum the world at `training.minNodes` (the elastic
job's minReplicas, supernode.core.estimate), equal to the maximum when the job is not elastic. Spare
nodes (`spares` of a training group) are in the pool and in training's share, so the quota is the
hardware bought, but never lent: they stand by to replace a failed node at once. Devices are the
accelerator device resource the pods request (GPUs; Neuron devices on Trainium, where one device is
several ranks).

Pure: the Plan carries the result (`Plan.pools`); the Kueue quotas and the `pools-add-up` policy
read it and never recompute it.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from .catalog import CATALOG
from .config import StackConfig
from .inference import InferencePlan

# Every accelerator node carries its group's role (training | serving) in this label
# (components/aws/accelerators.py); Kueue's flavors select on it, the policies read it.
ROLE_LABEL = "supernode.io/gpu-role"


class Pool(BaseModel):
    model_config = ConfigDict(frozen=True)

    accelerator: str  # the pool's nodes' supernode.io/accelerator label
    device_resource: str  # what the pods request: nvidia.com/gpu, aws.amazon.com/neurondevice
    training_nodes: int
    serving_nodes: int
    devices: int  # the pool: every node x its devices (the catalog's)
    training_devices: int  # training's share: the training groups' devices, spares included
    spare_devices: int  # of training's share, the spare nodes' devices: never lent, never in the world
    serving_devices: int  # serving's reserved share: the serving groups' devices
    # Training's devices: the plan's world in devices (max) and its world at training.minNodes (min).
    training_min: int
    training_max: int
    # Serving's devices: replicasMin/Max x devices per replica (tp x pp); 0 without an inference plan.
    serving_per_replica: int
    serving_replicas_min: int
    serving_replicas_max: int
    serving_min: int
    serving_max: int
    # Kueue's figures (queues.py writes them as they are): what training may lend (its share less its
    # spares and its minimum: what an elastic job can give up, never a spare), what serving may
    # borrow (its maximum beyond its share, capped by what is lent), and so the most serving can run.
    training_lending_limit: int
    serving_borrowing_limit: int
    serving_reachable_max: int
    # And the other way (preemptible: serving reclaims it): serving lends its share less its minimum,
    # which training's queue may borrow (in whole serving nodes, as its pods are whole nodes).
    serving_lending_limit: int
    training_borrowing_limit: int
    # Devices no workload can ever use at once (see the module's docstring); stranded_reason says which.
    stranded: int
    stranded_reason: str
    fits: bool  # the minimums and training's maximum fit their shares
    adds_up: bool  # fits, and nothing stranded
    reason: str  # the arithmetic in one line, with the numbers; on failure what does not fit

    @property
    def noun(self) -> str:
        return device_noun(self.device_resource)


def device_noun(device_resource: str) -> str:
    return "GPUs" if device_resource == "nvidia.com/gpu" else "devices"


def _pool(
    accelerator: str,
    device_resource: str,
    nodes: dict[str, int],
    shares: dict[str, int],
    training_needed: tuple[int, int],
    serving: InferencePlan | None,
) -> Pool:
    training_devices, serving_devices, spares = shares["training"], shares["serving"], shares["spares"]
    devices = training_devices + serving_devices
    t_min, t_max = training_needed
    per_replica = serving.gpus_per_replica if serving else 0
    r_min, r_max = (serving.replicas_min, serving.replicas_max) if serving else (0, 0)
    s_min, s_max = r_min * per_replica, r_max * per_replica
    lend = max(0, training_devices - spares - t_min)
    borrow = min(max(0, s_max - serving_devices), lend)
    reachable = min(s_max, serving_devices + borrow)
    serving_lend = max(0, serving_devices - s_min)
    noun = device_noun(device_resource)
    stranded, stranded_reason = _stranded(nodes, shares, (r_max, per_replica), noun)
    sums = f"training min {t_min} + serving min {s_min} = {t_min + s_min}"
    problems = []
    if t_min + s_min > devices:
        problems.append(f"{sums} > {devices}")
    if t_max > training_devices - spares:
        problems.append(
            f"training max {t_max} > training's share {training_devices}"
            + (f" less its {spares} spare {noun}" if spares else "")
        )
    if s_min > serving_devices:
        problems.append(
            f"serving min {r_min} x {per_replica} = {s_min} > serving's reserved share {serving_devices} "
            f"({nodes['serving']} serving nodes): serving's minimum would need training's devices"
        )
    spare_nodes = f" + {nodes['spares']} spare" if nodes["spares"] else ""
    head = (
        f"pool {accelerator}: {devices} {noun} ({nodes['training'] - nodes['spares']} training{spare_nodes} + "
        f"{nodes['serving']} serving nodes)"
    )
    if problems:
        reason = f"{head}; " + "; ".join(problems + ([stranded_reason] if stranded else []))
    elif stranded:
        reason = f"{head}; {sums} <= {devices}; {stranded_reason}"
    else:
        reason = f"{head}; {sums} <= {devices}"
        if lend:
            reason += f"; training lends {training_devices - spares} - {t_min} = {lend}"
        if s_max:
            reason += f"; serving max {r_max} x {per_replica} = {s_max}, reachable {reachable}"
            if reachable < s_max:
                reason += (
                    f" (its share {serving_devices} + lent {borrow}: replicas above {reachable // per_replica} wait)"
                )
        if serving_lend and nodes["serving"]:
            reason += f"; serving lends {serving_devices} - {s_min} = {serving_lend} (preemptible)"
        reason += f"; every one of the {devices} {noun} reachable"
    return Pool(
        accelerator=accelerator,
        device_resource=device_resource,
        training_nodes=nodes["training"],
        serving_nodes=nodes["serving"],
        devices=devices,
        training_devices=training_devices,
        spare_devices=spares,
        serving_devices=serving_devices,
        training_min=t_min,
        training_max=t_max,
        serving_per_replica=per_replica,
        serving_replicas_min=r_min,
        serving_replicas_max=r_max,
        serving_min=s_min,
        serving_max=s_max,
        training_lending_limit=lend,
        serving_borrowing_limit=borrow,
        serving_reachable_max=reachable,
        serving_lending_limit=serving_lend,
        training_borrowing_limit=serving_lend,
        stranded=stranded,
        stranded_reason=stranded_reason,
        fits=not problems,
        adds_up=not problems and not stranded,
        reason=reason,
    )


def _stranded(
    nodes: dict[str, int], shares: dict[str, int], serving_max: tuple[int, int], noun: str
) -> tuple[int, str]:
    """The devices no workload can ever use, and why: those of serving's share beyond serving's maximum
    that are not whole serving nodes a training pod (one whole training node) could borrow. Training's
    share has none: its queue admits any job of whole nodes, the stack's world is the share (the
    accelerators-match-world-size policy) and its spares stand by."""
    r_max, per_replica = serving_max
    s_max = r_max * per_replica
    t_per_node = shares["training"] // nodes["training"]
    s_per_node = shares["serving"] // nodes["serving"] if nodes["serving"] else 0
    idle = max(0, shares["serving"] - s_max)
    lendable_nodes = idle // s_per_node if s_per_node == t_per_node else 0
    stranded = idle - lendable_nodes * s_per_node
    if not stranded:
        return 0, ""
    need = math.ceil(s_max / s_per_node)
    fixes = [f"{need} serving nodes"] if need < nodes["serving"] else []
    fixes += [f"supernode:inference.replicasMax {shares['serving'] // per_replica}"] if per_replica else []
    return stranded, (
        f"{stranded} {noun} unreachable: {stranded} of serving's share {shares['serving']} ({nodes['serving']} "
        f"serving nodes of {s_per_node}): serving max {r_max} x {per_replica} = {s_max}, and what is left is "
        + ("less than a whole node" if s_per_node == t_per_node else "on nodes unlike training's")
        + f" training could borrow (size it: {' or '.join(fixes) or 'fewer serving nodes'})"
    )


def build_pools(
    cfg: StackConfig,
    world_devices: int,
    min_world_devices: int,
    serving_accelerator: str,
    serving: InferencePlan | None,
) -> list[Pool]:
    """The pools of the stack's accelerator node groups, by accelerator (in the groups' order).

    `world_devices`, `min_world_devices`: the plan's world and its world at training.minNodes in
    devices (world size / ranks per device), each spread over the pools by their training groups'
    devices (spares excluded); `serving`: the inference plan, served from the pool of
    `serving_accelerator` (the plan's accelerator)."""
    nodes: dict[str, dict[str, int]] = {}
    devices: dict[str, dict[str, int]] = {}
    resource: dict[str, str] = {}
    for g in cfg.accelerator_node_groups:
        hw = CATALOG[g.instance_type]
        n = nodes.setdefault(hw.accelerator, {"training": 0, "serving": 0, "spares": 0})
        d = devices.setdefault(hw.accelerator, {"training": 0, "serving": 0, "spares": 0})
        n[g.role] += g.instances
        d[g.role] += g.instances * hw.chips
        n["spares"] += g.spares
        d["spares"] += g.spares * hw.chips
        resource[hw.accelerator] = hw.device_resource
    left, left_min, last = world_devices, min_world_devices, list(nodes)[-1]
    pools = []
    for accelerator in nodes:
        # The world fills the training shares (less their spares) in order; the last pool takes what
        # is left, so a world the shares cannot hold shows there as training's max beyond its share.
        room = devices[accelerator]["training"] - devices[accelerator]["spares"]
        need = left if accelerator == last else min(left, room)
        need_min = left_min if accelerator == last else min(left_min, room)
        left, left_min = left - need, left_min - need_min
        pools.append(
            _pool(
                accelerator,
                resource[accelerator],
                nodes[accelerator],
                devices[accelerator],
                (need_min, need),
                serving if accelerator == serving_accelerator else None,
            )
        )
    return pools


# After SIGTERM a trainer pod finishes the step in flight, writes one checkpoint, and its launcher
# exits after the workers (jobs.SHUTDOWN_MARGIN_S, 10 s): this margin covers that, the ranks agreeing
# to stop at the step boundary, and the processes' exit.
GRACE_MARGIN_S = 30


def termination_grace_needed_s(step_s: float, checkpoint_write_s: float) -> int:
    """The least terminationGracePeriodSeconds that loses at most one checkpoint interval on preemption,
    drain or termination: one step + one checkpoint write (the plan's estimates) + GRACE_MARGIN_S."""
    return math.ceil(step_s + checkpoint_write_s) + GRACE_MARGIN_S


class TeamShare(BaseModel):
    """One team's part of a pool's training share (supernode:teams): its ClusterQueue's figures, in
    devices, as Kueue and the team's ResourceQuota take them."""

    model_config = ConfigDict(frozen=True)

    name: str
    nominal: int  # its guaranteed devices (nominalQuota)
    borrowing_limit: int
    lending_limit: int
    weight: float  # its fair-sharing weight
    max_devices: int  # the most it may ever hold: nominal + borrowing limit (its ResourceQuota; a job's ceiling)
    nodes: int  # nominal in whole nodes
    max_nodes: int  # max_devices in whole nodes
    pool_percent: float  # nominal of the whole pool (training's and serving's devices), in %
    training_percent: float  # nominal of training's share, in %


class TeamPool(BaseModel):
    """How the teams split one pool's training share, and whether it adds up: the teams' quotas are
    exactly training's share (nothing double-counted, nothing idle), together they lend at most what
    training may lend (its share less its spares and the stack's job's minimum: serving's borrowing
    stays as the pool arithmetic has it, a spare is never lent; where the pool serves), and the first
    team, whose queue admits the stack's own job, may reach that job's devices (its nominal + borrowing
    limit >= training max)."""

    model_config = ConfigDict(frozen=True)

    accelerator: str
    device_resource: str
    devices_per_node: int
    training_devices: int  # training's share (Pool.training_devices)
    nominal_total: int
    lending_total: int
    training_lending_limit: int  # Pool.training_lending_limit
    stack_job_team: str  # the first team: its queue admits the stack's own job
    # The plan's job's devices in this pool (Pool.training_max): the stack's own job's, or in a job's plan
    # (supernode.core.jobs.job_plan) that job's, which its team's nominal + borrowing limit must cover.
    stack_job_devices: int
    teams: list[TeamShare]
    adds_up: bool
    reason: str

    @property
    def noun(self) -> str:
        return device_noun(self.device_resource)

    def team(self, name: str) -> TeamShare | None:
        return next((t for t in self.teams if t.name == name), None)


def build_team_pools(cfg: StackConfig, pools: list[Pool]) -> list[TeamPool]:
    """The teams' shares of each pool with training nodes (the config rules allow one); empty without teams."""
    if not cfg.teams:
        return []
    per_node = {CATALOG[g.instance_type].accelerator: CATALOG[g.instance_type].chips for g in cfg.training_node_groups}
    return [_team_pool(cfg, p, per_node[p.accelerator]) for p in pools if p.accelerator in per_node]


def _team_pool(cfg: StackConfig, pool: Pool, per_node: int) -> TeamPool:
    noun = device_noun(pool.device_resource)
    shares = [
        TeamShare(
            name=t.name,
            nominal=t.nominal_quota,
            borrowing_limit=t.borrowing_limit,
            lending_limit=t.lending_limit,
            weight=t.weight,
            max_devices=t.nominal_quota + t.borrowing_limit,
            nodes=t.nominal_quota // per_node,
            max_nodes=(t.nominal_quota + t.borrowing_limit) // per_node,
            pool_percent=round(100 * t.nominal_quota / pool.devices, 1) if pool.devices else 0.0,
            training_percent=round(100 * t.nominal_quota / pool.training_devices, 1) if pool.training_devices else 0.0,
        )
        for t in cfg.teams
    ]
    nominal = sum(t.nominal for t in shares)
    lending = sum(t.lending_limit for t in shares)
    first = shares[0]
    terms = " + ".join(f"{t.name} {t.nominal}" for t in shares)
    problems = []
    if nominal != pool.training_devices:
        problems.append(
            f"teams' quotas {terms} = {nominal} != training's share {pool.training_devices} {noun}"
            + (": the cohort would admit more than the nodes" if nominal > pool.training_devices else ": some idle")
        )
    serves = bool(pool.serving_nodes or pool.serving_max)  # what is lent, serving may borrow
    if serves and lending > pool.training_lending_limit:
        problems.append(
            f"teams lend {lending} > the {pool.training_lending_limit} training may lend (its share less "
            f"{pool.spare_devices} spare and the stack's job's minimum {pool.training_min})"
        )
    if first.max_devices < pool.training_max:
        problems.append(
            f"the stack's own job asks {pool.training_max} {noun} > team {first.name}'s nominal {first.nominal} + "
            f"borrowing {first.borrowing_limit} = {first.max_devices} (its queue admits the stack's job)"
        )
    head = f"teams in pool {pool.accelerator}: {terms} = {nominal}"
    if problems:
        reason = f"{head}; " + "; ".join(problems)
    else:
        lent = f"; lend {lending} <= {pool.training_lending_limit}" if serves else f"; lend {lending}"
        reason = (
            f"{head} = training's share {pool.training_devices} {noun}{lent}; the stack's job "
            f"({pool.training_max}) fits team {first.name}'s {first.max_devices}"
        )
    return TeamPool(
        accelerator=pool.accelerator,
        device_resource=pool.device_resource,
        devices_per_node=per_node,
        training_devices=pool.training_devices,
        nominal_total=nominal,
        lending_total=lending,
        training_lending_limit=pool.training_lending_limit,
        stack_job_team=first.name,
        stack_job_devices=pool.training_max,
        teams=shares,
        adds_up=not problems,
        reason=reason,
    )
