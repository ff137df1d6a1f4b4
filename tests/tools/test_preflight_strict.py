"""Issue 31: `preflight --strict` fails on what it could not check, and a Local Zone that EC2 does not
list says how to opt in to it (against the moto server of conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_preflight import by_name, gb200_config

from supernode.cli import main
from supernode.tools.preflight import P_QUOTA_CODE, run_preflight

ROOT = Path(__file__).resolve().parents[2]
OPT_IN = "aws ec2 modify-availability-zone-group --group-name us-east-1-dfw-2 --opt-in-status opted-in"


def test_strict_turns_a_warning_into_exit_1(moto_aws, capsys):
    dev = ["preflight", "--stack", "dev", "--root", str(ROOT)]
    assert main(dev) == 0  # moto has no EC2 quota: the quota check warns, which passes by default
    assert "0 fail, 1 warn" in capsys.readouterr().out
    assert main([*dev, "--strict"]) == 1
    out = capsys.readouterr().out
    assert f"fix quota {P_QUOTA_CODE}" in out and "--strict: 1 warning(s) fail preflight" in out
    assert main([*dev, "--json"]) == 0 and json.loads(capsys.readouterr().out)["ok"] is True
    assert main([*dev, "--json", "--strict"]) == 1
    strict = json.loads(capsys.readouterr().out)
    assert strict["ok"] is False and strict["counts"] == {"fail": 0, "pass": 2, "warn": 1}


def test_strict_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["preflight", "--help"])
    assert "--strict" in capsys.readouterr().out


def test_a_local_zone_ec2_does_not_list_says_how_to_opt_in(moto_aws):
    checks = by_name(run_preflight(gb200_config()))  # moto lists no Local Zone, as for an account not opted in
    zone = checks["zone us-east-1-dfw-2a"]
    assert zone.result == "fail" and "only once its zone group is opted in" in zone.detail
    assert zone.fix.startswith(OPT_IN) and "availabilityZone" in zone.fix
    offering = checks["offering p6e-gb200.36xlarge"]
    assert offering.result == "fail" and OPT_IN in offering.fix and "availabilityZone" in offering.fix
