"""The node inventory: readers on captured tool output, drift between two records, the host
baseline's findings, and "the first record is kept" as the watch loop's ConfigMaps implement it."""

from __future__ import annotations

import json

import pytest

from supernode.trainer.node import inventory as inv

NVIDIA_SMI_CSV = """\
0, GPU-5c2f6a1e-0d3b-4f5e-9a8b-1c2d3e4f5a6b, 1654922012345, 00000000:53:00.0, NVIDIA H100 80GB HBM3, 96.00.99.00.01, 580.95.05
1, GPU-7a8b9c0d-1e2f-4a5b-8c9d-0e1f2a3b4c5d, 1654922012346, 00000000:64:00.0, NVIDIA H100 80GB HBM3, 96.00.99.00.01, 580.95.05
"""
NVIDIA_SMI_BANNER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: 13.0     |
+-----------------------------------------+------------------------+----------------------+
"""
FI_INFO = "fi_info: 2.1.0amzn3.0\nlibfabric: 2.1.0amzn3.0\nlibfabric api: 2.1\n"
EFA_PACKAGES = "# EFA installer version: 1.43.3\n# Debug packages installed: no\nlibfabric-aws 2.1.0amzn3.0\n"
LIMITS = """\
Limit                     Soft Limit           Hard Limit           Units
Max open files            1048576              1048576              files
Max locked memory         unlimited            unlimited            bytes
"""
CHRONY = """\
Reference ID    : A9FEA97B (169.254.169.123)
Stratum         : 4
System time     : 0.000021347 seconds slow of NTP time
Last offset     : -0.000005283 seconds
"""


def record(**changes) -> dict:
    base = inv.build_record(
        inv.parse_nvidia_smi_gpus(NVIDIA_SMI_CSV),
        cuda=inv.parse_cuda_version(NVIDIA_SMI_BANNER),
        nccl="2.27.7",
        libfabric=inv.parse_fi_info_version(FI_INFO),
        efa_installer=inv.parse_efa_installer(EFA_PACKAGES),
        aws_ofi_nccl=inv.parse_ofi_nccl_version(b"\x00aws-ofi-nccl 1.17.2\x00"),
        efa_devices=32,
        sysctl=dict(inv.HOST_SYSCTLS),
        limits=inv.parse_limits(LIMITS),
        hugepages_2mi=2560,
        time_sync=inv.parse_chrony_tracking(CHRONY),
        node="ip-10-0-1-5",
        instance="i-0123456789abcdef0",
    )
    return {**base, **changes}


def test_readers_parse_captured_tool_output():
    r = record()
    assert [(g["index"], g["serial"], g["pci_bus_id"]) for g in r["gpus"]] == [
        ("0", "1654922012345", "00000000:53:00.0"),
        ("1", "1654922012346", "00000000:64:00.0"),
    ]
    assert r["gpus"][1]["uuid"] == "GPU-7a8b9c0d-1e2f-4a5b-8c9d-0e1f2a3b4c5d"
    assert (r["driver"], r["cuda"], r["libfabric"], r["efa_installer"], r["aws_ofi_nccl"]) == (
        "580.95.05",
        "13.0",
        "2.1.0amzn3.0",
        "1.43.3",
        "1.17.2",
    )
    assert r["limits"] == {"nofile": "1048576", "memlock": "unlimited"}
    assert r["time"] == {
        "source": "169.254.169.123",
        "amazon_time_sync": True,
        "offset_ms": -0.021347,
        "synchronised": True,
    }
    # absent tools give nulls, not errors
    assert inv.parse_nvidia_smi_gpus("") == [] and inv.parse_cuda_version("") is None
    assert inv.parse_fi_info_version("command not found") is None and inv.parse_ofi_nccl_version(b"") is None


def test_drift_between_two_differing_inventories():
    before = record()
    gpus = [dict(g) for g in before["gpus"]]
    gpus[1]["serial"] = "1654922099999"  # a card swapped in slot 1
    after = record(gpus=gpus, driver="580.105.08", time={**before["time"], "offset_ms": 3.0}, node="renamed")
    found = inv.drift(before, after)
    assert found == [
        {"field": "driver", "baseline": "580.95.05", "current": "580.105.08"},
        {"field": "gpus.gpu1.serial", "baseline": "1654922012346", "current": "1654922099999"},
    ]
    assert inv.drift(before, record()) == []  # same node, same record: nothing (clock and node name are volatile)
    # The fleet comparison looks only at what all nodes share: another node's serials are no drift.
    other = record(gpus=[{**g, "serial": "x", "uuid": "y"} for g in before["gpus"]], instance_id="i-0fff")
    assert inv.drift(before, other, inv.FLEET_FIELDS) == []
    assert [d["field"] for d in inv.drift(before, record(nccl="2.26.2"), inv.FLEET_FIELDS)] == ["nccl"]


def test_compare_command_exits_1_on_drift_and_2_on_bad_input(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(record()))
    b.write_text(json.dumps(record(cuda="12.8")))
    assert inv.main(["compare", str(a), str(a)]) == 0
    assert inv.main(["compare", str(a), str(b)]) == 1
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["inventory_drift_count"] == 1
    b.write_text("{}")
    assert inv.main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "not an inventory record" in err and "Traceback" not in err


def test_host_findings_flag_settings_off_the_bootstrap_and_clock_beyond_the_bound():
    assert inv.host_findings(record(), max_offset_ms=10) == []
    bad = record(
        sysctl={**inv.HOST_SYSCTLS, "kernel.numa_balancing": 1},
        limits={"nofile": "65536", "memlock": "8388608"},
        time={"source": "169.254.169.123", "amazon_time_sync": True, "offset_ms": 25.0, "synchronised": True},
    )
    found = inv.host_findings(bad, max_offset_ms=10)
    assert len(found) == 4 and any("numa_balancing" in f for f in found) and any("25 ms" in f for f in found)
    ntp = record(time=inv.parse_chrony_tracking("Reference ID    : 00000000 ()\n"))
    assert inv.host_findings(ntp, 10) == ["clock not synchronised (source none)"]


def test_watch_keeps_the_first_record_and_counts_drift_for_the_alarm():
    stored: dict[str, dict[str, str]] = {}

    def keep_first(name, data):  # the API server's create: AlreadyExists keeps what is there
        return stored.setdefault(name, data)

    first = inv.check(record(), keep_first, max_offset_ms=10)
    assert first["inventory_drift_count"] == 0
    assert set(stored) == {"inventory-i-0123456789abcdef0", "inventory-fleet"}
    later = inv.check(record(driver="580.105.08"), keep_first, max_offset_ms=10)
    # the node's own baseline and the fleet's both still hold the first record: two findings
    assert later["inventory_drift_count"] == 2
    assert json.loads(stored["inventory-i-0123456789abcdef0"]["record.json"])["driver"] == "580.95.05"
    # a second node with the fleet's versions: its own first record, no fleet drift
    other = inv.check(record(instance_id="i-0fff", node="ip-10-0-1-6"), keep_first, max_offset_ms=10)
    assert other["inventory_drift_count"] == 0 and other["fleet_reference"] == "ip-10-0-1-5"
    # the JSON line carries the field the inventory-drift log metric filter reads
    from supernode.components.aws.monitoring import LogPattern

    assert "$.inventory_drift_count" in LogPattern.INVENTORY_DRIFT and "inventory_drift_count" in later


def test_the_node_bootstrap_sets_the_baseline_the_inventory_checks():
    from supernode.components.aws import accelerators

    script = accelerators.host_baseline_script(2560)
    for key, value in inv.HOST_SYSCTLS.items():
        assert f"{key} = {value}" in script
    assert "vm.nr_hugepages = 2560" in script and "LimitMEMLOCK=infinity" in script
    assert f"LimitNOFILE={inv.NOFILE}" in script and inv.AMAZON_TIME_SYNC[0] in script


@pytest.mark.parametrize("argv", [["watch"], ["watch", "--namespace", "x", "--interval-s", "5"], ["nope"]])
def test_watch_bad_flags_exit_2(argv, capsys):
    assert inv.main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err
