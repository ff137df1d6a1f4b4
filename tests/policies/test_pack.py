"""The pack as the Pulumi CLI runs it: `policies/__main__.py` serving gRPC, plus its packaging files."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
import yaml
from google.protobuf import empty_pb2, struct_pb2
from policy_resources import ROOT
from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc

from supernode.core.resource_types import LAUNCH_TEMPLATE
from supernode.policies.pack import POLICIES


@pytest.mark.slow  # a second process
def test_main_serves_the_pack_over_grpc(tmp_path):
    # Started from another directory, as the CLI's language host does: the pack finds the core itself.
    proc = subprocess.Popen(
        [sys.executable, "-u", str(ROOT / "policies" / "__main__.py")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = analyzer_pb2_grpc.AnalyzerStub(channel)
            info = stub.GetAnalyzerInfo(empty_pb2.Empty(), timeout=30)
            assert [p.name for p in info.policies] == [p.name for p in POLICIES]
            gate = next(p for p in info.policies if p.name == "interconnect-gate")
            assert "minGateFraction" in gate.configSchema.properties  # schema generated from the settings model
            props = struct_pb2.Struct()
            props.update({"metadataOptions": {"httpTokens": "optional", "httpPutResponseHopLimit": 1}})
            reply = stub.Analyze(
                analyzer_pb2.AnalyzeRequest(
                    type=LAUNCH_TEMPLATE, urn=f"urn:pulumi:s::p::{LAUNCH_TEMPLATE}::lt", name="lt", properties=props
                ),
                timeout=30,
            )
            assert [(d.policyName, d.enforcementLevel) for d in reply.diagnostics] == [
                ("ec2-imdsv2", analyzer_pb2.MANDATORY)
            ]
    finally:
        proc.kill()
        proc.wait()


def test_pack_files():
    meta = yaml.safe_load((ROOT / "policies" / "PulumiPolicy.yaml").read_text())
    assert meta["runtime"] == "python"
    pins = dict(
        line.split("==")
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    pack = [
        line
        for line in (ROOT / "policies" / "requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert {p.split("==")[0] for p in pack} == {"pulumi-policy", "pulumi", "pydantic", "pyyaml"}
    for line in pack:  # the pack's own venv gets exactly the project's versions
        name, version = line.split("==")
        assert pins[name] == version


def test_each_policy_carries_its_item_and_settings():
    from supernode.policies.accelerators import Gate
    from supernode.policies.base import ChecklistPolicy
    from supernode.policies.pack import BY_NAME

    assert all(isinstance(p, ChecklistPolicy) and 1 <= p.item <= 10 for p in POLICIES)
    assert BY_NAME["interconnect-gate"].settings is Gate
    assert BY_NAME["memory-fit"].settings is None  # its headroom is the plan's (parallel.hbmHeadroom)


def test_one_stack_and_one_plan_per_analysis(stack, monkeypatch):
    # pulumi-policy rebuilds the resources for every stack policy; the runner's analysis scope and the
    # plan's text-keyed parse keep it to one Stack and one Plan per AnalyzeStack.
    from supernode.core.plan import Plan
    from supernode.policies import view
    from supernode.tools.policycheck import check

    built, parsed = [], []
    from_resources, from_json = view.Stack.from_policy_resources.__func__, Plan.from_json.__func__
    monkeypatch.setattr(
        view.Stack, "from_policy_resources", classmethod(lambda cls, r: built.append(1) or from_resources(cls, r))
    )
    monkeypatch.setattr(Plan, "from_json", classmethod(lambda cls, t: parsed.append(1) or from_json(cls, t)))
    view._plan_from_json.cache_clear()  # a plan text not seen before
    assert check(stack).passed
    assert (len(built), len(parsed)) == (1, 1)
