"""The pack as the Pulumi CLI runs it: `policies/__main__.py` serving gRPC, plus its packaging files."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
import yaml
from google.protobuf import empty_pb2, struct_pb2
from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc

from policies.pack import POLICIES

from policy_resources import ROOT


@pytest.mark.slow  # a second process
def test_main_serves_the_pack_over_grpc(tmp_path):
    # Started from another directory, as the CLI's language host does: the pack finds the core itself.
    proc = subprocess.Popen([sys.executable, "-u", str(ROOT / "policies" / "__main__.py")], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = analyzer_pb2_grpc.AnalyzerStub(channel)
            info = stub.GetAnalyzerInfo(empty_pb2.Empty(), timeout=30)
            assert [p.name for p in info.policies] == [p.name for p in POLICIES]
            memory = next(p for p in info.policies if p.name == "memory-fit")
            assert "headroomFraction" in memory.configSchema.properties  # schema generated from the settings model
            props = struct_pb2.Struct()
            props.update({"metadataOptions": {"httpTokens": "optional"}})
            reply = stub.Analyze(analyzer_pb2.AnalyzeRequest(
                type="aws:ec2/launchTemplate:LaunchTemplate", urn="urn:pulumi:s::p::aws:ec2/launchTemplate:LaunchTemplate::lt",
                name="lt", properties=props), timeout=30)
            assert [(d.policyName, d.enforcementLevel) for d in reply.diagnostics] == [("ec2-imdsv2", analyzer_pb2.MANDATORY)]
    finally:
        proc.kill()
        proc.wait()


def test_pack_files():
    meta = yaml.safe_load((ROOT / "policies" / "PulumiPolicy.yaml").read_text())
    assert meta["runtime"] == "python"
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    pack = [line for line in (ROOT / "policies" / "requirements.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert {p.split("==")[0] for p in pack} == {"pulumi-policy", "pulumi", "pydantic", "pyyaml"}
    for line in pack:  # the pack's own venv gets exactly the project's versions
        name, version = line.split("==")
        assert pins[name] == version
