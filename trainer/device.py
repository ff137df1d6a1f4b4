"""The device and process-group backend a trainer process runs on, from the plan's accelerator.

The plan's instance type names its vendor (supernode.core.catalog InstanceType.torch_device):

- cuda (NVIDIA GPUs): the local GPU, backend "cuda:nccl,cpu:gloo" (NCCL for device tensors, gloo for
  the CPU tensors the trainer also reduces). A host without a GPU runs the same plan on CPU with gloo,
  as the tests and `supernode bench` do.
- neuron (Trainium2): TorchNeuron, the native PyTorch backend of Neuron 2.33+, registers the
  PrivateUse1 device `neuron` and the process-group backend `neuron` when `torch_neuronx` is
  imported. It is imported here and only here, only for a Neuron plan: it is not installable on
  other hosts. A Neuron plan without it is bad input (a 256-rank Trainium job on CPU is a mistake,
  not a fallback).
- cpu (a local plan, or no accelerator): gloo.

The device is set through `torch.accelerator`, the device-generic API TorchNeuron implements, so one
code path serves both accelerators.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

from supernode.core.errors import BadInput

Kind = Literal["cuda", "neuron", "cpu"]
# init_process_group's backend per device kind: the trainer's (which also reduces CPU tensors), and
# the device's own collectives alone (what the interconnect gate measures).
BACKENDS: dict[str, str] = {"cuda": "cuda:nccl,cpu:gloo", "neuron": "neuron", "cpu": "gloo"}
DEVICE_BACKENDS: dict[str, str] = {"cuda": "nccl", "neuron": "neuron", "cpu": "gloo"}
NEURON_MODULE = "torch_neuronx"  # registers the `neuron` device and process-group backend


@dataclass(frozen=True)
class DeviceChoice:
    kind: Kind
    device: torch.device
    backend: str  # for torch.distributed.init_process_group

    @property
    def accelerated(self) -> bool:
        return self.kind != "cpu"

    @property
    def device_backend(self) -> str:
        """The device's own collectives backend (NCCL, Neuron's, or gloo on CPU)."""
        return DEVICE_BACKENDS[self.kind]


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def cpu() -> DeviceChoice:
    return DeviceChoice("cpu", torch.device("cpu"), BACKENDS["cpu"])


def choose(
    wanted: str | None,
    rank: int | None = None,
    import_module: Callable[[str], ModuleType] = importlib.import_module,
) -> DeviceChoice:
    """The device for `wanted` ("cuda", "neuron", "cpu"; None: CUDA when torch sees a GPU, else CPU) on
    the process's local rank; sets it as the current device. `import_module` loads torch_neuronx (a
    parameter so tests can stand in for it)."""
    rank = local_rank() if rank is None else rank
    if wanted is None:
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cpu":
        return cpu()
    if wanted == "neuron":
        try:
            import_module(NEURON_MODULE)
        except ImportError as e:
            raise BadInput(
                f"the plan's accelerator is Trainium (torch device neuron) but {NEURON_MODULE} cannot be imported "
                f"({e}): run the Neuron trainer image (Dockerfile.neuron), or a --local plan on CPU"
            ) from None
    elif wanted != "cuda":
        raise BadInput(f"unknown accelerator {wanted!r}: one of {', '.join(BACKENDS)}")
    found = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if found is None or found.type != wanted:
        if wanted == "cuda":  # a GPU plan on a host without one: the same job on CPU (tests, benchmarks)
            return cpu()
        raise BadInput(
            f"the plan's accelerator is {wanted} but torch sees {found.type if found else 'no accelerator'} "
            f"after importing {NEURON_MODULE}: is the Neuron device plugin giving this pod its devices?"
        )
    torch.accelerator.set_device_index(rank)
    return DeviceChoice(wanted, torch.device(wanted, rank), BACKENDS[wanted])


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timing's end): any accelerator's, through torch.accelerator."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo: native bf16 dot products on x86


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this x86 CPU computes bf16 natively. Without it (AVX2 only) torch emulates every bf16
    matmul, tens of times slower than fp32: a bf16 benchmark there ran over ten minutes where fp32 took
    seconds (issue 41). Not x86 Linux (no /proc/cpuinfo flags to read): assumed native."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return True
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split()}
    return not flags or any(flag in flags for flag in CPU_BF16_FLAGS)
