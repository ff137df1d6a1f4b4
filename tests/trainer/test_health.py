"""Node health decisions on recorded tool output (tests/trainer/fixtures/health/)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from supernode.core.catalog import lookup
from supernode.trainer.node import health
from supernode.trainer.node.health import HARDWARE, OK, RECOVERABLE, Readings, Tracker, Verdict, decide

FIXTURES = Path(__file__).parent / "fixtures" / "health"
P5 = lookup("p5.48xlarge")


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def healthy() -> Readings:
    return Readings(
        nvidia_smi_q=text("nvidia-smi-q.txt"),
        nvlink_status=text("nvlink-s.txt"),
        dmesg=text("dmesg-app-only.txt"),
        ecc_remap=text("ecc-remap-ok.txt"),
        dcgmi_health=text("dcgmi-health-healthy.txt"),
        efa_before={f"rdmap{i}s0": {"cmds_err": 1} for i in range(32)},
        efa_now={f"rdmap{i}s0": {"cmds_err": 1, "tx_bytes": 10} for i in range(32)},
        fabric_suspect=False,
    )


def test_a_healthy_p5_has_no_findings() -> None:
    verdict = decide(healthy(), P5)
    assert verdict.findings == ()
    assert verdict.severity == OK and verdict.reason == ""


def test_readers_parse_the_documented_formats() -> None:
    assert health.parse_attached_gpus(text("nvidia-smi-q.txt")) == 8
    links = health.parse_nvlink_status(text("nvlink-s-inactive.txt"))
    assert sorted(links) == list(range(8)) and all(len(v) == 18 for v in links.values())
    assert links[3][4] is None and links[2][4] == pytest.approx(26.562)
    assert health.parse_xids(text("dmesg-xid79.txt")) == [("PCI:0000:53:00", 13), ("PCI:0000:64:00", 79)]
    assert health.parse_ecc_remap(text("ecc-remap-pending.txt")) == {
        "00000000:53:00.0": {"volatile_uncorrectable": 1, "pending": True, "remap_failure": False}
    }
    overall, messages = health.parse_dcgmi_health(text("dcgmi-health-warning.txt"))
    assert overall == "Warning" and messages[0].startswith("Detected more than 8 PCIe replays")


@pytest.mark.parametrize(
    ("field", "garbled", "check"),
    [
        ("nvidia_smi_q", "NVIDIA-SMI has failed because it couldn't communicate with the driver", "gpu_count"),
        ("nvlink_status", text("nvlink-s.txt").split("GPU 5:")[0], "nvlink"),  # cut short: GPUs 5-7 unread
        ("nvlink_status", "\x00\x00 Failed to initialize NVML: Unknown Error", "nvlink"),
        ("ecc_remap", "Failed to initialize NVML: Driver/library version mismatch", "ecc"),
        ("dcgmi_health", "Error: unable to establish a connection to the specified host", "dcgm"),
    ],
)
def test_garbled_tool_output_is_a_finding_not_a_pass(field: str, garbled: str, check: str) -> None:
    """Issue 41 (garbled tool output): a tool that exits 0 but prints what the readers cannot parse
    checked nothing; the GPUs its output omits are a finding of that check, never silence."""
    verdict = decide(dataclasses.replace(healthy(), **{field: garbled}), P5)
    assert [f.check for f in verdict.findings] == [check], verdict.findings
    assert verdict.severity != OK


def test_ecc_remap_sections_reset_per_gpu() -> None:
    # GPU 2's `ECC Mode / Pending : Enabled` must not read as GPU 1's row-remap Pending.
    two = text("ecc-remap-ok.txt") + text("ecc-remap-ok.txt").split("Attached GPUs", 1)[1].split("\n", 1)[1].replace(
        "00000000:53:00.0", "00000000:64:00.0"
    )
    gpus = health.parse_ecc_remap(two)
    assert set(gpus) == {"00000000:53:00.0", "00000000:64:00.0"}
    assert not any(g["pending"] for g in gpus.values())


@pytest.mark.parametrize(
    ("field", "fixture", "check", "severity"),
    [
        ("nvidia_smi_q", "nvidia-smi-q-7gpus.txt", "gpu_count", HARDWARE),
        ("nvlink_status", "nvlink-s-inactive.txt", "nvlink", RECOVERABLE),
        ("dmesg", "dmesg-xid79.txt", "xid", HARDWARE),
        ("dmesg", "dmesg-xid63.txt", "xid", RECOVERABLE),
        ("ecc_remap", "ecc-remap-pending.txt", "row_remap", RECOVERABLE),
        ("ecc_remap", "ecc-remap-failure.txt", "row_remap", HARDWARE),
        ("dcgmi_health", "dcgmi-health-warning.txt", "dcgm", RECOVERABLE),
        ("dcgmi_health", "dcgmi-health-failure.txt", "dcgm", HARDWARE),
    ],
)
def test_each_fault_is_classified(field: str, fixture: str, check: str, severity: str) -> None:
    readings = Readings(**{**healthy().__dict__, field: text(fixture)})
    verdict = decide(readings, P5)
    assert verdict.severity == severity
    assert verdict.reason == check


def test_only_the_xid_79_line_is_a_finding() -> None:
    verdict = decide(Readings(dmesg=text("dmesg-xid79.txt")), P5)
    assert [f.detail for f in verdict.findings] == ["Xid 79 on PCI:0000:64:00"]


def test_efa_error_growth_and_missing_devices() -> None:
    base = healthy()
    grown = {**base.efa_now, "rdmap7s0": {"cmds_err": 4}}
    verdict = decide(Readings(efa_before=base.efa_before, efa_now=grown), P5)
    assert verdict.severity == RECOVERABLE and "rdmap7s0/cmds_err +3" in verdict.findings[0].detail
    missing = {k: v for k, v in base.efa_now.items() if k != "rdmap0s0"}
    assert decide(Readings(efa_now=missing), P5).severity == HARDWARE
    # The first reading has no before: cumulative counts since boot are not news.
    assert decide(Readings(efa_now=grown), P5).severity == OK


def test_fabric_suspect_quarantines() -> None:
    assert decide(Readings(fabric_suspect=True), P5).reason == "fabric"


FAIL = Verdict((health.Finding("nvlink", RECOVERABLE, "x"),))
BROKEN = Verdict((health.Finding("xid", HARDWARE, "Xid 79"),))
PASS = Verdict(())


def test_a_flapping_node_stays_quarantined_until_n_passes() -> None:
    t = Tracker(release_after=3, replace_after=10, window_s=3600)
    assert t.observe(FAIL, 0) == health.QUARANTINE
    assert t.observe(PASS, 1) == health.STAY
    assert t.observe(FAIL, 2) == health.STAY  # already quarantined: no second taint
    assert [t.observe(PASS, 3 + i) for i in range(3)] == [health.STAY, health.STAY, health.RELEASE]
    assert not t.quarantined


def test_repeated_failures_escalate_within_the_window() -> None:
    t = Tracker(release_after=1, replace_after=3, window_s=100)
    assert t.observe(FAIL, 0) == health.QUARANTINE
    assert t.observe(PASS, 10) == health.RELEASE
    assert t.observe(FAIL, 20) == health.QUARANTINE
    assert t.observe(FAIL, 30) == health.EVICT_AND_REPLACE
    old = Tracker(release_after=1, replace_after=3, window_s=100)
    for now in (0, 150, 300):  # the failures are spread beyond the window: never escalates
        assert old.observe(FAIL, now) != health.EVICT_AND_REPLACE
        old.observe(PASS, now + 1)


def test_a_hardware_fault_replaces_at_once() -> None:
    assert Tracker(release_after=3, replace_after=5, window_s=60).observe(BROKEN, 0) == health.EVICT_AND_REPLACE


def test_tracker_rejects_a_zero_threshold() -> None:
    with pytest.raises(ValueError, match="release_after must be at least 1, got 0"):
        Tracker(release_after=0, replace_after=1, window_s=1)


def test_readers_parse_a_real_h200_recording() -> None:
    """`nvidia-smi -q` and `-q -d ECC,ROW_REMAPPER` as driver 580.159.04 printed them on one H200
    (recorded on a lent GPU machine, serial and UUID redacted): one GPU, no ECC, no pending remap; the
    same text with one volatile DRAM uncorrectable error is an ECC finding (recoverable: the row
    remapper handles it after a GPU reset)."""
    smi, ecc = text("recorded-h200-nvidia-smi-q.txt"), text("recorded-h200-ecc-remap.txt")
    assert health.parse_attached_gpus(smi) == 1
    assert health.parse_ecc_remap(ecc) == {
        "00000000:00:06.0": {"volatile_uncorrectable": 0, "pending": False, "remap_failure": False}
    }
    # Against an 8-GPU p5e.48xlarge the missing GPUs are the one finding besides EFA (none in that VM).
    verdict = decide(Readings(nvidia_smi_q=smi, ecc_remap=ecc), lookup("p5e.48xlarge"))
    assert [(f.check, f.severity) for f in verdict.findings if f.check != "efa"] == [("gpu_count", HARDWARE)]
    volatile, aggregate = ecc.split("        Aggregate\n", 1)
    faulty = volatile.replace("DRAM Uncorrectable                         : 0", "DRAM Uncorrectable : 1") + (
        "        Aggregate\n" + aggregate
    )
    assert health.parse_ecc_remap(faulty)["00000000:00:06.0"]["volatile_uncorrectable"] == 1
    assert [(f.check, f.severity) for f in decide(Readings(ecc_remap=faulty), P5).findings] == [("ecc", RECOVERABLE)]
