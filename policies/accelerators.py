"""Deployment checklist items 1-3: accelerators, memory fit, interconnect. The hardware the stack provisions
is the hardware the plan was made for: approved instance types, the world the plan trains on, pools that add
up, the vendor's device plugin; the plan's memory per rank fits (at every elastic world); EFA, NVLink
domains, placement and the interconnect gate carry the traffic the plan costs.

Each check reads resources and, where the item is about the job, the Plan as the job will read it (the plan
ConfigMap). A check whose resources are not in the stack has nothing to say; what must exist is anchored to
what it serves (a trainer job needs the gate and the plan ConfigMap).
"""

from __future__ import annotations

from pulumi_policy import EnforcementLevel
from pydantic import Field

from supernode.core.catalog import CATALOG, EFA_INTERFACE_TYPES, gate_floor_gbytes_s
from supernode.core.plan import PLAN_CONFIGMAP_KEY, PLAN_MOUNT_DIR, PLAN_MOUNT_PATH
from supernode.core.pools import ROLE_LABEL, TeamPool
from supernode.core.resource_types import (
    CLUSTER_QUEUE,
    COMPUTE_DOMAIN,
    PLACEMENT_GROUP,
    SECURITY_GROUP,
    SG_EGRESS,
    SG_INGRESS,
    SG_RULE,
)
from supernode.core.teams import cluster_queue as team_cluster_queue
from supernode.core.vendors import VENDORS

from .base import Registry, Report
from .settings import PolicySettings
from .view import (
    EFA_RESOURCE,
    Res,
    Stack,
    containers,
    daemon_sets_running,
    get,
    hardware,
    is_fabric_check,
    is_true,
    items,
    mounts_config_map,
    plan_config_map_name,
    pod_specs,
    resource_quantity,
)

POLICIES = Registry()

ADVISORY = EnforcementLevel.ADVISORY


class ApprovedInstances(PolicySettings):
    approved_instance_types: list[str] = Field(
        default_factory=lambda: list(CATALOG), description="GPU instance types node groups may use"
    )


class Gate(PolicySettings):
    min_gate_fraction: float = Field(
        default=0.5,
        gt=0,
        le=1.5,
        description="the gate's bus-bandwidth floor must be at least this fraction "
        "of the catalog's all_reduce baseline",
    )


def _node_count(ng: Res) -> int:
    return int(ng.get("scalingConfig", "desiredSize", default=0))


# -- 1. accelerators ------------------------------------------------------------------------------


@POLICIES.stack(
    "accelerators-approved-instance-types",
    1,
    "GPU node groups use approved instance types.",
    settings=ApprovedInstances,
)
def _approved(stack: Stack, conf: ApprovedInstances, report: Report) -> None:
    for ng in stack.gpu_node_groups():
        itype = stack.instance_type_of(ng)
        if itype not in conf.approved_instance_types:
            report(
                ng,
                f"{ng.label} uses instance type {itype!r}, which is not approved for GPU node groups. "
                f"Fix: use one of {', '.join(conf.approved_instance_types)} "
                f"(supernode:acceleratorNodeGroups[].instanceType).",
            )


def _role(ng: Res) -> str:
    """The node group's role (its supernode.io/gpu-role label): training unless it says serving."""
    return str(ng.get("labels", ROLE_LABEL, default="training"))


