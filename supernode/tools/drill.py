"""Checkpoint restore drill ("建立检查点备份与恢复演练机制"): prove the newest checkpoint in S3 can
be brought back and used, and how long that takes.

1. Find the newest complete checkpoint under the stack's checkpoint prefix (where the FSx data
   repository association exports the trainer's checkpoints): the highest `step_N/` with a
   `COMPLETE` marker.
2. Download it into a fresh directory, timing it (MB/s).
3. Verify it with the trainer's own check (`checkpoint_problem`: every file of the marker
   present and matching its sha256), so the drill and a resume agree on what is usable.
4. Load its model state into the plan's model on CPU (local scale: a model that fits in this
   machine's memory), or, for a cluster-scale model, say how the GPU nodes load it (a resume).

The result is one record (and, with --json, one JSON line whose `restore_drill` field the
monitoring's log metric filter counts: "failed" pages).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.checkpoints import checkpoint_problem, read_marker
from ..core.errors import BadInput
from ..core.plan import PLAN_MOUNT_PATH, Plan
from .awscheck import Aws, describe_error
from .checkpoints import run_name

STEP_MARKER = re.compile(r"^(?P<dir>(?:.*/)?step_(?P<step>\d{8})/)COMPLETE$")
LOCAL_LOAD_LIMIT_BYTES = 8 << 30  # a model state above this is loaded by the cluster Job, not on this machine


@dataclass
class DrillResult:
    result: str  # "passed" | "failed"
    detail: str
    bucket: str
    prefix: str
    step: int | None = None
    source: str = ""
    restored_to: str = ""
    files: int = 0
    bytes: int = 0
    download_s: float = 0.0
    mb_per_s: float = 0.0
    verify_s: float = 0.0
    load_s: float | None = None
    loaded_tensors: int | None = None
    cluster_command: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result == "passed"

    def to_json(self) -> dict[str, Any]:
        return {"restore_drill": self.result, **{k: v for k, v in asdict(self).items() if k != "result"}}


def latest_checkpoint(
    s3: Any, bucket: str, prefix: str, step: int | None = None, run: str | None = None
) -> tuple[int, str] | None:
    """(step, key prefix of its directory) of the newest checkpoint with a COMPLETE marker, or None;
    with `step` (and `run`, as `supernode checkpoints` names it: a run id, or the directory holding
    its step_N/ relative to `prefix`) that checkpoint. A step that several runs have needs `run`."""

    def directory(key_dir: str) -> str:
        return key_dir[len(prefix) :].rstrip("/").rpartition("/")[0]

    found: list[tuple[int, str]] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            m = STEP_MARKER.fullmatch(obj["Key"])
            if not m or (step is not None and int(m["step"]) != step):
                continue
            if run is not None and run.strip("/") not in (directory(m["dir"]), run_name(directory(m["dir"]))):
                continue
            found.append((int(m["step"]), m["dir"]))
    if step is not None and len(found) > 1:
        names = ", ".join(sorted(run_name(directory(d)) for _, d in found))
        raise BadInput(f"--step {step}: several runs have it ({names}); choose one with --run")
    return max(found, default=None)


def download(s3: Any, bucket: str, key_prefix: str, dest: Path) -> tuple[int, int]:
    """Every object under `key_prefix` into `dest` (flat: a checkpoint directory has no subdirectories)."""
    files = size = 0
    dest.mkdir(parents=True, exist_ok=True)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(key_prefix) :]
            if not name or "/" in name:
                continue
            s3.download_file(bucket, obj["Key"], str(dest / name))
            files, size = files + 1, size + obj["Size"]
    return files, size


def load_model_state(path: Path, plan: Plan) -> int:
    """Load the checkpoint's model state into the plan's model on CPU (one process, no process group);
    returns the number of tensors loaded. torch only here: the rest of the drill needs none."""
    import torch
    import torch.distributed.checkpoint as dcp

    from supernode.trainer.model import Transformer

    with torch.device("cpu"):
        model = Transformer(plan.model)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # one process without a process group is exactly the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])
    return len(state["model"])


def cluster_command(plan: Plan, path: str) -> list[str]:
    """How a model too large for one CPU host is loaded: a resume from the restored directory on the
    GPU nodes (torchrun per node, as the PyTorchJob runs the trainer)."""
    return [
        "python",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(plan.nodes),
        "--nproc-per-node",
        str(plan.accelerators_per_node),
        "-m",
        "supernode.trainer.train",
        "--plan",
        PLAN_MOUNT_PATH,
        "--out",
        path,
    ]


def restore_drill(
    aws: Aws,
    bucket: str,
    prefix: str,
    plan: Plan,
    dest: Path | None = None,
    load: bool = True,
    step: int | None = None,
    run: str | None = None,
) -> DrillResult:
    base = DrillResult(result="failed", detail="", bucket=bucket, prefix=prefix)
    s3 = aws.client("s3")
    try:
        found = latest_checkpoint(s3, bucket, prefix, step, run)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - any AWS failure is the drill's finding, said in one line
        base.detail = f"cannot list s3://{bucket}/{prefix}: {describe_error(e)[0]}"
        return base
    if found is None:
        wanted = "" if step is None else f" of step {step}" + ("" if run is None else f" in run {run}")
        base.detail = f"no complete checkpoint{wanted} (step_N/COMPLETE) under s3://{bucket}/{prefix}"
        return base
    step, key_prefix = found
    target = Path(tempfile.mkdtemp(prefix="restore-drill-", dir=dest)) / f"step_{step:08d}"
    base.step, base.source, base.restored_to = step, f"s3://{bucket}/{key_prefix}", str(target)
    t0 = time.perf_counter()
    try:
        base.files, base.bytes = download(s3, bucket, key_prefix, target)
    except Exception as e:  # noqa: BLE001
        base.detail = f"download of {base.source} failed: {describe_error(e)[0]}"
        return base
    base.download_s = round(time.perf_counter() - t0, 3)
    base.mb_per_s = round(base.bytes / 1e6 / max(base.download_s, 1e-6), 1)
    t0 = time.perf_counter()
    problem = checkpoint_problem(target)
    base.verify_s = round(time.perf_counter() - t0, 3)
    if problem is not None:
        base.detail = f"step {step} does not verify: {problem}"
        return base
    saved_model = read_marker(target).get("model")
    if isinstance(saved_model, dict) and saved_model != plan.model.model_dump(mode="json"):
        base.detail = (
            f"step {step} was written for another model than the plan's (model settings differ); "
            "drill with the plan that wrote it"
        )
        return base
    if not load:
        base.result, base.detail = "passed", f"step {step} restored and verified (not loaded: --no-load)"
        return base
    if plan.params.total * 4 > LOCAL_LOAD_LIMIT_BYTES:
        base.cluster_command = cluster_command(plan, str(target.parent))
        base.result = "passed"
        base.detail = (
            f"step {step} restored and verified; its model ({plan.params.total / 1e9:.1f} B parameters) "
            "is loaded by a resume on the GPU nodes, not on this machine"
        )
        return base
    t0 = time.perf_counter()
    try:
        base.loaded_tensors = load_model_state(target, plan)
    except Exception as e:  # noqa: BLE001 - a checkpoint that does not load is the finding
        base.detail = (
            f"step {step} verified but does not load into the plan's model: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        )
        return base
    base.load_s = round(time.perf_counter() - t0, 3)
    base.result = "passed"
    base.detail = f"step {step} restored, verified and loaded into the plan's model ({base.loaded_tensors} tensors)"
    return base


def cleanup(result: DrillResult) -> None:
    """Remove the restored copy (the drill proves a restore; it keeps no second copy)."""
    if result.restored_to:
        shutil.rmtree(Path(result.restored_to).parent, ignore_errors=True)
