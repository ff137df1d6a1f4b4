"""GPU node health: parse the tools' recorded output and decide what a node needs (issue 26 item 4).

Pure decisions, no torch and no I/O: the agent (supernode.trainer.node.agent) runs the tools and
acts; tests feed captured text. Each check yields findings of one of three severities:

- `ok`: nothing to do.
- `recoverable`: keep new work off the node (NoSchedule taint) and look again; a GPU reset, a
  driver reload or a transient link error clears it. Repeated failures escalate (see `Tracker`).
- `hardware`: the instance is faulty; evict our pods and hand the instance to replacement.

A check whose tool did not run (not installed, refused, timed out, exited without output) is
neither: it is `not_run`, with the reason, and a node is not called healthy for it (the agent
reports it and, by the operator's policy, holds an unchecked node back; `Verdict.checked`).

XID classes follow NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html,
"Resolution Bucket") and dynamic page retirement / row remapping guides
(docs.nvidia.com/deploy/dynamic-page-retirement, docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt):
48 (double-bit ECC), 64 (page retirement / row remap failure), 79 (GPU fallen off the bus),
95 (uncontained ECC: other processes may have read corrupt memory) and 140 (unrecovered ECC)
are hardware; 63 (row remap pending, reset to activate), 74 (NVLink error), 94 (contained ECC),
92 (high single-bit ECC rate), 119/120 (GSP timeouts) need a GPU reset; application faults
(13, 31, 43, 45, 68: bad kernels, page faults, a killed process) say nothing about the node.
An XID not in these lists is recoverable: a human looks before anything is replaced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from supernode.core.catalog import InstanceType

OK = "ok"
RECOVERABLE = "recoverable"
HARDWARE = "hardware"
_RANK = {OK: 0, RECOVERABLE: 1, HARDWARE: 2}

XID_HARDWARE = frozenset({48, 64, 79, 95, 140})
XID_RESET = frozenset({63, 74, 92, 94, 119, 120})
XID_APPLICATION = frozenset({13, 31, 43, 45, 68})

# The share of the catalog's NVLink bandwidth a GPU's active links must add up to: `nvlink -s`
# prints each link's unidirectional rate, the catalog the bidirectional aggregate.
NVLINK_FLOOR = 0.9


@dataclass(frozen=True)
class Finding:
    check: str  # gpu_count, nvlink, xid, ecc, row_remap, dcgm, efa, fabric
    severity: str
    detail: str


@dataclass(frozen=True)
class Verdict:
    findings: tuple[Finding, ...]
    not_run: tuple[tuple[str, str], ...] = ()  # (check, why) for each check whose tool did not run

    @property
    def checked(self) -> bool:
        """Every check ran: only then does a clean verdict say the node is healthy."""
        return not self.not_run

    @property
    def not_run_detail(self) -> str:
        return "; ".join(f"{check}: {why}" for check, why in self.not_run)

    @property
    def severity(self) -> str:
        return max((f.severity for f in self.findings), key=_RANK.__getitem__, default=OK)

    @property
    def reason(self) -> str:
        """The worst finding's check: the taint's value (a label value: short, no spaces)."""
        worst = [f for f in self.findings if f.severity == self.severity]
        return worst[0].check if worst and self.severity != OK else ""


# -- readers ---------------------------------------------------------------------------------------


def parse_attached_gpus(nvidia_smi_q: str) -> int | None:
    """`nvidia-smi -q`: the `Attached GPUs : 8` header line."""
    m = re.search(r"^\s*Attached GPUs\s*:\s*(\d+)", nvidia_smi_q, re.MULTILINE)
    return int(m.group(1)) if m else None


def parse_nvlink_status(text: str) -> dict[int, list[float | None]]:
    """`nvidia-smi nvlink -s`: per GPU index, each link's GB/s (None: `<inactive>`)."""
    gpus: dict[int, list[float | None]] = {}
    current: list[float | None] | None = None
    for line in text.splitlines():
        gpu = re.match(r"^GPU (\d+):", line)
        if gpu:
            current = gpus.setdefault(int(gpu.group(1)), [])
            continue
        link = re.match(r"^\s+Link \d+:\s*(.+?)\s*$", line)
        if link and current is not None:
            rate = re.match(r"([\d.]+) GB/s", link.group(1))
            current.append(float(rate.group(1)) if rate else None)
    return gpus


_XID = re.compile(r"NVRM: Xid \((PCI:[0-9a-fA-F:.]+)\): (\d+),")


def parse_xids(dmesg: str) -> list[tuple[str, int]]:
    """`dmesg` lines `NVRM: Xid (PCI:0000:53:00): 79, pid=..., GPU has fallen off the bus.`"""
    return [(m.group(1), int(m.group(2))) for m in _XID.finditer(dmesg)]