@POLICIES.stack("accelerators-match-world-size", 1, "Accelerators across GPU node groups equal the plan's world size.")
def _world_size(stack: Stack, _conf: None, report: Report) -> None:
    # Serving's reserved groups are outside the world (pools-add-up checks them).
    plan, groups = stack.plan(), [ng for ng in stack.gpu_node_groups() if _role(ng) == "training"]
    if plan is None or not groups:
        return
    parts, total = [], 0
    for ng in groups:
        itype = stack.instance_type_of(ng)
        per_node = CATALOG[itype].accelerators if itype in CATALOG else 0
        total += _node_count(ng) * per_node
        parts.append(f"{ng.name}: {_node_count(ng)} x {per_node}")
    # The groups also run the plan's spare nodes (outside the world, standing by for a failed one).
    expected = plan.world_size + plan.spare_accelerators
    if total != expected:
        spares = f" and {plan.spare_accelerators} spare accelerators" if plan.spare_accelerators else ""
        report(
            stack.plan_config_map(),
            f"GPU node groups provide {total} accelerators ({', '.join(parts)}) but the plan in "
            f"{stack.plan_config_map().label} runs world size {plan.world_size}{spares}. Fix: size the node "
            f"groups from the plan (supernode:acceleratorNodeGroups[].nodes and .spares) or change the "
            "parallel degrees.",
        )


@POLICIES.stack(
    "accelerators-pools-add-up",
    1,
    "Training's and serving's minimum accelerators fit their pool together; serving scales out only on "
    "its share and what training lends; no accelerator is unreachable; the teams' quotas add up to training's share.",
)
def _pools(stack: Stack, _conf: None, report: Report) -> None:
    """Training and serving share the accelerators without stranding either (supernode.core.pools):
    the node groups give each pool the devices the plan counted, and the plan's arithmetic adds up."""
    plan = stack.plan()
    if plan is None:
        return
    cm = stack.plan_config_map()
    for pool in plan.pools:
        # Training's groups against the world are accelerators-match-world-size's; serving's share here.
        serving = 0
        for ng in stack.gpu_node_groups():
            itype = stack.instance_type_of(ng)
            if _role(ng) == "serving" and itype in CATALOG and CATALOG[itype].accelerator == pool.accelerator:
                serving += _node_count(ng) * CATALOG[itype].chips
        if stack.gpu_node_groups() and serving != pool.serving_devices:
            report(
                cm,
                f"pool {pool.accelerator}: the serving node groups give {serving} {pool.noun}, but the plan in "
                f"{cm.label} counted {pool.serving_devices} for serving's share. Fix: deploy the plan's node "
                f"groups (supernode:acceleratorNodeGroups[].nodes with role: serving).",
            )
        if pool.stranded:
            report(
                cm,
                f"pool {pool.accelerator}: {pool.stranded_reason}. Such {pool.noun} are bought but no workload "
                "can ever run on them: neither serving at its maximum nor a training pod (a whole node) borrowing "
                "serving's idle share. Fix: size the serving node groups by serving's maximum replicas "
                "(supernode:acceleratorNodeGroups[].nodes with role: serving), or raise "
                "supernode:inference.replicasMax to fill them.",
            )
        if not pool.fits:
            report(
                cm,
                f"{pool.reason}. Training's minimum and serving's minimum must fit the pool together, or "
                f"serving's first replica evicts the training job for good. Fix: give serving its own share, "
                f"a node group with role: serving of at least {pool.serving_min} {pool.noun} "
                f"(supernode:acceleratorNodeGroups[].role), or lower supernode:inference.replicasMin.",
            )
    for teams in plan.teams:
        _teams_add_up(stack, teams, cm, report)


