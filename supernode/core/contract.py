"""Typed stack-output contract other teams consume through `pulumi.StackReference`.

Versioned: a consumer states the major version it understands; `CONTRACT_VERSION` changes major
when a field is removed or changes meaning. The program (components/program.py) exports exactly these keys
(`StackOutputs.model_fields`), and `supernode.components.aws.outputs.read_stack_outputs` (pulumi side) validates
what a StackReference returns against this model.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

CONTRACT_VERSION = "1.2"  # 1.1: trainer_repository_url; 1.2: management_ui


class ManagementUiOutputs(BaseModel):
    """Where the management page is reached (an internal load balancer) and where its audit log goes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    load_balancer_dns_name: str | None = None  # None until the load balancer exists (a preview)
    audit_log_group: str


class StackOutputs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    contract_version: str
    cluster_name: str
    cluster_endpoint: str
    cluster_version: str
    oidc_issuer_url: str
    oidc_provider_arn: str
    node_group_names: list[str]
    system_node_group_name: str
    vpc_id: str
    private_subnet_ids: list[str]
    gpu_subnet_id: str
    efa_security_group_id: str
    bucket_name: str
    dataset_prefix: str
    checkpoint_prefix: str
    fsx_id: str
    fsx_dns_name: str
    fsx_mount_name: str
    kms_key_arns: dict[str, str]
    sns_topic_arn: str
    trainer_role_arn: str
    log_group_names: list[str]
    alarm_names: list[str]
    kubeconfig: str  # exported as a secret
    trainer_repository_url: str | None = None  # 1.1: the ECR repository `make image` pushes to
    management_ui: ManagementUiOutputs | None = None  # 1.2: where the stack deploys the page
