"""Deployment checklist items 6-8: data, weights, checkpoint storage. The dataset is readable by the trainer
role and reaches FSx; weights from a URI are verified; FSx writes a checkpoint within its budget, the trainer
pod's grace period covers a step and a write, and S3 lifecycle rules age checkpoints out."""

from __future__ import annotations

from pulumi_policy import EnforcementLevel
from pydantic import Field, ValidationError

from supernode.core import capacity as cap
from supernode.core.config import FsxConfig
from supernode.core.pools import GRACE_MARGIN_S
from supernode.core.resource_types import (
    BUCKET,
    BUCKET_LIFECYCLE,
    FSX_DRA,
    FSX_LUSTRE,
    IAM_ATTACHMENT,
    IAM_POLICY,
    IAM_ROLE,
    IAM_ROLE_POLICY,
)

from .base import Registry, Report
from .settings import PolicySettings
from .view import (
    Res,
    Stack,
    as_list,
    get,
    items,
    json_doc,
    pod_specs,
    statements,
)

POLICIES = Registry()

ADVISORY = EnforcementLevel.ADVISORY


class Data(PolicySettings):
    dataset_prefix: str | None = Field(
        default=None,
        description="S3 key prefix of the training data; "
        "when unset any non-empty prefix readable by the trainer role passes",
    )


class CheckpointThroughput(PolicySettings):
    checkpoint_write_budget_s: float | None = Field(
        default=None,
        gt=0,
        description="seconds one checkpoint write may take; default: the budget the plan was sized for",
    )


class Lifecycle(PolicySettings):
    checkpoint_prefix: str | None = Field(
        default=None,
        description="S3 key prefix of checkpoints; when unset any rule with a transition and an expiration counts",
    )


# -- 6. data --------------------------------------------------------------------------------------


def pod_roles(stack: Stack) -> list[Res]:
    """IAM roles assumed by pods (IRSA web identity or EKS Pod Identity)."""
    out = []
    for role in stack.of(IAM_ROLE):
        trust = str(role.get("assumeRolePolicy", default=""))
        if "AssumeRoleWithWebIdentity" in trust or "pods.eks.amazonaws.com" in trust:
            out.append(role)
    return out


def role_documents(stack: Stack, role: Res) -> list[dict]:
    """Every identity-policy document that applies to `role` (inline, RolePolicy, attached Policy)."""
    docs = [json_doc(get(p, "policy")) for p in items(role.get("inlinePolicies"))]
    docs += [json_doc(rp.get("policy")) for rp in stack.attached(role, (IAM_ROLE_POLICY,))]
    for att in stack.attached(role, (IAM_ATTACHMENT,)):
        docs += [json_doc(p.get("policy")) for p in stack.of(IAM_POLICY) if p.urn in att.deps]
    return [d for d in docs if d]


def _readable_prefixes(docs: list[dict]) -> list[str]:
    """S3 key prefixes (as `bucket/prefix`) that s3:GetObject is allowed on."""
    out = []
    for st in (s for d in docs for s in statements(d) if s.get("Effect") == "Allow"):
        actions = as_list(st.get("Action"))
        if "s3:GetObject" in actions or "s3:Get*" in actions:
            for r in as_list(st.get("Resource")):
                if isinstance(r, str) and r.startswith("arn:aws:s3:::") and "/" in r:
                    out.append(r.removeprefix("arn:aws:s3:::").rstrip("*"))
    return out


@POLICIES.stack("data-ready", 6, "The dataset is readable by the trainer role and reaches FSx.", settings=Data)
def _data(stack: Stack, conf: Data, report: Report) -> None:
    for fs in stack.of(FSX_LUSTRE):
        dras = [
            d
            for d in stack.attached(fs, (FSX_DRA,))
            if str(d.get("dataRepositoryPath", default="")).startswith("s3://")
        ]
        if not dras:
            report(
                fs,
                f"{fs.label} has no data repository association to S3, so the dataset never reaches the "
                f"nodes and checkpoints never reach S3. Fix: add an aws.fsx.DataRepositoryAssociation "
                f"(dataRepositoryPath s3://BUCKET/..., auto import/export).",
            )
    roles = pod_roles(stack)
    if not roles:
        for job in stack.trainer_jobs():
            report(
                job,
                f"{job.label}: no IAM role for pods (IRSA or Pod Identity) exists, so the trainer cannot read "
                f"the dataset. Fix: create the trainer role and bind it to the trainer service account.",
            )
        return
    trainer = [r for r in roles if "trainer" in r.name.lower()] or roles
    readable = [p for r in trainer for p in _readable_prefixes(role_documents(stack, r))]
    wanted = conf.dataset_prefix
    ok = any(p.split("/", 1)[1] and (wanted is None or p.split("/", 1)[1].startswith(wanted)) for p in readable)
    if not ok:
        need = f"prefix {wanted!r}" if wanted else "a dataset prefix"
        for r in trainer:
            report(
                r,
                f"{r.label} cannot read {need}: it allows s3:GetObject on {readable or 'nothing'}. Fix: allow "
                f"s3:GetObject on arn:aws:s3:::BUCKET/{wanted or 'DATASET_PREFIX/'}* (and s3:ListBucket with "
                f"that prefix); set supernode:storage.datasetPrefix.",
            )


# -- 7. weights verified (advisory) ---------------------------------------------------------------


@POLICIES.stack("weights-verified", 7, "Weights loaded from a URI are verified by sha256.", level=ADVISORY)
def _weights(stack: Stack, _conf: None, report: Report) -> None:
    plan = stack.plan()
    # The manifest pins every file; its own sha256 pins the manifest (a swapped directory brings its own).
    if plan and plan.training.init_from and not plan.training.init_from_sha256:
        report(
            stack.plan_config_map(),
            f"the plan starts from the weights at {plan.training.init_from} without pinning their manifest, so "
            f"swapped weights (with a manifest of their own) go unnoticed. Fix: set supernode:training.initFromSha256 "
            f"to the sha256 of its manifest.json.",
        )