def _teams_add_up(stack: Stack, teams: TeamPool, cm: Res, report: Report) -> None:
    """The teams split training's share exactly (supernode.core.pools.TeamPool, the plan's verdict), and
    the teams' ClusterQueues deployed hold exactly those quotas: their nominal devices add up to
    training's share, so the cohort never admits more than the nodes nor leaves a device no team owns."""
    if not teams.adds_up:
        report(
            cm,
            f"{teams.reason}. The teams' quotas must be training's share of the pool exactly, lend no more than "
            f"training may, and the first team's queue must reach the stack's own job. Fix: set "
            f"supernode:teams[].nominalQuota to add up to {teams.training_devices} {teams.noun} (and "
            "lendingLimit, borrowingLimit), or size the training node groups to the quotas.",
        )
    queues = {str(q.get("metadata", "name")): q for q in stack.of(CLUSTER_QUEUE)}
    deployed, parts = 0, []
    for t in teams.teams:
        name = team_cluster_queue(t.name, teams.accelerator)
        q = queues.get(name)
        if q is None:
            report(
                cm,
                f"team {t.name} has a quota of {t.nominal} {teams.noun} in the plan in {cm.label} but no "
                f"ClusterQueue {name} is deployed. Fix: deploy the teams' queues (components/k8s/queues.py).",
            )
            continue
        nominal = sum(
            int(get(r, "nominalQuota", default=0))
            for g in items(q.get("spec", "resourceGroups"))
            for f in items(get(g, "flavors"))
            for r in items(get(f, "resources"))
            if get(r, "name") == teams.device_resource
        )
        deployed += nominal
        parts.append(f"{name} {nominal}")
    if parts and deployed != teams.training_devices:
        report(
            cm,
            f"pool {teams.accelerator}: the teams' ClusterQueues hold {' + '.join(parts)} = {deployed} "
            f"{teams.noun} of {teams.device_resource}, but training's share is {teams.training_devices}: the "
            "cohort would admit "
            + ("more than the nodes" if deployed > teams.training_devices else "less than the nodes, some idle")
            + ". Fix: deploy the plan's team quotas (Plan.teams) as the queues' nominalQuota.",
        )


@POLICIES.stack(
    "accelerators-device-plugin",
    1,
    "The accelerator vendor's device plugin (NVIDIA or AWS Neuron) is deployed for the trainer.",
)
def _device_plugin(stack: Stack, _conf: None, report: Report) -> None:
    """The trainer's accelerators are advertised: without the vendor's device plugin no node offers
    the devices the job's pods request, and the pods never schedule."""
    jobs, hw = stack.trainer_jobs(), hardware(stack)
    image = VENDORS[hw.vendor].device_plugin
    if jobs and not daemon_sets_running(stack, image):
        for job in jobs:
            report(
                job,
                f"{job.label} requests {hw.device_resource} but no {image} DaemonSet is deployed, so no node "
                f"advertises it and the pods never schedule. Fix: deploy {image} on the accelerator nodes "
                f"(components/addons/{image}.yaml).",
            )


# -- 2. memory fit --------------------------------------------------------------------------------


