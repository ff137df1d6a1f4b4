"""Buckets (encryption, public-access block, TLS-only policy, lifecycle, logging) and FSx for
Lustre sized by the planner with data repository associations."""

from __future__ import annotations

import json

from aws_preview import Stack, policy, preview, statements

from supernode.core import resource_types as T
from supernode.core.catalog import GIB
from supernode.core.plan import build_plan

BUCKET = T.BUCKET
FSX = T.FSX_LUSTRE
DRA = T.FSX_DRA


def for_bucket(stack: Stack, typ: str, bucket_id: str) -> list[dict]:
    return [r.inputs for r in stack.all(typ) if r.inputs["bucket"] == bucket_id]


def test_every_bucket_is_encrypted_private_tls_only_versioned_with_lifecycle(stack: Stack):
    buckets = stack.all(BUCKET)
    assert len(buckets) == 2  # training data + its access logs
    for b in buckets:
        (sse,) = for_bucket(stack, T.BUCKET_SSE, b.id)
        algorithm = sse["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"]
        assert algorithm in ("aws:kms", "AES256")
        (block,) = for_bucket(stack, T.BUCKET_PAB, b.id)
        assert all(
            block[k] is True
            for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
        )
        (pol,) = [json.loads(p["policy"]) for p in for_bucket(stack, T.BUCKET_POLICY, b.id)]
        deny = [s for s in statements(pol) if s["Effect"] == "Deny"]
        assert deny == [{**deny[0], "Principal": "*", "Condition": {"Bool": {"aws:SecureTransport": "false"}}}]
        assert set(deny[0]["Resource"]) == {b.outputs["arn"], b.outputs["arn"] + "/*"}
        (versioning,) = for_bucket(stack, T.BUCKET_VERSIONING, b.id)
        assert versioning["versioningConfiguration"]["status"] == "Enabled"
        (lifecycle,) = for_bucket(stack, T.BUCKET_LIFECYCLE, b.id)
        rules = lifecycle["rules"]
        assert rules and all(r["status"] == "Enabled" for r in rules)
        lc = stack.cfg.storage.lifecycle
        assert any(
            r.get("abortIncompleteMultipartUpload", {}).get("daysAfterInitiation") == lc.abort_multipart_days
            for r in rules
        )
        assert any(
            r.get("noncurrentVersionExpiration", {}).get("noncurrentDays") == lc.noncurrent_expire_days for r in rules
        )


def test_data_bucket_uses_the_data_key_logs_and_configured_lifecycle(stack: Stack):
    data = stack.one(BUCKET, "storage")
    assert data.outputs["bucket"] == stack.outputs["bucket_name"]
    if stack.cfg.storage.bucket_name:
        assert stack.outputs["bucket_name"] == stack.cfg.storage.bucket_name
    (sse,) = for_bucket(stack, T.BUCKET_SSE, data.id)
    by_default = sse["rules"][0]["applyServerSideEncryptionByDefault"]
    assert by_default == {"sseAlgorithm": "aws:kms", "kmsMasterKeyId": stack.outputs["kms_key_arns"]["data"]}
    (logging,) = for_bucket(stack, T.BUCKET_LOGGING, data.id)
    assert logging["targetBucket"] == stack.one(BUCKET, "storage-access-logs").id
    (lifecycle,) = for_bucket(stack, T.BUCKET_LIFECYCLE, data.id)
    rules = {r["id"]: r for r in lifecycle["rules"]}
    s, lc = stack.cfg.storage, stack.cfg.storage.lifecycle
    # checkpoints: a rule acts only on what `supernode checkpoints --retain` tagged (an untagged
    # checkpoint is kept); window ones are tiered and expire, milestones are tiered and kept
    window, milestone = rules["checkpoints-window-tier-and-expire"], rules["checkpoints-milestone-tier"]
    assert window["filter"] == {"and": {"prefix": s.checkpoint_prefix, "tags": {"supernode-retention": "window"}}}
    assert milestone["filter"] == {"and": {"prefix": s.checkpoint_prefix, "tags": {"supernode-retention": "milestone"}}}
    for ckpt in (window, milestone):
        assert ckpt["transitions"] == [{"days": lc.checkpoint_transition_days, "storageClass": "GLACIER_IR"}]
    assert window["expiration"] == {"days": lc.checkpoint_expire_days} and "expiration" not in milestone
    assert not [r for r in rules.values() if s.checkpoint_prefix in str(r.get("filter")) and "tags" not in str(r)]
    assert rules["logs-expire"]["filter"] == {"prefix": s.log_prefix}
    assert rules["logs-expire"]["expiration"] == {"days": lc.log_expire_days}
    # datasets are never expired or tiered by a rule
    assert not any(r.get("filter", {}).get("prefix", "").startswith(s.dataset_prefix) for r in rules.values())


def test_prod_lifecycle_figures_come_from_the_stack_file():
    s = preview("prod")
    (lifecycle,) = for_bucket(s, T.BUCKET_LIFECYCLE, s.cfg.storage.bucket_name)
    ckpt = {r["id"]: r for r in lifecycle["rules"]}["checkpoints-window-tier-and-expire"]
    assert (ckpt["transitions"][0]["days"], ckpt["expiration"]["days"]) == (30, 180)


