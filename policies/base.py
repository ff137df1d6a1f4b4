"""Constructors shared by the checklist and security modules: each policy is one plain function.

A stack check is `check(stack, settings, report)` and a resource check `check(res, settings, report)`,
where `report(res, message)` names the offending resource. The constructors wrap them into
pulumi-policy objects, apply config defaults (`settings_for`) and record which checklist item each
policy enforces (`ITEMS`), which the compliance table and JUnit report use.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from pulumi_policy import (EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy,
                           StackValidationArgs, StackValidationPolicy)

from .settings import PolicySettings, schema_for, settings_for
from .view import PlanError, Res, Stack

ITEMS: dict[str, int] = {}  # policy name -> checklist item (1-10)
SETTINGS: dict[str, type[PolicySettings]] = {}  # policy name -> its config model (configurable ones)

Report = Callable[[Optional[Res], str], None]
StackCheck = Callable[[Stack, Any, Report], None]
ResourceCheck = Callable[[Res, Any, Report], None]
Remediation = Callable[[Res], Optional[Mapping[str, Any]]]


def _register(name: str, item: int, settings: Optional[type[PolicySettings]]) -> None:
    ITEMS[name] = item
    if settings:
        SETTINGS[name] = settings


def stack_policy(name: str, item: int, description: str, check: StackCheck, *,
                 level: EnforcementLevel = EnforcementLevel.MANDATORY,
                 settings: Optional[type[PolicySettings]] = None) -> StackValidationPolicy:
    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        stack = Stack.from_policy_resources(args.resources)
        conf = settings_for(name, settings, args.get_config()) if settings else None

        def report(res: Optional[Res], message: str) -> None:
            report_violation(message, res.urn if res else None)

        try:
            check(stack, conf, report)
        except PlanError as e:
            cm = stack.plan_config_map()
            report(cm, str(e))

    _register(name, item, settings)
    return StackValidationPolicy(name=name, description=description, validate=validate, enforcement_level=level,
                                 config_schema=schema_for(settings) if settings else None,
                                 tags=[f"checklist-{item}"])


def resource_policy(name: str, item: int, description: str, types: tuple[str, ...], check: ResourceCheck, *,
                    level: EnforcementLevel = EnforcementLevel.MANDATORY,
                    settings: Optional[type[PolicySettings]] = None,
                    remediate: Optional[Remediation] = None) -> ResourceValidationPolicy:
    def res_of(args: ResourceValidationArgs) -> Res:
        return Res(type=args.resource_type, name=args.name, urn=args.urn, props=args.props,
                   parent=args.opts.parent or "")

    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        if args.resource_type in types:
            conf = settings_for(name, settings, args.get_config()) if settings else None
            check(res_of(args), conf, lambda _res, message: report_violation(message, None))

    def fix(args: ResourceValidationArgs) -> Optional[Mapping[str, Any]]:
        return remediate(res_of(args)) if remediate and args.resource_type in types else None

    _register(name, item, settings)
    return ResourceValidationPolicy(name=name, description=description, validate=validate,
                                    remediate=fix if remediate else None, enforcement_level=level,
                                    config_schema=schema_for(settings) if settings else None,
                                    tags=[f"checklist-{item}"])