@POLICIES.stack("memory-fit", 2, "The plan's per-rank memory fits HBM with headroom.")
def _memory_fit(stack: Stack, _conf: None, report: Report) -> None:
    # The plan's own verdict (`fits`, within HBM less parallel.hbmHeadroom), never recomputed here, so
    # `supernode plan`, its suggestions and this policy give one answer, in the same figures.
    plan = stack.plan()
    if plan is None:
        return
    cm, topo = stack.plan_config_map(), plan.topology
    # Item 2's global address space: one replica's state against its shard group's aggregate HBM.
    domain = ""
    if not plan.layout.replica_fits:
        shard, rank, link = plan.degrees.shard_group, plan.hardware.rank_noun, plan.hardware.link_name
        domain = (
            f"One replica's training state is {topo.replica_state_gib:,.0f} GiB but its {shard} shard-group "
            f"{rank}s ({plan.layout.replica_domains} {link} domain(s) of {topo.domain_gpus} {rank}s, "
            f"{topo.domain_hbm_gib:,.0f} GiB each) hold {shard * plan.usable_hbm_gib:,.0f} GiB usable. "
        )
    if not plan.fits:
        hint = ""
        if plan.suggestions:
            s = plan.suggestions[0]
            hint = (
                f" e.g. dpReplicate {s.dp_replicate}, dpShard {s.dp_shard}, tp {s.tp}, ep {s.ep}, pp {s.pp}, "
                f"activationCheckpointing {s.activation_checkpointing}, training.microBatch {s.micro_batch} "
                f"({s.memory_gib} GiB);"
            )
        report(
            cm,
            f"the plan in {cm.label} needs {plan.memory_per_rank_gib:.1f} GiB per rank but {plan.instance_type} "
            f"has {plan.hbm_gib:.1f} GiB, {plan.usable_hbm_gib:.1f} GiB with {plan.parallel.hbm_headroom:.0%} "
            f"headroom: over by {plan.over_by_gib:.1f} GiB. {domain}Fix: change the layout (supernode:parallel);"
            f"{hint} or use more activation checkpointing, a smaller microBatch, more nodes or larger-memory "
            f"GPUs (`supernode plan` lists layouts that fit).",
        )
    elif domain:  # per-rank fit implies this; a plan saying otherwise was not built by this planner
        report(
            cm,
            f"the plan in {cm.label}: {domain}Fix: shard over more GPUs (supernode:parallel.dpShard up, "
            f"dpReplicate down) or add UltraServers / nodes.",
        )
    # The plan's verdict holds only on the GPU it was sized for: nodes with less HBM void it.
    for ng in stack.gpu_node_groups():
        itype = stack.instance_type_of(ng)
        if itype in CATALOG and CATALOG[itype].hbm_gib < plan.hbm_gib:
            report(
                ng,
                f"{ng.label} runs {itype} with {CATALOG[itype].hbm_gib:.1f} GiB HBM per GPU, but the plan in "
                f"{cm.label} was sized for {plan.instance_type} with {plan.hbm_gib:.1f} GiB, so its memory fit "
                f"does not hold there. Fix: plan for the deployed instance type "
                f"(supernode:acceleratorNodeGroups[].instanceType) and regenerate the plan ConfigMap.",
            )


@POLICIES.stack(
    "memory-fit-elastic",
    2,
    "Every node count the elastic job may run on (training.minNodes to the planned nodes) has a layout "
    "that fits HBM with headroom.",
)
def _elastic_fit(stack: Stack, _conf: None, report: Report) -> None:
    """Every node count the elastic job may run on (training.minNodes to the planned nodes) has a
    layout that fits memory: the plan's verdict per world (Plan.layouts), never recomputed here. The
    planned world is memory-fit's."""
    plan = stack.plan()
    if plan is None:
        return
    cm = stack.plan_config_map()
    for e in plan.layouts:
        if not e.fits and e.world_size != plan.world_size:
            report(
                cm,
                f"the elastic job may run on {e.nodes} nodes (world {e.world_size}; training.minNodes "
                f"{plan.min_nodes} to {plan.nodes} nodes) but the plan in {cm.label} has no layout there that "
                f"fits: {e.reason}. Fix: raise supernode:training.minNodes above {e.nodes}, or change the "
                "parallel degrees so that world runs (`supernode plan` lists every node count).",
            )


# -- 3. interconnect ------------------------------------------------------------------------------


def _instance_type_for_template(stack: Stack, lt: Res) -> str | None:
    if lt.get("instanceType"):
        return lt.get("instanceType")
    for ng in stack.gpu_node_groups():
        if stack.launch_template_of(ng) is lt:
            return stack.instance_type_of(ng)
    return None


@POLICIES.stack(
    "interconnect-efa-interfaces", 3, "GPU launch templates carry the instance type's full EFA interface count."
)
def _efa_interfaces(stack: Stack, _conf: None, report: Report) -> None:
    for lt in stack.gpu_launch_templates():
        itype = _instance_type_for_template(stack, lt)
        if itype not in CATALOG:
            continue  # unapproved types are item 1's finding
        hw = CATALOG[itype]
        want = hw.efa_cards
        efa = [ni for ni in items(lt.get("networkInterfaces")) if get(ni, "interfaceType") in EFA_INTERFACE_TYPES]
        cards = sorted({int(get(ni, "networkCardIndex", default=0)) for ni in efa})
        if len(efa) != len(want) or cards != want:
            report(
                lt,
                f"{lt.label} ({itype}) has {len(efa)} EFA interfaces on network cards {cards}; {itype} has "
                f"{hw.efa_interfaces} EFA-capable network cards and needs one EFA interface on each "
                f"({want[0]}..{want[-1]}), else NCCL loses bandwidth. Fix: build networkInterfaces from "
                f"the catalog's layout (supernode.core.catalog: {itype} network_interfaces).",
            )


