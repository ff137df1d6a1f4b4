"""Preflight on Trainium against EC2's own data (moto 5.2.5 describes trn2.48xlarge and trn2u.48xlarge):
every catalog figure EC2 states matches, the Neuron device figures from NeuronInfo (chips, cores, name),
the known disagreement on device memory is a warning that names both figures, and trn2 counts against
the Trn On-Demand quota, not the P one."""

from __future__ import annotations

from pathlib import Path

from supernode.core.config import load_stack
from supernode.tools.awscheck import Aws
from supernode.tools.preflight import P_QUOTA_CODE, TRN_QUOTA_CODE, check_instance_type, preflight_steps, quota_of

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-2"


def test_trn2_matches_ec2_but_for_the_device_memory_ec2_overstates(moto_aws):
    check = check_instance_type(Aws(REGION), "trn2.48xlarge")
    assert check.result == "warn", check.detail
    # moto's NeuronInfo: 524288 MiB per device; AWS's Neuron docs (and the catalog): 96 GiB = 98304 MiB
    assert "EC2 reports 524288 MiB per Trainium2 device, the catalog 98304" in check.detail
    assert "every other figure matches" in check.detail


def test_trn2u_without_neuron_info_compares_the_rest(moto_aws):
    check = check_instance_type(Aws(REGION), "trn2u.48xlarge")
    assert check.result == "warn"
    assert check.detail.startswith("EC2 does not describe trn2u.48xlarge's Neuron devices; the rest matches")
    for figure in ("max EFA interfaces 16", "network cards 16", "card 0 EFA True", "vCPUs 192", "architecture x86_64"):
        assert figure in check.detail


def test_a_wrong_neuron_figure_fails(moto_aws, monkeypatch):
    import dataclasses

    from supernode.core import catalog

    wrong = dataclasses.replace(catalog.CATALOG["trn2.48xlarge"], neuron_cores_per_chip=2)
    monkeypatch.setitem(catalog.CATALOG, "trn2.48xlarge", wrong)
    check = check_instance_type(Aws(REGION), "trn2.48xlarge")
    assert check.result == "fail" and "cores per device: catalog 2, EC2 8" in check.detail


def test_trainium_counts_against_the_trn_quota():
    assert quota_of("trn2.48xlarge")[0] == TRN_QUOTA_CODE and quota_of("p5.48xlarge")[0] == P_QUOTA_CODE
    cfg = load_stack("trn2", ROOT)
    names = [s.name for s in preflight_steps(cfg, Aws(REGION))]
    # A Capacity Block counts against no On-Demand quota: the trn2 stack (one UltraServer block) asks none.
    # Its reservation must be that UltraServer's block (tests/tools/test_trn2_ultraserver.py).
    assert names == [
        "offering trn2u.48xlarge",
        "instance type trn2u.48xlarge",
        "capacity cr-0a64a64a64a64a640",
        "ultraserver capacity trn2-ultra-a",
    ]
    on_demand = cfg.model_copy(
        update={
            "accelerator_node_groups": [
                g.model_copy(
                    update={
                        "instance_type": "trn2.48xlarge",
                        "ultra_server": None,
                        "capacity": g.capacity.model_copy(update={"type": "on-demand", "reservation_id": None}),
                    }
                )
                for g in cfg.accelerator_node_groups
            ]
        }
    )
    assert f"quota {TRN_QUOTA_CODE}" in [s.name for s in preflight_steps(on_demand, Aws(REGION))]
