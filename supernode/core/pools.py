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
  when training needs it, so a preempted or waiting training job is re-admitted without a person.

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
    adds_up: bool
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
    noun = device_noun(device_resource)
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
        reason = f"{head}; " + "; ".join(problems)
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
        adds_up=not problems,
        reason=reason,
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