@POLICIES.stack(
    "interconnect-nvlink-domain",
    3,
    "On UltraServers, EP and TP groups stay inside one NVLink domain and jobs claim a ComputeDomain's IMEX channel.",
)
def _nvlink_domain(stack: Stack, _conf: None, report: Report) -> None:
    """On a multi-node NVLink domain (GB200 UltraServers) every EP and TP group stays inside one domain,
    and each job claims the IMEX channel of its own ComputeDomain (without it NCCL cannot use NVLink
    between the domain's nodes)."""
    plan = stack.plan()
    # A vendor that keeps EP and TP inside its domain (Trainium's NeuronLink) is checked on every instance
    # type (the planner refuses otherwise); the others where the domain spans nodes.
    if plan is None or (plan.topology.nodes_per_domain <= 1 and not plan.hardware.keeps_ep_tp_in_domain):
        return
    cm, topo, hw = stack.plan_config_map(), plan.topology, plan.hardware
    for dim, key in (("ep", "ep"), ("tp", "tp")):
        g = plan.layout.group(dim)
        if not g.inside_domain:
            report(
                cm,
                f"the plan in {cm.label} puts each {dim} group of {g.size} {hw.rank_noun}s across {g.domains} "
                f"{hw.link_name} domains of {topo.domain_gpus} ({topo.ultra_server or 'one ' + hw.name}), so its "
                f"traffic crosses EFA. Fix: choose supernode:parallel.{key} dividing {topo.domain_gpus} (EP inside "
                f"the domain, FSDP/DP across domains; `supernode plan` suggests such layouts).",
            )
    if not hw.vendor_row.cross_node_domain_needs_imex or topo.nodes_per_domain <= 1:  # e.g. NeuronLink: none
        return
    domains = {get(cd.props, "metadata", "name"): cd for cd in stack.of(COMPUTE_DOMAIN)}
    templates = {get(cd.props, "spec", "channel", "resourceClaimTemplate", "name") for cd in domains.values()}
    for job in [*stack.trainer_jobs(), *stack.gates()]:
        claimed = {
            get(c, "resourceClaimTemplateName") for spec in pod_specs(job) for c in items(get(spec, "resourceClaims"))
        }
        if not claimed & templates:
            report(
                job,
                f"{job.label} runs on {topo.ultra_server} NVLink domains but its pods claim no ComputeDomain "
                f"IMEX channel (ComputeDomains: {', '.join(sorted(map(str, domains))) or 'none'}), so NCCL cannot "
                f"use NVLink between nodes. Fix: install the NVIDIA DRA driver (computeDomains.enabled=true), "
                f"create a ComputeDomain (resource.nvidia.com/v1beta1) for the job and add its "
                f"spec.channel.resourceClaimTemplate.name to the pods' resourceClaims.",
            )


@POLICIES.stack("interconnect-placement", 3, "GPU nodes use a cluster placement group or a targeted reservation.")
def _placement(stack: Stack, _conf: None, report: Report) -> None:
    cluster_groups = {
        pg.get("name", default=pg.name): pg for pg in stack.of(PLACEMENT_GROUP) if pg.get("strategy") == "cluster"
    }
    for lt in stack.gpu_launch_templates():
        group = lt.get("placement", "groupName")
        in_cluster_group = group in cluster_groups or any(pg.urn in lt.deps for pg in cluster_groups.values())
        reserved = (
            lt.get("capacityReservationSpecification", "capacityReservationTarget", "capacityReservationId")
            or lt.get("instanceMarketOptions", "marketType") == "capacity-block"
        )
        if not (in_cluster_group and group) and not reserved:
            report(
                lt,
                f"{lt.label} neither places instances in a cluster placement group nor targets a capacity "
                f"reservation or Capacity Block, so GPU nodes may land far apart. Fix: set "
                f"placement.groupName to an aws.ec2.PlacementGroup with strategy 'cluster', or target a "
                f"reservation (supernode:acceleratorNodeGroups[].capacity).",
            )