# -- 8. checkpoint storage ------------------------------------------------------------------------


@POLICIES.stack(
    "checkpoint-throughput", 8, "FSx writes one checkpoint within the budget.", settings=CheckpointThroughput
)
def _checkpoint_throughput(stack: Stack, conf: CheckpointThroughput, report: Report) -> None:
    plan = stack.plan()
    if plan is None:
        return
    # The budget the plan was sized for (storage.fsx.checkpointWriteBudgetS), unless the policy config overrides it.
    budget = conf.checkpoint_write_budget_s or plan.checkpoint.write_budget_s
    for fs in stack.of(FSX_LUSTRE):
        capacity, per_unit = fs.get("storageCapacity"), fs.get("perUnitStorageThroughput")
        try:
            fsx = FsxConfig(
                capacity_gib=int(capacity or 0),
                per_unit_throughput=int(per_unit or 0),
                checkpoint_write_budget_s=max(10, round(budget)),
            )
        except ValidationError as e:
            report(
                fs,
                f"{fs.label} has storageCapacity {capacity} GiB / perUnitStorageThroughput {per_unit} MB/s/TiB, "
                f"which PERSISTENT_2 does not accept ({e.errors()[0]['msg']}). Fix: use the planner's size "
                f"({plan.checkpoint.fsx_capacity_gib} GiB).",
            )
            continue
        io = cap.checkpoint_io(plan.params, plan.training, fsx)
        if not io.within_budget:
            report(
                fs,
                f"{fs.label} gives {io.fsx_throughput_mb_s:.0f} MB/s and {fsx.capacity_gib} GiB: one "
                f"{io.checkpoint_bytes / 1e9:.0f} GB checkpoint takes {io.write_seconds:.0f} s against a "
                f"{fsx.checkpoint_write_budget_s} s budget (and {plan.training.keep_checkpoints}+1 checkpoints "
                f"must fit). Fix: storageCapacity >= {plan.checkpoint.fsx_capacity_gib} GiB at this "
                f"throughput (plan.checkpoint.fsx_capacity_gib), or a higher perUnitStorageThroughput.",
            )


@POLICIES.stack(
    "checkpoint-termination-grace",
    8,
    "The trainer pod's grace period covers a step and a checkpoint write (the plan's estimates).",
)
def _termination_grace(stack: Stack, _conf: None, report: Report) -> None:
    """A preempted, drained or terminated trainer pod checkpoints before it is killed: its grace period
    covers the plan's step, checkpoint write and margin (Plan.termination_grace_needed_s)."""
    plan = stack.plan()
    if plan is None:
        return
    need = plan.termination_grace_needed_s
    for job in stack.trainer_jobs():
        for spec in pod_specs(job):
            grace = int(get(spec, "terminationGracePeriodSeconds", default=30))  # Kubernetes' default
            if grace < need:
                report(
                    job,
                    f"{job.label} gives its pods terminationGracePeriodSeconds {grace} s, but finishing a step "
                    f"({plan.step.step_s:.1f} s) and writing a checkpoint ({plan.checkpoint.write_seconds:.0f} s) "
                    f"takes {need} s with the {GRACE_MARGIN_S} s margin: a preempted or drained pod is killed "
                    f"before its checkpoint "
                    f"is written and loses up to a checkpoint interval. Fix: supernode:workload.terminationGraceS "
                    f">= {need}.",
                )
                break


def _rule_prefix(rule: dict) -> str:
    return str(get(rule, "filter", "prefix") or get(rule, "filter", "and", "prefix") or get(rule, "prefix") or "")


@POLICIES.stack(
    "checkpoint-lifecycle", 8, "S3 lifecycle rules abort multipart uploads and age out checkpoints.", settings=Lifecycle
)
def _lifecycle(stack: Stack, conf: Lifecycle, report: Report) -> None:
    buckets = stack.of(BUCKET)
    if not buckets:
        return
    rules = []
    for b in buckets:
        configs = stack.attached(b, (BUCKET_LIFECYCLE,))
        if not configs:
            report(
                b,
                f"{b.label} has no lifecycle configuration, so objects and incomplete uploads are kept (and "
                f"billed) forever. Fix: add an aws.s3.BucketLifecycleConfiguration (supernode:storage.lifecycle).",
            )
        rules += [r for c in configs for r in items(c.get("rules")) if get(r, "status") == "Enabled"]
    where = stack.of(BUCKET_LIFECYCLE)[0] if stack.of(BUCKET_LIFECYCLE) else buckets[0]
    if not any(get(r, "abortIncompleteMultipartUpload", "daysAfterInitiation") for r in rules):
        report(
            where,
            f"{where.label}: no enabled lifecycle rule aborts incomplete multipart uploads (checkpoints are "
            f"multipart). Fix: add abortIncompleteMultipartUpload.daysAfterInitiation "
            f"(supernode:storage.lifecycle.abortMultipartDays).",
        )
    wanted = conf.checkpoint_prefix
    if not any(
        items(get(r, "transitions")) and get(r, "expiration", "days") and (wanted is None or _rule_prefix(r) == wanted)
        for r in rules
    ):
        report(
            where,
            f"{where.label}: no enabled lifecycle rule on the checkpoint prefix{f' {wanted!r}' if wanted else ''} both "
            f"transitions and expires checkpoints. Fix: add a rule filtered on the checkpoint prefix with "
            f"transitions and expiration (supernode:storage.lifecycle.checkpointTransitionDays / "
            f"checkpointExpireDays).",
        )
