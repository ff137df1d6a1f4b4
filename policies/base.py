"""The two kinds of checklist policy: each one plain check function, wrapped with what the pack needs.

A stack check is `check(stack, settings, report)` and a resource check `check(res, settings, report)`,
where `report(res, message)` names the offending resource. `StackPolicy` and `ResourcePolicy` are the
pulumi-policy classes plus the checklist item the policy enforces and its settings model; the pack,
the offline runner and the reports ask the policy objects for these. Each module registers its policies
in a `Registry` by a decorator on the check, so a policy is declared where it is defined.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyResource,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from .settings import PolicySettings, schema_for, settings_for
from .view import PlanError, Res, Stack

Report = Callable[[Res | None, str], None]
StackCheck = Callable[[Stack, Any, Report], None]
ResourceCheck = Callable[[Res, Any, Report], None]
Remediation = Callable[[Res], Mapping[str, Any] | None]


class ChecklistPolicy:
    """What a supernode policy carries besides what pulumi-policy knows (mixed into its policy classes)."""

    name: str
    item: int  # the deployment checklist item it enforces (1-10): the compliance table and JUnit group by it
    settings: type[PolicySettings] | None  # its config model; None: the policy takes no settings

    def settings_from(self, raw: Mapping[str, Any] | None) -> Any:
        """The policy's settings, validated with defaults filled in (pulumi-policy applies no defaults)."""
        return settings_for(self.name, self.settings, raw) if self.settings else None


# -- one parsed Stack per analysis ----------------------------------------------------------------
# pulumi-policy's AnalyzeStack rebuilds `args.resources` for every stack policy (new PolicyResource
# objects and property proxies, see _PolicyAnalyzerServicer.AnalyzeStack), so nothing in `args` is
# shared between the policies of one analysis. The offline runner marks the analysis instead:
# inside `one_analysis()` the stack policies share the Stack the first one built. Without it (the
# Pulumi CLI serving the pack) each policy wraps its own Stack; the Plan is still parsed once, since
# its parse is keyed on the ConfigMap text (view._plan_from_json).
_ANALYSIS: ContextVar[dict[str, Any] | None] = ContextVar("supernode_policy_analysis", default=None)


@contextmanager
def one_analysis() -> Iterator[None]:
    """Around one AnalyzeStack call: its stack policies see the same resources, so parse them once."""
    token = _ANALYSIS.set({})
    try:
        yield
    finally:
        _ANALYSIS.reset(token)


def stack_of(resources: Sequence[PolicyResource]) -> Stack:
    memo = _ANALYSIS.get()
    if memo is None:
        return Stack.from_policy_resources(resources)
    urns = [r.urn for r in resources]
    if memo.get("urns") != urns:  # a guard: one analysis is one resource list
        memo.update(urns=urns, stack=Stack.from_policy_resources(resources))
    return memo["stack"]


class MalformedInput(Exception):
    """A policy could not read a resource's properties: they do not have the shape the provider
    gives them (a string where an object belongs, a list swapped for a mapping, ...)."""

    def __init__(self, policy: str, where: str, error: Exception):
        self.policy, self.where = policy, where
        super().__init__(f"policy {policy} cannot read {where}: {type(error).__name__}: {str(error)[:200]}")


# What reading a wrongly shaped property raises (not UnknownValueError: the SDK handles that one).
_SHAPE_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError)


class StackPolicy(ChecklistPolicy, StackValidationPolicy):
    def __init__(
        self,
        name: str,
        item: int,
        description: str,
        check: StackCheck,
        *,
        level: EnforcementLevel = EnforcementLevel.MANDATORY,
        settings: type[PolicySettings] | None = None,
    ):
        self.item, self.settings, self.check = item, settings, check
        super().__init__(
            name=name,
            description=description,
            enforcement_level=level,
            config_schema=schema_for(settings) if settings else None,
            tags=[f"checklist-{item}"],
        )

    def validate(self, args: StackValidationArgs, report_violation: ReportViolation) -> None:
        stack = stack_of(args.resources)
        conf = self.settings_from(args.get_config())

        def report(res: Res | None, message: str) -> None:
            report_violation(message, res.urn if res else None)

        try:
            self.check(stack, conf, report)
        except PlanError as e:
            report(stack.plan_config_map(), str(e))
        except _SHAPE_ERRORS as e:
            raise MalformedInput(self.name, "the stack's resources", e) from e


class ResourcePolicy(ChecklistPolicy, ResourceValidationPolicy):
    def __init__(
        self,
        name: str,
        item: int,
        description: str,
        types: tuple[str, ...],
        check: ResourceCheck,
        *,
        level: EnforcementLevel = EnforcementLevel.MANDATORY,
        settings: type[PolicySettings] | None = None,
        remediate: Remediation | None = None,
    ):
        self.item, self.settings, self.types, self.check, self.fix = item, settings, types, check, remediate
        # Passed, not overridden: pulumi-policy treats a subclass that overrides `remediate` as remediating.
        super().__init__(
            name=name,
            description=description,
            enforcement_level=level,
            config_schema=schema_for(settings) if settings else None,
            tags=[f"checklist-{item}"],
            remediate=self._remediate if remediate else None,
        )

    @staticmethod
    def _res(args: ResourceValidationArgs) -> Res:
        return Res(
            type=args.resource_type, name=args.name, urn=args.urn, props=args.props, parent=args.opts.parent or ""
        )

    def validate(self, args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        if args.resource_type in self.types:
            conf = self.settings_from(args.get_config())
            try:
                self.check(self._res(args), conf, lambda _res, message: report_violation(message, None))
            except _SHAPE_ERRORS as e:
                raise MalformedInput(self.name, args.urn, e) from e

    def _remediate(self, args: ResourceValidationArgs) -> Mapping[str, Any] | None:
        if not (self.fix and args.resource_type in self.types):
            return None
        try:
            return self.fix(self._res(args))
        except _SHAPE_ERRORS as e:
            raise MalformedInput(self.name, args.urn, e) from e


class Registry(list):
    """A module's policies in the order they are defined, each registered by a decorator on its check,
    beside which its metadata (name, checklist item, description, level) and its settings model live."""

    def stack(
        self,
        name: str,
        item: int,
        description: str,
        *,
        level: EnforcementLevel = EnforcementLevel.MANDATORY,
        settings: type[PolicySettings] | None = None,
    ) -> Callable[[StackCheck], StackCheck]:
        def register(check: StackCheck) -> StackCheck:
            self.append(StackPolicy(name, item, description, check, level=level, settings=settings))
            return check

        return register

    def resource(
        self,
        name: str,
        item: int,
        description: str,
        types: tuple[str, ...],
        *,
        level: EnforcementLevel = EnforcementLevel.MANDATORY,
        settings: type[PolicySettings] | None = None,
        remediate: Remediation | None = None,
    ) -> Callable[[ResourceCheck], ResourceCheck]:
        def register(check: ResourceCheck) -> ResourceCheck:
            self.append(
                ResourcePolicy(
                    name, item, description, types, check, level=level, settings=settings, remediate=remediate
                )
            )
            return check

        return register
