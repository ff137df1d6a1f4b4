"""Policy configuration: one pydantic model per configurable policy, defaults applied here.

The pulumi-policy SDK hands a policy only the keys the user set (it does not apply `config_schema`
defaults; the Pulumi CLI does, the offline runner does not), so every policy reads its settings
through `settings_for`, which validates and fills in defaults. The JSON schema the CLI validates
`--policy-pack-config` against is generated from the same model, so the two cannot drift.
Keys are camelCase, as in Pulumi policy config files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pulumi_policy import PolicyConfigSchema
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from supernode.core.catalog import CATALOG


class PolicySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


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


class LogRetention(PolicySettings):
    min_retention_days: int = Field(default=7, ge=1, description="shortest CloudWatch log retention allowed")


S = TypeVar("S", bound=PolicySettings)


class PolicyConfigError(ValueError):
    """Policy config that does not validate; names the policy, key and value."""


def settings_for(policy: str, model: type[S], raw: Mapping[str, Any] | None) -> S:
    data = {k: v for k, v in (raw or {}).items() if k != "enforcementLevel"}
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{policy}.{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r})"
            for err in e.errors(include_url=False)
        )
        raise PolicyConfigError(problems) from None


def schema_for(model: type[PolicySettings]) -> PolicyConfigSchema:
    schema = model.model_json_schema(by_alias=True)
    props = {k: {kk: vv for kk, vv in v.items() if kk != "title"} for k, v in schema["properties"].items()}
    return PolicyConfigSchema(properties=props)
