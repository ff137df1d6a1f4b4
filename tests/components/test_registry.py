"""The trainer image's ECR repository (components/aws/registry.py) in the dev and prod previews."""

from __future__ import annotations

import json

from aws_preview import Stack

from supernode.components.aws.registry import LIFECYCLE_POLICY, repository_name
from supernode.core import resource_types as T


def test_repository_is_immutable_scanned_and_encrypted_with_the_stacks_key(stack: Stack):
    repo = stack.one(T.ECR_REPOSITORY)
    assert repo.inputs["name"] == repository_name(stack.result.stack) == f"supernode-{stack.result.stack}-trainer"
    assert repo.inputs["imageTagMutability"] == "IMMUTABLE"
    assert repo.inputs["imageScanningConfiguration"] == {"scanOnPush": True}
    (enc,) = repo.inputs["encryptionConfigurations"]
    assert enc["encryptionType"] == "KMS"
    assert enc["kmsKey"] == stack.outputs["kms_key_arns"]["data"]  # the stack's data key, not AWS's default
    assert not repo.inputs.get("forceDelete")  # destroy keeps images: the record of what trained a checkpoint
    assert repo.inputs["tags"]["Stack"] == stack.result.stack


def test_untagged_images_expire(stack: Stack):
    lifecycle = stack.one(T.ECR_LIFECYCLE_POLICY)
    assert lifecycle.inputs["repository"] == stack.one(T.ECR_REPOSITORY).inputs["name"]
    (rule,) = json.loads(lifecycle.inputs["policy"])["rules"]
    assert rule == LIFECYCLE_POLICY["rules"][0]
    assert rule["selection"]["tagStatus"] == "untagged" and rule["action"] == {"type": "expire"}
    assert rule["selection"]["countType"] == "sinceImagePushed" and rule["selection"]["countNumber"] > 0


def test_repository_url_is_a_stack_output(stack: Stack):
    # `make image` reads it with `pulumi stack output trainer_repository_url`.
    repo = stack.one(T.ECR_REPOSITORY).inputs["name"]
    assert stack.outputs["trainer_repository_url"].endswith(f".dkr.ecr.{stack.cfg.region}.amazonaws.com/{repo}")
    # the stack file's trainer image names this stack's repository
    assert stack.cfg.images.trainer.split("@")[0] == stack.outputs["trainer_repository_url"]
