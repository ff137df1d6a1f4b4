"""Device and process-group backend from the plan's accelerator (supernode.trainer.device), every branch
on CPU: cpu -> gloo; cuda -> nccl (torch.accelerator stood in for a GPU, and the fallback to CPU on a
host without one); neuron -> neuron, with torch_neuronx stood in for (it is not installable here) up to
the device call, in a fresh interpreter because it renames torch's PrivateUse1 backend for good.

What only hardware reaches: the real `import torch_neuronx` (its registration of the device and the
`neuron` process-group backend), the real `torch.accelerator.set_device_index` and `synchronize` on a
device, and `init_process_group` with "neuron" or NCCL. Everything else runs here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from supernode.core.config import load_stack
from supernode.core.errors import EXIT_BAD_INPUT, BadInput
from supernode.core.plan import build_plan
from supernode.trainer import device as dev
from supernode.trainer.node import fabric

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_runs_gloo():
    choice = dev.choose("cpu", rank=3)
    assert (choice.kind, choice.device, choice.backend, choice.accelerated) == (
        "cpu",
        torch.device("cpu"),
        "gloo",
        False,
    )


def test_no_preference_on_a_host_without_a_gpu_is_cpu():
    assert not torch.cuda.is_available()  # the CPU build this suite runs on
    assert dev.choose(None).backend == "gloo"


def test_cuda_plan_on_a_host_without_a_gpu_runs_the_same_job_on_cpu():
    assert dev.choose("cuda").kind == "cpu"


class FakeAccelerator:
    """torch.accelerator as a host with `kind` devices shows it."""

    def __init__(self, kind: str):
        self.kind, self.set_to, self.synced = kind, [], []

    def is_available(self) -> bool:
        return True

    def current_accelerator(self) -> torch.device:
        return torch.device(self.kind)

    def set_device_index(self, index: int) -> None:
        self.set_to.append(index)

    def synchronize(self, device) -> None:
        self.synced.append(device)


def test_cuda_plan_on_a_gpu_host_runs_nccl_on_the_local_gpu(monkeypatch):
    fake = FakeAccelerator("cuda")
    monkeypatch.setattr(torch, "accelerator", fake)
    monkeypatch.setenv("LOCAL_RANK", "5")
    choice = dev.choose("cuda")
    assert (choice.kind, choice.device, choice.backend) == ("cuda", torch.device("cuda", 5), "cuda:nccl,cpu:gloo")
    assert choice.device_backend == "nccl"  # the gate measures NCCL alone
    assert fake.set_to == [5]
    dev.synchronize(choice.device)
    dev.synchronize(torch.device("cpu"))  # nothing to wait for on CPU
    assert fake.synced == [torch.device("cuda", 5)]


def test_neuron_plan_without_torch_neuronx_is_bad_input_naming_the_image():
    def missing(name: str):
        raise ModuleNotFoundError(f"No module named '{name}'")

    with pytest.raises(BadInput) as e:
        dev.choose("neuron", import_module=missing)
    assert "torch_neuronx cannot be imported" in str(e.value) and "Dockerfile.neuron" in str(e.value)


def test_neuron_plan_whose_devices_torch_does_not_see_is_bad_input(monkeypatch):
    imported = []
    monkeypatch.setattr(torch, "accelerator", FakeAccelerator("cuda"))
    with pytest.raises(BadInput) as e:
        dev.choose("neuron", import_module=imported.append)
    assert imported == ["torch_neuronx"]
    assert "the plan's accelerator is neuron but torch sees cuda" in str(e.value)


def test_unknown_accelerator_is_bad_input():
    with pytest.raises(BadInput, match="unknown accelerator 'tpu'"):
        dev.choose("tpu")


NEURON_UP_TO_THE_DEVICE = textwrap.dedent(
    """
    import json, sys, types
    import torch
    from supernode.trainer import device as dev

    class Accelerator:  # what TorchNeuron's PrivateUse1 backend answers once registered
        set_to = []
        def is_available(self): return True
        def current_accelerator(self): return torch.device("neuron")
        def set_device_index(self, i): self.set_to.append(i)

    def import_module(name):  # torch_neuronx's import-time registration, as the Neuron docs describe it
        assert name == "torch_neuronx"
        torch.utils.rename_privateuse1_backend("neuron")
        torch.accelerator = Accelerator()
        return types.ModuleType(name)

    choice = dev.choose("neuron", rank=2, import_module=import_module)
    print(json.dumps([choice.kind, str(choice.device), choice.backend, choice.device_backend, torch.accelerator.set_to]))
    """
)


def test_neuron_plan_runs_the_neuron_backend_on_its_logical_core():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", NEURON_UP_TO_THE_DEVICE], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == '["neuron", "neuron:2", "neuron", "neuron", [2]]'


def test_the_fabric_gate_on_a_trainium_plan_without_torch_neuronx_exits_2(tmp_path, monkeypatch, capsys):
    """The gate takes the device from the plan: a trn2 plan on this host stops before any collective."""
    plan = tmp_path / "plan.json"
    plan.write_text(build_plan("trn2", load_stack("trn2", ROOT)).to_json(), encoding="utf-8")
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(var, value)
    assert fabric.main(["--plan", str(plan)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the plan's accelerator is Trainium (torch device neuron)")


@pytest.mark.parametrize(("device_type", "bf16"), [("cuda", True), ("neuron", True), ("cpu", False)])
def test_mixed_precision_follows_the_device(device_type, bf16, tmp_path):
    """The plan's bf16 is computed on any accelerator (it was CUDA-only: a Trainium run trained in fp32
    and reported no MFU), never on CPU; an fp32 plan stays fp32 everywhere."""
    from supernode.core.config import Parallel
    from supernode.trainer.metrics import Metrics
    from supernode.trainer.parallel import bf16_compute

    assert bf16_compute(Parallel(mixed_precision="bf16"), device_type) is bf16
    assert bf16_compute(Parallel(mixed_precision="fp32"), device_type) is False
    plan = build_plan("trn2", load_stack("trn2", ROOT))
    metrics = Metrics(tmp_path, plan, world_size=1, device_type=device_type, rank=1)
    assert metrics.peak == (plan.hardware.peak_flops if bf16 else None)  # MFU wherever there is a peak
