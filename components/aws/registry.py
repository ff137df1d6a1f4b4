"""The trainer image's ECR repository (one per stack). `make image` builds the Dockerfile and pushes
to it; the digest it prints goes into `supernode:images.trainer`, which the PyTorchJob and the
interconnect gate run.

Tags are immutable, so a tag never silently changes what a digest-pinned stack runs; every push is
scanned; layers are encrypted with the stack's data key (the image carries the training code);
untagged images (a tag's earlier pushes cannot exist, so these are failed or manual pushes) expire.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from ..context import StackContext

UNTAGGED_EXPIRE_DAYS = 14
LIFECYCLE_POLICY = {
    "rules": [
        {
            "rulePriority": 1,
            "description": f"expire untagged images {UNTAGGED_EXPIRE_DAYS} days after push",
            "selection": {
                "tagStatus": "untagged",
                "countType": "sinceImagePushed",
                "countUnit": "days",
                "countNumber": UNTAGGED_EXPIRE_DAYS,
            },
            "action": {"type": "expire"},
        }
    ]
}


def repository_name(stack: str) -> str:
    return f"supernode-{stack}-trainer"


@dataclass
class RegistryArgs:
    ctx: StackContext
    kms_key_arn: pulumi.Input[str]  # the stack's data key (Keys.data_key_arn)


class Registry(pulumi.ComponentResource):
    url: pulumi.Output[str]

    def __init__(self, name: str, args: RegistryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:registry:Registry", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        # No force_delete: `pulumi destroy` keeps a repository that still holds images, which are the
        # record of what trained the checkpoints (README, tear-down, says how to delete them first).
        self.repository = aws.ecr.Repository(
            name,
            name=repository_name(args.ctx.stack),
            image_tag_mutability="IMMUTABLE",
            image_scanning_configuration=aws.ecr.RepositoryImageScanningConfigurationArgs(scan_on_push=True),
            encryption_configurations=[
                aws.ecr.RepositoryEncryptionConfigurationArgs(encryption_type="KMS", kms_key=args.kms_key_arn)
            ],
            tags=args.ctx.tagged(),
            opts=child,
        )
        self.lifecycle = aws.ecr.LifecyclePolicy(
            name, repository=self.repository.name, policy=json.dumps(LIFECYCLE_POLICY), opts=child
        )
        self.url = self.repository.repository_url
        self.register_outputs({"url": self.url})
