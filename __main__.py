"""supernode stack: thin wiring from the validated config and plan to the components."""

import pulumi

from supernode.plan import build_plan
from supernode.runtime_config import stack_config

config = stack_config()
plan = build_plan(pulumi.get_stack(), config)

pulumi.export("plan", plan.summary())
