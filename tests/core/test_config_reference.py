"""Issue 31: the configuration reference is complete: every key has a description, an optional key
whose default depends on other keys says what it is and when, and the cross-field rules list the NAT
gateway's need for public subnets."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from supernode.core.config import ConfigError, from_mapping, read_stack_file
from supernode.core.config.reference import _model_of, reference, unset_meaning
from supernode.core.config.schema import StackConfig

ROOT = Path(__file__).resolve().parents[2]


def every_key(model: type[BaseModel] = StackConfig, path: str = "") -> list[tuple[str, object]]:
    """(path, FieldInfo) of every key under `model`; local's override sections repeat model, parallel
    and training key for key (the reference says so), so they are walked as those sections."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{path}.{field.alias or name}" if path else field.alias or name
        out.append((key, field))
        sub = _model_of(field.annotation)
        if sub is not None and not sub.__name__.endswith("Override"):
            out += every_key(sub, key)
    return out


def test_the_walk_reaches_every_section():
    keys = {k for k, _ in every_key()}
    assert {"region", "network.natGateway", "acceleratorNodeGroups.capacity.reservationId"} <= keys
    assert {"parallel.dpShard", "training.data.weight", "inference.gpuQuota", "local.nproc"} <= keys
    assert len(keys) > 140


def test_every_key_has_a_description():
    missing = [k for k, f in every_key() if not (f.description or "").strip()]
    assert not missing, f"keys without a description (Field(description=...)): {missing}"


def test_every_optional_key_says_what_unset_means():
    blank = [k for k, f in every_key() if not f.is_required() and f.get_default() is None and not unset_meaning(f)]
    assert not blank, f"optional keys whose default is blank (json_schema_extra=when_unset(...)): {blank}"


def test_no_reference_row_has_a_blank_default_or_description():
    rows = [line for line in reference().splitlines() if line.startswith("| `")]
    assert len(rows) > 140
    for row in rows:
        key, _type, default, _allowed, description = [c.strip() for c in row.strip("|").split(" | ")]
        assert default and description, row
    by_key = {row.split(" | ")[0].strip("| `"): row for row in rows}
    assert (
        "unset: on for a VPC the stack creates (needs publicSubnetCidrs); off with existingVpcId"
        in by_key["natGateway"]
    )
    assert "unset: on for on-demand capacity; off for a capacity reservation" in by_key["placementGroup"]


def created_vpc_without_public_subnets(nat: bool | None) -> dict:
    data = read_stack_file(ROOT / "Pulumi.dev.yaml")
    data["network"] = {k: v for k, v in data["network"].items() if k != "publicSubnetCidrs"}
    if nat is not None:
        data["network"]["natGateway"] = nat
    return data


@pytest.mark.parametrize("nat,said", [(None, "is true by default (a VPC the stack creates)"), (True, "is true but")])
def test_a_nat_gateway_without_public_subnets_names_both_keys(nat, said):
    with pytest.raises(ConfigError) as e:
        from_mapping(created_vpc_without_public_subnets(nat))
    [issue] = [str(i) for i in e.value.issues if "natGateway" in str(i)]
    assert issue.startswith("supernode:network.natGateway: ") and said in issue
    assert "network.publicSubnetCidrs is empty: a NAT gateway needs public subnets" in issue
    assert "set network.publicSubnetCidrs (one CIDR per availability zone, 2) or network.natGateway: false" in issue
    assert "(got" not in issue
    from_mapping(created_vpc_without_public_subnets(False))  # no NAT gateway: no public subnets needed


def test_the_nat_rule_is_in_the_reference():
    rules = reference().split("## Rules across keys", 1)[1]
    assert (
        "a NAT gateway (natGateway, on by default in a created VPC) needs public subnets (publicSubnetCidrs)" in rules
    )