def test_access_log_bucket_accepts_only_the_logging_service(stack: Stack):
    logs = stack.one(BUCKET, "storage-access-logs")
    (pol,) = [json.loads(p["policy"]) for p in for_bucket(stack, T.BUCKET_POLICY, logs.id)]
    allow = [s for s in statements(pol) if s["Effect"] == "Allow"]
    assert allow == [
        {
            "Sid": "S3ServerAccessLogs",
            "Effect": "Allow",
            "Principal": {"Service": "logging.s3.amazonaws.com"},
            "Action": "s3:PutObject",
            "Resource": logs.outputs["arn"] + "/*",
        }
    ]


def test_fsx_is_persistent2_sized_by_the_planner(stack: Stack):
    plan = build_plan(stack.result.stack, stack.cfg)
    fsx = stack.one(FSX).inputs
    fcfg = stack.cfg.storage.fsx
    assert fsx["deploymentType"] == "PERSISTENT_2"
    assert fsx["storageCapacity"] == plan.checkpoint.fsx_capacity_gib
    assert fsx["perUnitStorageThroughput"] == fcfg.per_unit_throughput
    # the sized file system writes one checkpoint within the configured budget
    throughput_mb_s = fsx["storageCapacity"] / 1024 * fsx["perUnitStorageThroughput"]
    assert plan.checkpoint.checkpoint_bytes / 1e6 / throughput_mb_s <= fcfg.checkpoint_write_budget_s
    assert fsx["kmsKeyId"] == stack.outputs["kms_key_arns"]["data"]
    assert fsx["subnetIds"] == stack.outputs["gpu_subnet_id"]
    assert stack.outputs["fsx_id"].startswith("fs-") and stack.outputs["fsx_mount_name"]


def test_data_repository_associations(stack: Stack):
    bucket, s = stack.outputs["bucket_name"], stack.cfg.storage
    dras = {r.inputs["fileSystemPath"]: r.inputs for r in stack.all(DRA)}
    weights = "/" + stack.cfg.inference.weights_prefix.strip("/")  # the stack serves: its weights are imported
    assert set(dras) == {"/datasets", "/checkpoints", "/baselines", weights}
    # `supernode model push` uploads to this prefix; the serving init container copies /fsx/<prefix>
    assert dras[weights]["dataRepositoryPath"] == f"s3://{bucket}/{stack.cfg.inference.weights_prefix}"
    assert "autoExportPolicy" not in dras[weights]["s3"]  # serving never writes weights back
    assert dras["/datasets"]["dataRepositoryPath"] == f"s3://{bucket}/{s.dataset_prefix}"
    assert dras["/checkpoints"]["dataRepositoryPath"] == f"s3://{bucket}/{s.checkpoint_prefix}"
    # the fabric baseline outlives the checkpoints: its own prefix, exported, expired by no lifecycle rule
    assert dras["/baselines"]["dataRepositoryPath"] == f"s3://{bucket}/baselines/"
    assert dras["/baselines"]["s3"]["autoExportPolicy"]["events"] == ["NEW", "CHANGED", "DELETED"]
    for path, d in dras.items():
        assert d["fileSystemId"] == stack.outputs["fsx_id"]
        if path != "/checkpoints":
            assert d["s3"]["autoImportPolicy"]["events"] == ["NEW", "CHANGED", "DELETED"]
    # checkpoints never propagate a deletion: the trainer's prune on FSx leaves S3's history alone, and a
    # lifecycle expiry in S3 leaves a run's FSx copy alone
    assert dras["/checkpoints"]["s3"]["autoExportPolicy"]["events"] == ["NEW", "CHANGED"]
    assert dras["/checkpoints"]["s3"]["autoImportPolicy"]["events"] == ["NEW", "CHANGED"]
    assert "autoExportPolicy" not in dras["/datasets"]["s3"]  # training never writes datasets back


def test_configured_fsx_capacity_is_used_as_given():
    def change(data: dict) -> None:
        data["storage"]["fsx"]["capacityGib"] = 4800

    s = preview("dev", "fsx-4800", change)
    assert s.one(FSX).inputs["storageCapacity"] == 4800
    alarm = s.one(T.METRIC_ALARM, "monitoring-fsx-free-capacity-low").inputs
    assert alarm["threshold"] == 4800 * GIB * s.cfg.monitoring.fsx_free_capacity_floor_percent / 100


def test_existing_bucket_is_referenced_not_created():
    def change(data: dict) -> None:
        data["storage"].update(bucketName="org-shared-training", existingBucket=True)

    s = preview("dev", "existing-bucket", change)
    assert s.all(BUCKET) == [] and s.all(T.BUCKET_POLICY) == []
    assert s.outputs["bucket_name"] == "org-shared-training"
    assert {r.inputs["dataRepositoryPath"].split("/")[2] for r in s.all(DRA)} == {"org-shared-training"}
    trainer = policy(s.one(T.IAM_ROLE_POLICY, "trainer-role-data"))
    assert statements(trainer)[0]["Resource"] == "arn:aws:s3:::org-shared-training"
