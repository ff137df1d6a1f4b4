"""`supernode policy check` and the policy part of `supernode preview`: table, JSON, JUnit, exit codes."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import pytest
from policy_resources import ROOT, mutate

from supernode.cli import main
from supernode.core import resource_types as T

LT = T.LAUNCH_TEMPLATE


IMAGE_WARNINGS = {("image-digests", "advisory"), ("image-placeholder", "advisory")}


def test_check_passes_on_a_saved_preview(saved_dev_preview, capsys, tmp_path):
    rc, path = saved_dev_preview
    assert rc == 0
    # dev runs its add-ons by tag and the placeholder trainer digest: warned, not failed (issue 19)
    violations = json.loads(path.read_text())["policy"]["violations"]
    assert {(v["policy"], v["enforcement"]) for v in violations} == IMAGE_WARNINGS
    capsys.readouterr()
    assert main(["policy", "config", "--stack", "dev", "--root", str(ROOT)]) == 0
    conf = tmp_path / "policy-config.json"
    conf.write_text(capsys.readouterr().out)
    assert main(["policy", "check", "--resources", str(path), "--policy-config", str(conf), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and {(v["policy"], v["enforcement"]) for v in out["violations"]} == IMAGE_WARNINGS
    assert {p["item"] for p in out["policies"]} == set(range(1, 11))
    # Without the stack's config the pack is strict: the placeholder digest fails.
    assert main(["policy", "check", "--resources", str(path), "--json"]) == 1
    failed = {v["policy"] for v in json.loads(capsys.readouterr().out)["violations"] if v["enforcement"] == "mandatory"}
    assert failed == {"image-digests", "image-placeholder"}


def test_violation_fails_with_table_json_and_junit(stack, tmp_path, capsys):
    bad = mutate(stack, LT, lambda i: i["networkInterfaces"].pop())
    f = tmp_path / "resources.json"
    f.write_text(json.dumps(bad))  # a bare list works as well as a whole preview document
    junit = tmp_path / "reports" / "policy.xml"
    assert main(["policy", "check", "--resources", str(f), "--junit", str(junit)]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "interconnect-efa-interfaces" in line)
    assert "fail" in row and "mandatory" in row and "gpu" in row
    assert "1 mandatory violation(s)" in out and "Fix:" in out

    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "1" and int(suite.get("tests")) == len(suite.findall("testcase"))
    failed = [c for c in suite.findall("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == ["interconnect-efa-interfaces"]
    assert failed[0].get("classname") == "checklist.03.Interconnect"
    assert bad[[r["type"] for r in bad].index(LT)]["urn"] in failed[0].find("failure").text

    assert main(["policy", "check", "--resources", str(f), "--json"]) == 1
    (v,) = json.loads(capsys.readouterr().out)["violations"]
    assert set(v) == {"policy", "enforcement", "urn", "message"} and v["enforcement"] == "mandatory"


def test_advisory_only_exits_zero(stack, tmp_path, capsys):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"resources": mutate(stack, LT, lambda i: i["networkInterfaces"].pop())}))
    cfg = tmp_path / "policy.yaml"
    cfg.write_text("interconnect-efa-interfaces: advisory\n")
    assert main(["policy", "check", "--resources", str(f), "--policy-config", str(cfg)]) == 0
    assert "warn" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content,expected",
    [
        (None, "file not found"),
        ("{not json", "not valid JSON"),
        ('{"stack": "dev"}', "expected a list of resources"),
        (json.dumps([{"type": T.BUCKET, "name": "b", "inputs": {}}]), "resources[0].urn: required"),
        ('[{"urn": "u", "type": "t", "name": "n", "inputs": []}]', "resources[0].inputs: expected an object"),
    ],
)
def test_bad_resources_file_exits_2(tmp_path, capsys, content, expected):
    f = tmp_path / "r.json"
    if content is not None:
        f.write_text(content)
    assert main(["policy", "check", "--resources", str(f)]) == 2
    err = capsys.readouterr().err
    assert expected in err and str(f) in err and "Traceback" not in err


@pytest.mark.parametrize(
    "config,expected",
    [
        ('{"no-such-policy": "mandatory"}', "unknown policies ['no-such-policy']"),
        ('{"interconnect-gate": {"minGateFraction": 2}}', "interconnect-gate.minGateFraction"),
        # the headroom is the plan's (supernode:parallel.hbmHeadroom), no longer a policy setting
        ('{"memory-fit": {"headroomFraction": 0.2}}', "memory-fit: takes no settings"),
        ('{"memory-fit": "sometimes"}', "memory-fit.enforcementLevel"),
        ('{"kms-key-rotation": {"days": 3}}', "kms-key-rotation: takes no settings"),
        ("[1, 2]", "expected an object of policy name"),
    ],
)
def test_bad_policy_config_exits_2(stack, tmp_path, capsys, config, expected):
    f, c = tmp_path / "r.json", tmp_path / "p.json"
    f.write_text(json.dumps(stack))
    c.write_text(config)
    assert main(["policy", "check", "--resources", str(f), "--policy-config", str(c)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_preview_exits_1_on_a_mandatory_violation(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    c = tmp_path / "strict.json"
    c.write_text(json.dumps({"accelerators-approved-instance-types": {"approvedInstanceTypes": ["p5en.48xlarge"]}}))
    assert main(["preview", "--stack", "dev", "--json", "--policy-config", str(c)]) == 1
    violations = [
        v
        for v in json.loads(capsys.readouterr().out)["policy"]["violations"]
        if (v["policy"], v["enforcement"]) not in IMAGE_WARNINGS
    ]  # dev's image warnings (issue 19)
    assert {v["policy"] for v in violations} == {"accelerators-approved-instance-types"}
    assert all("p5.48xlarge" in v["message"] and v["enforcement"] == "mandatory" for v in violations)


def test_policy_config_of_a_stack_feeds_the_check(capsys):
    assert main(["policy", "config", "--stack", "prod", "--root", str(ROOT)]) == 0
    conf = json.loads(capsys.readouterr().out)
    from supernode.core.config import load_stack

    cfg = load_stack("prod", ROOT)
    assert conf["data-ready"]["datasetPrefix"] == cfg.storage.dataset_prefix
    assert conf["checkpoint-lifecycle"]["checkpointPrefix"] == cfg.storage.checkpoint_prefix


# -- resources files that are JSON but not a preview: each one line, exit 2 (issue 13, item 9) ------


def _reshaped(path, change):
    doc = json.loads(path.read_text())
    for r in doc["resources"]:
        r["inputs"] = {k: change(v) for k, v in r["inputs"].items()}
    return doc


@pytest.mark.parametrize(
    "change,expected",
    [
        (lambda v: "x", "TypeError: 'str' object is not a mapping"),  # every input value a string
        (
            lambda v: (
                [v] if isinstance(v, dict) else {"a": v} if isinstance(v, list) else v
            ),  # lists and objects swapped
            "object is not a mapping",
        ),
    ],
)
def test_wrongly_shaped_inputs_exit_2_naming_the_policy_and_resource(
    saved_dev_preview, tmp_path, capsys, change, expected
):
    _, path = saved_dev_preview
    f = tmp_path / "r.json"
    f.write_text(json.dumps(_reshaped(path, change)))
    assert main(["policy", "check", "--resources", str(f)]) == 2
    err = capsys.readouterr().err
    assert "cannot read urn:pulumi:dev::" in err and expected in err and "Traceback" not in err
    assert err.startswith("error: policy ") and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "content,expected",
    [
        ("[]", "holds no resources, so there is nothing to check"),  # not a vacuous pass
        ('{"resources": []}', "holds no resources"),
        ('[{"urn": "u", "type": "t", "name": "n", "inputs": {"size": NaN}}]', "NaN is not a JSON number"),
        (
            '[{"urn": "u", "type": "t", "name": "n", "inputs": ' + '{"a": ' * 100 + "1" + "}" * 100 + "}]",
            "nested deeper than 64 levels",
        ),
        (
            '[{"urn": "u", "type": "t", "name": "n", "inputs": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}]",
            "nested deeper than 64 levels",
        ),
        # Issue 30 #11: these were "internal error" (exit 1) with a traceback.
        ('[{"urn": "u", "type": "t", "name": "n", "dependencies": [1, 2]}]', "dependencies: expected a list of URNs"),
        ('[{"urn": "u", "type": "t", "name": "n", "dependencies": [["u"]]}]', "dependencies: expected a list of URNs"),
        ('[{"urn": "u", "type": "t", "name": "n", "inputs": {"n": ' + "9" * 400 + "}}]", "is beyond 64 bits"),
        ('[{"urn": "u\\ud800", "type": "t", "name": "n"}]', "holds a lone surrogate"),
        ('[{"urn": "u", "urn": "v", "type": "t", "name": "n"}]', "duplicate key 'urn'"),
        (
            '[{"urn": "u", "type": "t", "name": "n", "dependencies": "urn:x"}]',
            "resources[0].dependencies: expected a list",
        ),
    ],
)
def test_unusable_resources_exit_2(tmp_path, capsys, content, expected):
    f = tmp_path / "r.json"
    f.write_text(content)
    assert main(["policy", "check", "--resources", str(f)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_a_large_bad_file_gives_a_short_error_and_files_have_a_size_limit(tmp_path, capsys, monkeypatch):
    from supernode.tools import policycheck

    f = tmp_path / "r.json"
    f.write_text(json.dumps([{"urn": "x" * 1000, "type": ["y" * 10_000]}] * 5000))  # ~50 MB of problems
    assert main(["policy", "check", "--resources", str(f)]) == 2
    err = capsys.readouterr().err
    assert len(err) < 3000 and "... (10004 chars)" in err and "and 9980 more" in err
    monkeypatch.setattr(policycheck, "MAX_RESOURCES_BYTES", 1000)
    assert main(["policy", "check", "--resources", str(f)]) == 2
    assert "over the 1,000-byte limit for this file" in capsys.readouterr().err


def test_a_pipe_as_resources_is_refused_not_read_for_ever(tmp_path, capsys):
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)  # nothing writes to it: opening it would block
    assert main(["policy", "check", "--resources", str(fifo)]) == 2
    assert "is not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content,expected",
    [
        # an alias bomb: nine levels of ten aliases each would be 10**9 strings
        (
            "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)),
            "aliases (*name) are not accepted",
        ),
        ("all: advisory\nall: mandatory\n", "duplicate key 'all'"),
        ("s3-tls-only: " + "[" * 200 + "]" * 200 + "\n", "nested deeper than 64 levels"),
    ],
)
def test_a_hostile_policy_config_is_refused_before_it_costs_anything(tmp_path, capsys, content, expected):
    """Issue 30 #10: an alias bomb took 5.9 GB at 60 s; duplicate keys silently took the last value."""
    f = tmp_path / "policy.yaml"
    f.write_text(content)
    r = tmp_path / "r.json"
    r.write_text('[{"urn": "u", "type": "t", "name": "n"}]')
    assert main(["policy", "check", "--resources", str(r), "--policy-config", str(f)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and len(err.splitlines()) == 1
