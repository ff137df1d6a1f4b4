"""Storage: the training bucket (datasets, checkpoints, logs) with its access-log bucket, and FSx
for Lustre PERSISTENT_2 sized by the planner, linked to the bucket (issue 3, part 4)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from supernode.core.config import StorageConfig
from supernode.core.files import CHECKPOINT_RETENTION_TAG, MILESTONE, WINDOW
from supernode.core.plan import Plan

from ..context import StackContext
from .identity import policy_document

LUSTRE_PORTS = ((988, 988), (1018, 1023))  # LNet, and the Lustre service ports
CHECKPOINT_STORAGE_CLASS = "GLACIER_IR"  # cheaper, still millisecond reads for a restart; no 30-day minimum
AUTO_EVENTS = ["NEW", "CHANGED", "DELETED"]
# Checkpoints flow both ways without deletions: the trainer's prune on FSx (keepCheckpoints) must not
# delete S3's copy, which is the history (supernode/tools/checkpoints.py), and a lifecycle expiry in S3
# must not delete a checkpoint a run still has on FSx.
CHECKPOINT_EVENTS = ["NEW", "CHANGED"]
# Paths inside the file system: datasets flow in from S3, checkpoints both ways (a submitted job's too,
# supernode.tools.jobs_cluster, under CHECKPOINT_DIR/<its namespace>/<its name>).
DATASET_DIR, CHECKPOINT_DIR = "/datasets", "/checkpoints"
BASELINE_PREFIX = "baselines/"  # fabric baseline (operations): kept, unlike checkpoints/ which expire


def deny_insecure_transport(bucket_arn: str) -> dict:
    # A Deny may use s3:*: it only ever removes access (no Allow anywhere uses a wildcard).
    return {
        "Sid": "DenyInsecureTransport",
        "Effect": "Deny",
        "Principal": "*",
        "Action": "s3:*",
        "Resource": [bucket_arn, f"{bucket_arn}/*"],
        "Condition": {"Bool": {"aws:SecureTransport": "false"}},
    }


def lifecycle_rules(storage: StorageConfig) -> list[aws.s3.BucketLifecycleConfigurationRuleArgs]:
    lc = storage.lifecycle
    rule = aws.s3.BucketLifecycleConfigurationRuleArgs

    def checkpoints(retention: str) -> aws.s3.BucketLifecycleConfigurationRuleFilterArgs:
        return aws.s3.BucketLifecycleConfigurationRuleFilterArgs(
            and_=aws.s3.BucketLifecycleConfigurationRuleFilterAndArgs(
                prefix=storage.checkpoint_prefix, tags={CHECKPOINT_RETENTION_TAG: retention}
            )
        )

    tier = [
        aws.s3.BucketLifecycleConfigurationRuleTransitionArgs(
            days=lc.checkpoint_transition_days, storage_class=CHECKPOINT_STORAGE_CLASS
        )
    ]
    # Only what `supernode checkpoints --retain` judged is acted on: a window checkpoint is tiered and
    # expired, a milestone (every k-th and each run's newest) tiered and kept; an untagged one is kept.
    return [
        rule(
            id="checkpoints-window-tier-and-expire",
            status="Enabled",
            filter=checkpoints(WINDOW),
            transitions=tier,
            expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(days=lc.checkpoint_expire_days),
        ),
        rule(id="checkpoints-milestone-tier", status="Enabled", filter=checkpoints(MILESTONE), transitions=tier),
        rule(
            id="logs-expire",
            status="Enabled",
            filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix=storage.log_prefix),
            expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(days=lc.log_expire_days),
        ),
        _housekeeping(storage),
    ]


def access_log_rules(storage: StorageConfig) -> list[aws.s3.BucketLifecycleConfigurationRuleArgs]:
    return [
        aws.s3.BucketLifecycleConfigurationRuleArgs(
            id="access-logs-expire",
            status="Enabled",
            filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(),
            expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(days=storage.lifecycle.log_expire_days),
        ),
        _housekeeping(storage),
    ]


def _housekeeping(storage: StorageConfig) -> aws.s3.BucketLifecycleConfigurationRuleArgs:
    lc = storage.lifecycle
    return aws.s3.BucketLifecycleConfigurationRuleArgs(
        id="noncurrent-and-multipart",
        status="Enabled",
        filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(),
        noncurrent_version_expiration=aws.s3.BucketLifecycleConfigurationRuleNoncurrentVersionExpirationArgs(
            noncurrent_days=lc.noncurrent_expire_days
        ),
        abort_incomplete_multipart_upload=aws.s3.BucketLifecycleConfigurationRuleAbortIncompleteMultipartUploadArgs(
            days_after_initiation=lc.abort_multipart_days
        ),
    )


@dataclass
class StorageArgs:
    ctx: StackContext
    storage: StorageConfig
    plan: Plan
    vpc_id: pulumi.Input[str]
    fsx_subnet_id: pulumi.Input[str]  # the GPU subnet: FSx lives in the GPU AZ
    node_security_group_id: pulumi.Input[str]  # the GPU nodes: the only Lustre clients
    data_kms_key_arn: pulumi.Input[str]
    logs_kms_key_arn: pulumi.Input[str]
    log_retention_days: int
    weights_prefix: str | None = None  # inference.weightsPrefix: `supernode model push` uploads the export there


class Storage(pulumi.ComponentResource):
    bucket_name: pulumi.Output[str]
    bucket_arn: pulumi.Output[str]
    fsx_id: pulumi.Output[str]
    fsx_dns_name: pulumi.Output[str]
    fsx_mount_name: pulumi.Output[str]

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:storage:Storage", name, None, opts)
        self._child = pulumi.ResourceOptions(parent=self)
        s, tags = args.storage, args.ctx.tagged()
        self.dataset_prefix, self.checkpoint_prefix = s.dataset_prefix, s.checkpoint_prefix

        self.bucket_name, self.bucket_arn, self.access_log_bucket_name = self._buckets(name, args, tags)
        self.fsx_security_group_id = self._fsx_security_group(name, args)
        fsx_logs = self._fsx_log_group(name, args, tags)
        self.fsx_log_group_name = fsx_logs.name
        self.fsx = self._file_system(name, args, fsx_logs)
        self.fsx_id, self.fsx_dns_name, self.fsx_mount_name = self.fsx.id, self.fsx.dns_name, self.fsx.mount_name
        self.fsx_capacity_gib = args.plan.checkpoint.fsx_capacity_gib
        # Datasets flow in from S3; checkpoints flow both ways (written on FSx, exported to S3); so do the
        # operations baselines (fabric matrix), under a prefix of their own that no lifecycle rule expires.
        self.dataset_dir, self.checkpoint_dir = DATASET_DIR, CHECKPOINT_DIR
        self.baseline_dir = "/baselines"
        links = [
            (self.dataset_dir, s.dataset_prefix, AUTO_EVENTS, None),
            (self.checkpoint_dir, s.checkpoint_prefix, CHECKPOINT_EVENTS, CHECKPOINT_EVENTS),
            (self.baseline_dir, BASELINE_PREFIX, AUTO_EVENTS, AUTO_EVENTS),
        ]
        if args.weights_prefix:  # served weights flow in only: the serving init container reads /fsx/<prefix>
            links.append(("/" + args.weights_prefix.strip("/"), args.weights_prefix, AUTO_EVENTS, None))
        for path, prefix, imported, exported in links:
            self._link(name, path, prefix, imported, exported, tags)
        self.register_outputs({"bucket_name": self.bucket_name, "fsx_id": self.fsx_id})

    def _buckets(
        self, name: str, args: StorageArgs, tags: dict
    ) -> tuple[pulumi.Output[str], pulumi.Output[str], pulumi.Output[str] | None]:
        """The training bucket and its access-log bucket: (bucket name, bucket ARN, access-log bucket name).
        An existing bucket is only referenced, and has no access-log bucket here (None)."""
        s = args.storage
        if s.existing_bucket:  # the organisation's bucket: referenced, not managed here
            return pulumi.Output.from_input(s.bucket_name), pulumi.Output.concat("arn:aws:s3:::", s.bucket_name), None
        logs = self._bucket(f"{name}-access-logs", None, tags, kms_key_arn=None, rules=access_log_rules(s))
        data = self._bucket(
            name, s.bucket_name, tags, kms_key_arn=args.data_kms_key_arn, rules=lifecycle_rules(s), log_bucket=logs
        )
        return data.bucket, data.arn, logs.bucket

    def _fsx_log_group(self, name: str, args: StorageArgs, tags: dict) -> aws.cloudwatch.LogGroup:
        return aws.cloudwatch.LogGroup(
            f"{name}-fsx",
            name=f"/aws/fsx/supernode-{args.ctx.stack}",
            retention_in_days=args.log_retention_days,
            kms_key_id=args.logs_kms_key_arn,
            tags=tags,
            opts=self._child,
        )

    def _file_system(
        self, name: str, args: StorageArgs, log_group: aws.cloudwatch.LogGroup
    ) -> aws.fsx.LustreFileSystem:
        """FSx for Lustre in the GPU subnet, logging to `log_group`."""
        fsx = args.storage.fsx
        # Capacity and per-unit throughput come from the plan: one checkpoint writes within budget.
        return aws.fsx.LustreFileSystem(
            name,
            deployment_type=fsx.deployment_type,
            storage_type="SSD",
            storage_capacity=args.plan.checkpoint.fsx_capacity_gib,
            per_unit_storage_throughput=fsx.per_unit_throughput,
            subnet_ids=args.fsx_subnet_id,
            security_group_ids=[self.fsx_security_group_id],
            kms_key_id=args.data_kms_key_arn,
            file_system_type_version="2.15",
            data_compression_type="LZ4",
            log_configuration=aws.fsx.LustreFileSystemLogConfigurationArgs(
                level="WARN_ERROR", destination=log_group.arn
            ),
            tags=args.ctx.tagged({"Name": f"supernode-{args.ctx.stack}"}),
            opts=self._child,
        )

    def _link(
        self,
        name: str,
        path: str,
        prefix: str,
        imported: list[str],
        exported: list[str] | None,
        tags: dict,
    ) -> aws.fsx.DataRepositoryAssociation:
        """The file system's `path` linked to the bucket's `prefix`: the S3 events it imports, and
        those it exports (None: it exports nothing)."""
        return aws.fsx.DataRepositoryAssociation(
            f"{name}{path.replace('/', '-')}",
            file_system_id=self.fsx.id,
            file_system_path=path,
            data_repository_path=pulumi.Output.concat("s3://", self.bucket_name, "/", prefix),
            batch_import_meta_data_on_create=True,
            delete_data_in_filesystem=False,
            s3=aws.fsx.DataRepositoryAssociationS3Args(
                auto_import_policy=aws.fsx.DataRepositoryAssociationS3AutoImportPolicyArgs(events=imported),
                auto_export_policy=aws.fsx.DataRepositoryAssociationS3AutoExportPolicyArgs(events=exported)
                if exported
                else None,
            ),
            tags=tags,
            opts=self._child,
        )

    def _bucket(
        self,
        name: str,
        bucket_name: str | None,
        tags: dict,
        kms_key_arn: pulumi.Input[str] | None,
        rules: list,
        log_bucket: aws.s3.Bucket | None = None,
    ) -> aws.s3.Bucket:
        child = self._child
        bucket = aws.s3.Bucket(name, bucket=bucket_name, force_destroy=False, tags=tags, opts=child)
        aws.s3.BucketOwnershipControls(
            name,
            bucket=bucket.id,
            opts=child,
            rule=aws.s3.BucketOwnershipControlsRuleArgs(object_ownership="BucketOwnerEnforced"),
        )
        block = aws.s3.BucketPublicAccessBlock(
            name,
            bucket=bucket.id,
            block_public_acls=True,
            block_public_policy=True,
            ignore_public_acls=True,
            restrict_public_buckets=True,
            opts=child,
        )
        # S3 server access logs can only be delivered to an SSE-S3 bucket, so that one uses AES256.
        by_default = aws.s3.BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultArgs(
            sse_algorithm="aws:kms" if kms_key_arn else "AES256", kms_master_key_id=kms_key_arn
        )
        aws.s3.BucketServerSideEncryptionConfiguration(
            name,
            bucket=bucket.id,
            opts=child,
            rules=[
                aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                    apply_server_side_encryption_by_default=by_default, bucket_key_enabled=bool(kms_key_arn)
                )
            ],
        )
        versioning = aws.s3.BucketVersioning(
            name,
            bucket=bucket.id,
            opts=child,
            versioning_configuration=aws.s3.BucketVersioningVersioningConfigurationArgs(status="Enabled"),
        )
        aws.s3.BucketLifecycleConfiguration(
            name, bucket=bucket.id, rules=rules, opts=pulumi.ResourceOptions(parent=self, depends_on=[versioning])
        )
        statements = [deny_insecure_transport]
        if log_bucket is None:  # this is the log bucket: S3's logging service may write into it
            statements.append(
                lambda arn: {
                    "Sid": "S3ServerAccessLogs",
                    "Effect": "Allow",
                    "Principal": {"Service": "logging.s3.amazonaws.com"},
                    "Action": "s3:PutObject",
                    "Resource": f"{arn}/*",
                }
            )
        aws.s3.BucketPolicy(
            name,
            bucket=bucket.id,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[block]),
            policy=bucket.arn.apply(lambda arn: json.dumps(policy_document(*(f(arn) for f in statements)))),
        )
        if log_bucket is not None:
            aws.s3.BucketLogging(
                name,
                bucket=bucket.id,
                target_bucket=log_bucket.id,
                target_prefix=pulumi.Output.concat(bucket.bucket, "/"),
                opts=child,
            )
        return bucket

    def _fsx_security_group(self, name: str, args: StorageArgs) -> pulumi.Output[str]:
        child = self._child
        sg = aws.ec2.SecurityGroup(
            f"{name}-fsx",
            vpc_id=args.vpc_id,
            description="FSx for Lustre: from GPU nodes only",
            tags=args.ctx.tagged({"Name": f"supernode-{args.ctx.stack}-fsx"}),
            opts=child,
        )
        for lo, hi in LUSTRE_PORTS:
            # Clients are the GPU nodes; the file servers also talk to each other on these ports.
            for source, label in ((args.node_security_group_id, "nodes"), (sg.id, "self")):
                aws.vpc.SecurityGroupIngressRule(
                    f"{name}-fsx-{lo}-{hi}-from-{label}",
                    security_group_id=sg.id,
                    ip_protocol="tcp",
                    from_port=lo,
                    to_port=hi,
                    referenced_security_group_id=source,
                    description=f"Lustre {lo}-{hi} from {label}",
                    opts=child,
                )
            aws.vpc.SecurityGroupEgressRule(
                f"{name}-fsx-{lo}-{hi}-to-self",
                security_group_id=sg.id,
                ip_protocol="tcp",
                from_port=lo,
                to_port=hi,
                referenced_security_group_id=sg.id,
                description=f"Lustre {lo}-{hi} among file servers",
                opts=child,
            )
        return sg.id