def parse_ecc_remap(text: str) -> dict[str, dict[str, object]]:
    """`nvidia-smi -q -d ECC,ROW_REMAPPER`: per GPU bus id, the volatile uncorrectable ECC count and
    the row remapper's `Pending` / `Remapping Failure Occurred`."""
    gpus: dict[str, dict[str, object]] = {}
    gpu: dict[str, object] | None = None
    section = ""
    for line in text.splitlines():
        head = re.match(r"^GPU ([0-9A-Fa-f:.]+)\s*$", line)
        if head:
            gpu = gpus.setdefault(
                head.group(1), {"volatile_uncorrectable": 0, "pending": False, "remap_failure": False}
            )
            section = ""  # `ECC Mode`'s own `Pending` line precedes the next GPU's Remapped Rows
            continue
        if gpu is None:
            continue
        stripped = line.strip()
        if stripped in ("Volatile", "Aggregate", "Remapped Rows"):
            section = stripped
            continue
        key, _, value = (part.strip() for part in stripped.partition(":"))
        if section == "Volatile" and "Uncorrectable" in key and value.isdigit():
            gpu["volatile_uncorrectable"] = int(gpu["volatile_uncorrectable"]) + int(value)  # type: ignore[arg-type]
        elif section == "Remapped Rows" and key == "Pending":
            gpu["pending"] = value == "Yes"
        elif section == "Remapped Rows" and key == "Remapping Failure Occurred":
            gpu["remap_failure"] = value == "Yes"
    return gpus


def parse_dcgmi_health(text: str) -> tuple[str | None, list[str]]:
    """`dcgmi health -c`: the `Overall Health` cell (Healthy, Warning, Failure) and the messages."""
    overall = re.search(r"\|\s*Overall Health\s*\|\s*(\w+)", text)
    messages = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and not cells[0] and cells[1]:
            messages.append(cells[1])
    return (overall.group(1) if overall else None), messages


def efa_error_increase(before: Mapping[str, Mapping[str, int]], now: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Per `device/counter`, how much an EFA error counter (`*_err` under
    /sys/class/infiniband/<dev>/ports/1/hw_counters) grew between two readings: the counters are
    cumulative since boot, so only growth is news."""
    grown = {}
    for device, counters in now.items():
        for name, value in counters.items():
            if name.endswith("_err") and value > before.get(device, {}).get(name, 0):
                grown[f"{device}/{name}"] = value - before.get(device, {}).get(name, 0)
    return grown


# -- the decision ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Readings:
    """One round of the tools' output on a node; None: that tool did not run, and `not_run` says why
    for each check it serves (a check that did not run is not a pass)."""

    nvidia_smi_q: str | None = None
    nvlink_status: str | None = None
    dmesg: str | None = None
    ecc_remap: str | None = None
    dcgmi_health: str | None = None
    efa_before: Mapping[str, Mapping[str, int]] | None = None
    efa_now: Mapping[str, Mapping[str, int]] | None = None
    fabric_suspect: bool | None = None  # the fabric check's fresh verdict named this node (fabric_verdict)
    not_run: Mapping[str, str] = field(default_factory=dict)  # check -> why its tool gave no reading


def fabric_entry(when: float, suspect: bool, detail: str) -> str:
    """One node's entry in the fabric verdict ConfigMap (its key: the node's name): written by the
    fabric re-check (supernode.trainer.node.fabric) for every node it measured, read by that node's agent."""
    return json.dumps({"time": when, "suspect": suspect, "detail": detail}, sort_keys=True)


def fabric_verdict(
    entries: Mapping[str, str] | None, node: str, now: float, max_age_s: float
) -> tuple[bool | None, str]:
    """This node's fabric verdict (`Readings.fabric_suspect`) and a word for the agent's line. True: the
    last check named it slow; False: the last check measured it and did not. None, no finding either
    way: no entry (never measured, e.g. a serving node), an entry this module cannot read, or one older
    than `max_age_s` (the fabric check has not run for that long: its word on the node is too old to
    keep the node out, and too old to count as a pass)."""
    raw = (entries or {}).get(node)
    if raw is None:
        return None, "no verdict"
    try:
        entry = json.loads(raw)
        when, suspect = float(entry["time"]), entry["suspect"]
    except (ValueError, KeyError, TypeError):
        return None, "unreadable verdict"
    if not isinstance(suspect, bool):
        return None, "unreadable verdict"
    if now - when > max_age_s:
        return None, f"stale verdict ({now - when:.0f} s old, limit {max_age_s:.0f} s)"
    return suspect, "named slow" if suspect else "passed"


def _xid_severity(xid: int) -> str:
    if xid in XID_HARDWARE:
        return HARDWARE
    return OK if xid in XID_APPLICATION else RECOVERABLE


def _listed(tool: str, listed: int, instance: InstanceType) -> str:
    return f"{tool} reported {listed} of the {instance.accelerators} GPUs of {instance.name}: its output is unreadable"


