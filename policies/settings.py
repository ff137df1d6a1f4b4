"""Policy configuration: each configurable policy's pydantic model (beside its check) derives from
PolicySettings, and reads its settings here, defaults applied.

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
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel


class PolicySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


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
