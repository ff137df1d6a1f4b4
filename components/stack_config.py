"""StackConfig from Pulumi's runtime config, for the program's `main()` (components/program.py), which the
Pulumi CLI runs (`pulumi up`); the offline preview hands `program` the config it loaded instead.

The CLI hands structured values to the program as JSON strings and plain strings as they are;
both then go through the same `from_mapping` as the stack file, so there is one schema.
"""

from __future__ import annotations

import json

import pulumi
from pulumi.runtime import config as runtime_config

from supernode.core.config import NAMESPACE, ConfigError, StackConfig, from_mapping


def _raw_config() -> dict[str, object]:
    merged = dict(runtime_config.get_config_env())
    merged.update(runtime_config.CONFIG.get())
    return merged


def stack_config() -> StackConfig:
    data = {}
    for key, value in _raw_config().items():
        ns, _, name = key.partition(":")
        if ns != NAMESPACE:
            continue
        if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass  # left as a string: the schema reports it with its path
        data[name] = value
    try:
        return from_mapping(data, f"stack {pulumi.get_stack()}")
    except ConfigError as e:
        # RunError is shown by the Pulumi CLI as a message, without a Python traceback.
        raise pulumi.RunError("invalid supernode config:\n" + "\n".join(f"  {i}" for i in e.issues)) from None
