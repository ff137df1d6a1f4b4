"""This rank's memory by term, measured, for the plan's figures beside them (`Plan.memory`).

- `parameters`, `optimizer_state` (the two Adam moments): bytes of this rank's shards, exact on any
  device. Gradients are not measured between steps: they are freed after each update
  (`zero_grad(set_to_none=True)`), so only their peak, inside `peak`, holds them.
- `peak`: on an accelerator the allocator's peak (`torch.accelerator.max_memory_allocated`), against the plan's total
  less its runtime reserve (the CUDA context and communicator buffers are outside the allocator); on
  CPU the process's peak resident memory (VmHWM), Python and torch included: context, not a target.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (VmRSS) or its peak (VmHWM), from /proc (0 where there is none)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's shards of the given (distinct) tensors."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def measured_terms(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, int]:
    moments = (v for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    peak = torch.accelerator.max_memory_allocated(device) if device.type != "cpu" else resident_bytes("VmHWM")
    return {"parameters": local_bytes(model.parameters()), "optimizer_state": local_bytes(moments), "peak": peak}


def planned_terms(plan) -> dict[str, int]:
    """The plan's figures for the same terms (peak: its total less the runtime reserve)."""
    m = plan.memory
    return {
        "parameters": m.parameters,
        "optimizer_state": m.optimizer_state,
        "peak": m.total - m.runtime_reserve,
    }
