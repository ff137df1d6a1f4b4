"""StackConfig: one validated description of an environment.

Read from the `supernode:` namespace of `Pulumi.<stack>.yaml` or from Pulumi's runtime config
inside the Pulumi program (components/stack_config.py); both go through `from_mapping`, so there is
one schema (`schema`), one set of
cross-field rules (`rules`, the parallel layout in `supernode.core.layout`) and one loader
(`loading`). Every error names its YAML path (`supernode:parallel.tp`), the bad value and what
would be valid.
"""

from ..errors import ConfigError, Issue
from .loading import from_mapping, load_file, load_stack, read_stack_file, with_local_nproc
from .schema import (
    CW_RETENTION_DAYS,
    DIGEST_RE,
    FSX_PER_UNIT_THROUGHPUT,
    NAMESPACE,
    AcceleratorNodeGroup,
    Capacity,
    ClusterConfig,
    FsxConfig,
    Identity,
    Images,
    Lifecycle,
    Local,
    ManagementConfig,
    ManagementUi,
    Model,
    MonitoringConfig,
    NetworkConfig,
    Parallel,
    StackConfig,
    StorageConfig,
    SystemNodeGroup,
    Team,
    Training,
    Workload,
    stack_key,
)

__all__ = [
    "CW_RETENTION_DAYS",
    "DIGEST_RE",
    "FSX_PER_UNIT_THROUGHPUT",
    "NAMESPACE",
    "AcceleratorNodeGroup",
    "Capacity",
    "ClusterConfig",
    "ConfigError",
    "FsxConfig",
    "Identity",
    "Images",
    "Issue",
    "Lifecycle",
    "Local",
    "ManagementConfig",
    "ManagementUi",
    "Model",
    "MonitoringConfig",
    "NetworkConfig",
    "Parallel",
    "StorageConfig",
    "StackConfig",
    "SystemNodeGroup",
    "Team",
    "Training",
    "Workload",
    "from_mapping",
    "load_file",
    "load_stack",
    "read_stack_file",
    "stack_key",
    "with_local_nproc",
]
