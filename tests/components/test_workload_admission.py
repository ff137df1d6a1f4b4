"""The training namespace's ValidatingAdmissionPolicy ("baseline + IPC_LOCK"), evaluated with a real
CEL interpreter (cel-python) on the job pods the stack creates and on pods it must refuse."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import pytest
from test_workload import objects, stack_preview


def refusals(policy: dict[str, Any], pod_spec: dict[str, Any]) -> list[str]:
    """The messages of the policy's validations that fail for a pod (empty: admitted)."""
    env = celpy.Environment()

    def run(expression: str, activation: dict[str, Any]) -> Any:
        return env.program(env.compile(expression)).evaluate(activation)

    obj = celpy.json_to_cel({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod_spec})
    variables = {
        celpy.celtypes.StringType(v["name"]): run(v["expression"], {"object": obj}) for v in policy["variables"]
    }
    activation = {"object": obj, "variables": celpy.celtypes.MapType(variables)}
    return [v["message"] for v in policy["validations"] if not run(v["expression"], activation)]


@pytest.fixture(scope="module")
def prod() -> dict:
    return objects(stack_preview("prod")[1])


@pytest.fixture(scope="module")
def policy(prod: dict) -> dict:
    return prod[("ValidatingAdmissionPolicy", "training-baseline-plus-efa")]["spec"]


def test_binding_applies_to_the_training_namespace_only(prod: dict) -> None:
    binding = prod[("ValidatingAdmissionPolicyBinding", "training-baseline-plus-efa")]["spec"]
    assert binding["policyName"] == "training-baseline-plus-efa" and binding["validationActions"] == ["Deny"]
    assert binding["matchResources"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "training"}
    }


def test_the_stacks_job_pods_are_admitted(prod: dict, policy: dict) -> None:
    trainer = prod[("PyTorchJob", "prod-train")]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    gate = prod[("Job", "prod-fabric-gate")]["spec"]["template"]["spec"]
    assert "IPC_LOCK" in trainer["containers"][0]["securityContext"]["capabilities"]["add"]
    assert refusals(policy, trainer) == []
    assert refusals(policy, gate) == []


def _with(pod: dict, change) -> dict:
    pod = copy.deepcopy(pod)
    change(pod)
    return pod


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p["containers"][0]["securityContext"].update(privileged=True), "privileged"),
        (lambda p: p["containers"][0]["securityContext"]["capabilities"]["add"].append("SYS_ADMIN"), "capabilities"),
        (
            lambda p: p.update(
                initContainers=[
                    {"name": "i", "image": "x", "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}
                ]
            ),
            "capabilities",
        ),
        (
            lambda p: p.update(
                ephemeralContainers=[{"name": "e", "image": "x", "securityContext": {"privileged": True}}]
            ),
            "privileged",
        ),
        (lambda p: p.update(hostNetwork=True), "hostNetwork"),
        (lambda p: p.update(hostPID=True), "hostPID"),
        (lambda p: p["volumes"].append({"name": "root", "hostPath": {"path": "/"}}), "hostPath"),
    ],
)
def test_pods_beyond_baseline_plus_ipc_lock_are_refused(prod: dict, policy: dict, change, message: str) -> None:
    trainer = prod[("PyTorchJob", "prod-train")]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (refusal,) = refusals(policy, _with(trainer, change))
    assert message in refusal