def _all_traffic(protocol: object) -> bool:
    return str(protocol) in ("-1", "all", "-1.0")


def efa_groups(stack: Stack) -> list[set[str]]:
    """Security groups with self-referencing all-traffic ingress AND egress, each as the identifiers that can
    point at it (its URN and/or its id as rules and launch templates spell it)."""
    groups: dict[str, dict[str, set]] = {}

    def add(key: str, direction: str, *ids: str | None) -> None:
        g = groups.setdefault(key, {"dirs": set(), "ids": set()})
        g["dirs"].add(direction)
        g["ids"].update(str(i) for i in ids if i)

    for sg in stack.of(SECURITY_GROUP):
        for direction in ("ingress", "egress"):
            if any(is_true(get(r, "self")) and _all_traffic(get(r, "protocol")) for r in items(sg.get(direction))):
                add(sg.urn, direction, sg.urn)
    for rule in stack.of(SG_RULE, SG_INGRESS, SG_EGRESS):
        group = rule.get("securityGroupId")
        if rule.type == SG_RULE:
            source, protocol, direction = rule.get("sourceSecurityGroupId"), rule.get("protocol"), str(rule.get("type"))
            self_ref = is_true(rule.get("self")) or (source and source == group)
        else:
            protocol = rule.get("ipProtocol")
            direction = "ingress" if rule.type == SG_INGRESS else "egress"
            self_ref = rule.get("referencedSecurityGroupId") and rule.get("referencedSecurityGroupId") == group
        if self_ref and _all_traffic(protocol):
            owners = [u for u in rule.deps if u in stack.by_urn and stack.by_urn[u].type == SECURITY_GROUP]
            add(str(group), direction, group, *(owners if len(owners) == 1 else []))
    return [g["ids"] for g in groups.values() if g["dirs"] >= {"ingress", "egress"}]


@POLICIES.stack("interconnect-efa-security-group", 3, "An EFA security group allows all traffic to and from itself.")
def _efa_security_group(stack: Stack, _conf: None, report: Report) -> None:
    groups = efa_groups(stack)
    for lt in stack.gpu_launch_templates():
        attached = set(lt.deps) | {
            str(sg) for ni in items(lt.get("networkInterfaces")) for sg in items(get(ni, "securityGroups"))
        }
        attached |= {str(sg) for sg in items(lt.get("vpcSecurityGroupIds"))}
        if not any(ids & attached for ids in groups):
            report(
                lt,
                f"{lt.label}: none of its security groups allows all traffic to and from itself (ingress and "
                f"egress); EFA needs that or NCCL cannot use the fabric. Fix: add self-referencing all-traffic "
                f"(protocol -1) ingress and egress rules to the EFA security group and attach it to every "
                f"EFA network interface.",
            )


@POLICIES.stack("interconnect-trainer-efa", 3, "Trainer pods request the node's EFA devices.")
def _trainer_efa(stack: Stack, _conf: None, report: Report) -> None:
    plan = stack.plan()
    want = CATALOG[plan.instance_type].efa_interfaces if plan and plan.instance_type in CATALOG else None
    for job in stack.trainer_jobs():
        device = CATALOG[plan.instance_type].device_resource if plan and plan.instance_type in CATALOG else None
        gpu = [c for c in containers(job) if resource_quantity(c, device or "nvidia.com/gpu")] or containers(job)
        for c in gpu:
            got = resource_quantity(c, EFA_RESOURCE)
            if not got or (want is not None and got != want):
                need = f"{want}" if want is not None else "the node's EFA device count"
                report(
                    job,
                    f"{job.label} container '{get(c, 'name')}' requests {EFA_RESOURCE}: "
                    f"{got if got is not None else 'none'}; it needs {need} (one per EFA device of "
                    f"{plan.instance_type if plan else 'the node'}), else NCCL silently falls back to TCP. "
                    f"Fix: set resources.requests and limits '{EFA_RESOURCE}': {need}.",
                )


