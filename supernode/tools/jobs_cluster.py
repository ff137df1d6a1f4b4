"""The cluster backend of `supernode job` (issue 36, item 3): not built yet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from supernode.core.config import StackConfig
from supernode.core.errors import BadInput
from supernode.core.jobs import JobSpec, JobStatus
from supernode.core.plan import Plan


class ClusterBackend:
    def __init__(self, stack: str, cfg: StackConfig, kubeconfig: Path | None = None, context: str | None = None):
        self.stack, self.cfg, self.kubeconfig, self.context = stack, cfg, kubeconfig, context

    def submit(self, job: JobSpec, plan: Plan, dry_run: Path | None = None) -> JobStatus:
        raise BadInput("the cluster backend of supernode job is not built yet; use --local")

    def list(self, team: str | None = None) -> list[JobStatus]:
        raise BadInput("the cluster backend of supernode job is not built yet; use --local")

    def describe(self, name: str, team: str | None = None) -> JobStatus:
        raise BadInput("the cluster backend of supernode job is not built yet; use --local")

    def logs(self, name: str, team: str | None = None, follow: bool = False) -> Iterator[str]:
        raise BadInput("the cluster backend of supernode job is not built yet; use --local")

    def cancel(self, name: str, team: str | None = None) -> JobStatus:
        raise BadInput("the cluster backend of supernode job is not built yet; use --local")