def decide(readings: Readings, instance: InstanceType) -> Verdict:
    """Every finding on one node against the catalog's figures for its instance type."""
    out: list[Finding] = []
    if readings.nvidia_smi_q is not None:
        count = parse_attached_gpus(readings.nvidia_smi_q)
        if count != instance.accelerators:
            out.append(
                Finding("gpu_count", HARDWARE, f"{count} GPUs attached, {instance.name} has {instance.accelerators}")
            )
    if readings.nvlink_status is not None:
        floor = NVLINK_FLOOR * instance.nvlink_gbytes_s / 2
        status = parse_nvlink_status(readings.nvlink_status)
        if len(status) < instance.accelerators:  # garbled or cut short: the GPUs it omits were not checked
            out.append(Finding("nvlink", RECOVERABLE, _listed("nvidia-smi nvlink -s", len(status), instance)))
        for gpu, links in sorted(status.items()):
            inactive = sum(rate is None for rate in links)
            total = sum(rate for rate in links if rate is not None)
            if inactive or total < floor:
                out.append(
                    Finding(
                        "nvlink", RECOVERABLE, f"GPU {gpu}: {inactive} inactive links, {total:.0f} GB/s < {floor:.0f}"
                    )
                )
    if readings.dmesg is not None:
        for bus, xid in parse_xids(readings.dmesg):
            severity = _xid_severity(xid)
            if severity != OK:
                out.append(Finding("xid", severity, f"Xid {xid} on {bus}"))
    if readings.ecc_remap is not None:
        remap = parse_ecc_remap(readings.ecc_remap)
        if not remap:  # no GPU section at all; fewer than the instance's is gpu_count's finding
            out.append(Finding("ecc", RECOVERABLE, _listed("nvidia-smi -q -d ECC,ROW_REMAPPER", 0, instance)))
        for bus, gpu in remap.items():
            if gpu["remap_failure"]:
                out.append(Finding("row_remap", HARDWARE, f"{bus}: row remapping failure occurred"))
            elif gpu["pending"]:
                out.append(Finding("row_remap", RECOVERABLE, f"{bus}: row remap pending, reset the GPU"))
            if gpu["volatile_uncorrectable"]:
                out.append(
                    Finding("ecc", RECOVERABLE, f"{bus}: {gpu['volatile_uncorrectable']} uncorrectable ECC errors")
                )
    if readings.dcgmi_health is not None:
        overall, messages = parse_dcgmi_health(readings.dcgmi_health)
        if overall is None:
            out.append(Finding("dcgm", RECOVERABLE, "dcgmi health printed no Overall Health"))
        elif overall != "Healthy":
            severity = HARDWARE if overall == "Failure" else RECOVERABLE
            out.append(Finding("dcgm", severity, f"{overall}: {' '.join(messages)[:200]}"))
    if readings.efa_now is not None:
        if len(readings.efa_now) < instance.efa_interfaces:
            out.append(
                Finding(
                    "efa",
                    HARDWARE,
                    f"{len(readings.efa_now)} EFA devices, {instance.name} has {instance.efa_interfaces}",
                )
            )
        grown = efa_error_increase(readings.efa_before or {}, readings.efa_now)
        if grown and readings.efa_before is not None:
            out.append(Finding("efa", RECOVERABLE, ", ".join(f"{k} +{v}" for k, v in sorted(grown.items()))))
    if readings.fabric_suspect:
        out.append(Finding("fabric", RECOVERABLE, "the fabric check named this node as slow"))
    return Verdict(tuple(out), tuple(sorted(readings.not_run.items())))


# -- flapping and escalation -----------------------------------------------------------------------


QUARANTINE = "quarantine"  # taint NoSchedule, keep checking
EVICT_AND_REPLACE = "replace"  # taint NoExecute, evict, terminate in the ASG
RELEASE = "release"  # remove the taint
STAY = "stay"  # no change


@dataclass
class Tracker:
    """One node's history: a quarantined node is released only after `release_after` consecutive
    passes (a node that alternates fail/pass stays quarantined), and `replace_after` failing rounds
    within `window_s` seconds escalate a recoverable fault to replacement."""

    release_after: int
    replace_after: int
    window_s: float
    quarantined: bool = False
    passes: int = 0
    failures: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("release_after", "replace_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def observe(self, verdict: Verdict, now: float) -> str:
        if verdict.severity == OK:
            self.passes += 1
            if self.quarantined and self.passes >= self.release_after:
                self.quarantined = False
                return RELEASE
            return STAY
        self.passes = 0
        self.failures = [t for t in self.failures if now - t < self.window_s] + [now]
        if verdict.severity == HARDWARE or len(self.failures) >= self.replace_after:
            self.quarantined = True
            return EVICT_AND_REPLACE
        first = not self.quarantined
        self.quarantined = True
        return QUARANTINE if first else STAY