def _reads_plan(container: object) -> bool:
    argv = [str(a) for a in items(get(container, "command")) + items(get(container, "args"))]
    return (
        any(a == "--plan" and b == PLAN_MOUNT_PATH for a, b in zip(argv, argv[1:]))
        or f"--plan={PLAN_MOUNT_PATH}" in argv
    )


@POLICIES.stack("interconnect-gate", 3, "The trainer job depends on a passing interconnect gate.", settings=Gate)
def _gate(stack: Stack, conf: Gate, report: Report) -> None:
    jobs = stack.trainer_jobs()
    if not jobs:
        return
    gates, plan = stack.gates(), stack.plan()
    if not gates:
        for job in jobs:
            report(
                job,
                f"{job.label} has no interconnect gate: no Job runs `python -m supernode.trainer.node.fabric`. "
                f"Fix: deploy the fabric-check Job across the GPU nodes and make the trainer job depend on it.",
            )
        return
    for job in jobs:
        if not any(stack.depends_on(job, g) for g in gates):
            report(
                job,
                f"{job.label} does not depend on the interconnect gate ({', '.join(g.label for g in gates)}), "
                f"so training can start on a broken fabric. Fix: pass depends_on=[gate] to the trainer job.",
            )
    # The gate takes its floor from the plan (plan.gate_floor_gbytes_s, read at --plan PLAN_MOUNT_PATH), so
    # it must mount the plan ConfigMap and run on that file, and the plan's floor must not be below this
    # policy's minimum.
    cm_name = plan_config_map_name(stack)
    fix = (
        f"Fix: add a configMap volume for the plan ConfigMap, mount it at {PLAN_MOUNT_DIR} and run "
        f"`python -m supernode.trainer.node.fabric --plan {PLAN_MOUNT_PATH}`."
    )
    for g in gates:
        if cm_name is None or not all(mounts_config_map(spec, cm_name) for spec in pod_specs(g)):
            report(
                g,
                f"{g.label} does not mount the plan ConfigMap"
                f"{f' {cm_name!r}' if cm_name else f' (none holds data[{PLAN_CONFIGMAP_KEY!r}])'}, so it cannot "
                f"read its bus-bandwidth floor from the plan. {fix}",
            )
        elif not all(_reads_plan(c) for c in containers(g) if is_fabric_check(c)):
            report(
                g,
                f"{g.label} does not run the fabric check on the plan (--plan {PLAN_MOUNT_PATH}), so the floor "
                f"it enforces is not the plan's. {fix}",
            )
    minimum = gate_floor_gbytes_s(plan.instance_type, conf.min_gate_fraction) if plan else None
    if minimum is None or plan.gate_floor_gbytes_s is None:
        return  # no published baseline for this instance type: nothing to compare with
    if plan.gate_floor_gbytes_s < minimum:
        baseline = CATALOG[plan.instance_type].all_reduce_baseline_gbytes_s
        for g in gates:
            report(
                g,
                f"{g.label} accepts an all_reduce bus bandwidth of {plan.gate_floor_gbytes_s:g} GB/s (the "
                f"plan's gate floor); the minimum is {minimum:g} GB/s ({conf.min_gate_fraction:g} x the "
                f"{plan.instance_type} baseline {baseline:g} GB/s). Fix: raise "
                f"supernode:workload.gateMinFraction to at least {conf.min_gate_fraction:g}.",
            )
