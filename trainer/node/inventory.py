"""GPU node inventory and drift ("记录卡序列号与物理位置的对应关系"; "定期巡检驱动与固件版本一致性").

    python -m supernode.trainer.node.inventory collect                         # this node's record, one JSON line
    python -m supernode.trainer.node.inventory compare BASELINE.json CURRENT.json   # offline: exit 1 on drift
    python -m supernode.trainer.node.inventory watch --namespace supernode-ops     # the inventory DaemonSet's loop

A record holds what tells a GPU node apart and what must agree across the fleet: the EC2 instance
id; per GPU its UUID, serial, PCI bus id and VBIOS; the driver and CUDA (nvidia-smi), NCCL (torch),
libfabric (fi_info), EFA installer and aws-ofi-nccl versions, the EFA device count; the host
settings the node bootstrap sets (sysctls, nofile/memlock limits, huge pages: supernode.core.host) and
time sync (chrony on Amazon Time Sync: its offset, or the kernel's estimated error). Each reader parses a command's
or file's text, so tests feed them captured samples; a tool that is absent gives null.

`watch` keeps the first record of each node as that node's baseline and the first record of any
node as the fleet's (ConfigMaps created once, never overwritten: the Kubernetes API's create is
the "keep the first" test), then on every round prints one JSON line whose `inventory_drift_count`
(the node's changes + the fleet's disagreements + host settings off the baseline) the monitoring's
log metric filter turns into the inventory-drift alarm.

Exit codes: 0 no drift, 1 drift (compare), 2 bad input.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supernode.core.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, BadInput
from supernode.core.host import AMAZON_TIME_SYNC, HOST_SYSCTLS, NOFILE
from supernode.core.processes import exit_on_sigterm

MEMLOCK_UNLIMITED = "unlimited"  # EFA pins (locks) its buffers
NVIDIA_SMI_QUERY = "index,uuid,serial,pci.bus_id,name,vbios_version,driver_version"
GPU_FIELDS = ("index", "uuid", "serial", "pci_bus_id", "name", "vbios")
# Fields every node of the fleet must share (the first node's record is the reference).
FLEET_FIELDS = (
    "driver",
    "cuda",
    "nccl",
    "libfabric",
    "efa_installer",
    "aws_ofi_nccl",
    "gpu_count",
    "gpu_name",
    "vbios",
    "efa_devices",
    "sysctl",
    "limits",
    "hugepages_2mi",
)
VOLATILE = ("node", "time", "recorded_at")  # never drift: the pod's node name, clock figures, when


# -- readers of captured text ----------------------------------------------------------------------


def parse_nvidia_smi_gpus(csv_text: str) -> list[dict[str, str]]:
    """`nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv,noheader`: one dict per GPU."""
    gpus = []
    for line in csv_text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(NVIDIA_SMI_QUERY.split(",")):
            continue
        index, uuid, serial, bus, name, vbios, driver = cells
        gpus.append(
            {
                "index": index,
                "uuid": uuid,
                "serial": serial,
                "pci_bus_id": bus.lower(),
                "name": name,
                "vbios": vbios,
                "driver": driver,
            }
        )
    return gpus


def parse_cuda_version(nvidia_smi_text: str) -> str | None:
    """The driver's CUDA version from `nvidia-smi`'s banner ("CUDA Version: 13.0")."""
    m = re.search(r"CUDA Version:\s*([\d.]+)", nvidia_smi_text)
    return m.group(1) if m else None


def parse_fi_info_version(text: str) -> str | None:
    """`fi_info --version`: the libfabric line ("libfabric: 2.1.0amzn3.0")."""
    m = re.search(r"^libfabric:\s*(\S+)", text, re.MULTILINE)
    return m.group(1) if m else None


def parse_efa_installer(text: str) -> str | None:
    """/opt/amazon/efa_installed_packages: "# EFA installer version: 1.43.3"."""
    m = re.search(r"EFA installer version:\s*(\S+)", text)
    return m.group(1) if m else None


def parse_ofi_nccl_version(library: bytes) -> str | None:
    """The version aws-ofi-nccl compiles into its plugin library (its package string)."""
    m = re.search(rb"aws-ofi-nccl[ -]v?(\d+\.\d+\.\d+(?:-[\w.]+)?)", library)
    return m.group(1).decode() if m else None


def parse_limits(text: str) -> dict[str, str | None]:
    """/proc/self/limits: the soft nofile and memlock limits ("unlimited" or a number)."""
    out: dict[str, str | None] = {"nofile": None, "memlock": None}
    for line in text.splitlines():
        for key, label in (("nofile", "Max open files"), ("memlock", "Max locked memory")):
            if line.startswith(label):
                out[key] = line[len(label) :].split()[0]
    return out


def parse_chrony_tracking(text: str) -> dict[str, Any]:
    """`chronyc tracking`: the reference source and the system clock's offset (ms, signed)."""
    ref = re.search(r"^Reference ID\s*:\s*\S+\s*\(([^)]*)\)", text, re.MULTILINE)
    off = re.search(r"^System time\s*:\s*([\d.]+) seconds (fast|slow)", text, re.MULTILINE)
    offset_ms = None
    if off:
        offset_ms = round(float(off.group(1)) * 1e3 * (1 if off.group(2) == "fast" else -1), 6)
    source = (ref.group(1) if ref else "") or None
    synced = source not in (None, "127.127.1.1")  # no reference, or the local clock: not synchronised
    return {
        "source": source,
        "amazon_time_sync": source in AMAZON_TIME_SYNC if synced else None,
        "offset_ms": offset_ms,
        "synchronised": synced,
    }


# -- collection on a node --------------------------------------------------------------------------


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


class _Timex(ctypes.Structure):
    # struct timex (x86_64 / aarch64 glibc): the fields before them are what we read.
    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("_rest", ctypes.c_byte * 200),
    ]


def kernel_time_sync() -> dict[str, Any]:
    """Without chronyc (a container): the kernel clock's sync state, which chronyd keeps up to date
    (adjtimex: STA_UNSYNC and the estimated error). A read-only call; no privilege needed."""
    tx = _Timex()
    try:
        state = ctypes.CDLL(None, use_errno=True).adjtimex(ctypes.byref(tx))
    except (OSError, AttributeError):
        return {"source": None, "amazon_time_sync": None, "offset_ms": None, "synchronised": None}
    return {
        "source": "kernel",
        "amazon_time_sync": None,
        "offset_ms": round(tx.esterror / 1e3, 3),
        "synchronised": state != 5 and not tx.status & 0x40,
    }  # TIME_ERROR, STA_UNSYNC


def time_sync() -> dict[str, Any]:
    text = _run(["chronyc", "tracking"])
    return parse_chrony_tracking(text) if text else kernel_time_sync()


def instance_id() -> str | None:
    """Nitro publishes the instance id as the DMI board asset tag (no instance metadata needed)."""
    tag = _read("/sys/devices/virtual/dmi/id/board_asset_tag") or ""
    return tag if tag.startswith("i-") else None


def nccl_version() -> str | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - a torch without NCCL is a null, not a crash of the inventory
        return None


def ofi_nccl_version(lib_dir: str = "/opt/aws-ofi-nccl/lib") -> str | None:
    for lib in sorted(Path(lib_dir).glob("libnccl-net*.so*")) if Path(lib_dir).is_dir() else []:
        try:
            found = parse_ofi_nccl_version(lib.read_bytes())
        except OSError:
            continue
        if found:
            return found
    return None


def build_record(
    gpus: list[dict[str, str]],
    *,
    cuda: str | None,
    nccl: str | None,
    libfabric: str | None,
    efa_installer: str | None,
    aws_ofi_nccl: str | None,
    efa_devices: int,
    sysctl: dict[str, int | None],
    limits: dict[str, str | None],
    hugepages_2mi: int | None,
    time_sync: dict[str, Any],
    node: str,
    instance: str | None,
) -> dict[str, Any]:
    """One node's record from what the readers returned."""
    return {
        "node": node,
        "instance_id": instance,
        "gpus": [{k: g[k] for k in GPU_FIELDS} for g in gpus],
        "gpu_count": len(gpus),
        "gpu_name": sorted({g["name"] for g in gpus}),
        "vbios": sorted({g["vbios"] for g in gpus}),
        "driver": gpus[0]["driver"] if gpus else None,
        "cuda": cuda,
        "nccl": nccl,
        "libfabric": libfabric,
        "efa_installer": efa_installer,
        "aws_ofi_nccl": aws_ofi_nccl,
        "efa_devices": efa_devices,
        "sysctl": sysctl,
        "limits": limits,
        "hugepages_2mi": hugepages_2mi,
        "time": time_sync,
    }


def collect() -> dict[str, Any]:
    """This node's record (the readers above on the live tools and files)."""
    smi = _run(["nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader"]) or ""
    fi = _run(["fi_info", "--version"]) or ""
    efa = Path("/sys/class/infiniband")
    sysctl = {}
    for key in HOST_SYSCTLS:
        value = _read("/proc/sys/" + key.replace(".", "/"))
        sysctl[key] = int(value) if value and value.lstrip("-").isdigit() else None
    pages = _read("/proc/sys/vm/nr_hugepages")
    return build_record(
        parse_nvidia_smi_gpus(smi),
        cuda=parse_cuda_version(_run(["nvidia-smi"]) or ""),
        nccl=nccl_version(),
        libfabric=parse_fi_info_version(fi),
        efa_installer=parse_efa_installer(_read("/opt/amazon/efa_installed_packages") or ""),
        aws_ofi_nccl=ofi_nccl_version(),
        efa_devices=len(list(efa.iterdir())) if efa.is_dir() else 0,
        sysctl=sysctl,
        limits=parse_limits(_read("/proc/self/limits") or ""),
        hugepages_2mi=int(pages) if pages else None,
        time_sync=time_sync(),
        node=os.environ.get("NODE_NAME") or socket.gethostname(),
        instance=instance_id(),
    )


# -- drift -----------------------------------------------------------------------------------------


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaves; GPUs keyed by index so a swapped card shows as its own fields."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) and "index" in v for v in value):
        return _flat({f"gpu{v['index']}": v for v in value}, prefix)
    return {prefix.rstrip("."): value}


def drift(
    baseline: dict[str, Any], current: dict[str, Any], fields: tuple[str, ...] | None = None
) -> list[dict[str, Any]]:
    """What changed from the baseline (restricted to `fields` when given), volatile fields aside:
    one {field, baseline, current} per differing leaf, sorted by field."""

    def pick(rec: dict[str, Any]) -> dict[str, Any]:
        keep = {k: v for k, v in rec.items() if k not in VOLATILE and (fields is None or k in fields)}
        return _flat(keep)

    a, b = pick(baseline), pick(current)
    return [
        {"field": k, "baseline": a.get(k), "current": b.get(k)} for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
    ]


def host_findings(record: dict[str, Any], max_offset_ms: float) -> list[str]:
    """Host settings off the bootstrap's baseline, and time sync beyond the bound."""
    out = []
    for key, want in HOST_SYSCTLS.items():
        got = record["sysctl"].get(key)
        if got is not None and got != want:
            out.append(f"sysctl {key} = {got}, the bootstrap sets {want}")
    nofile, memlock = record["limits"].get("nofile"), record["limits"].get("memlock")
    if nofile is not None and nofile != "unlimited" and int(nofile) < NOFILE:
        out.append(f"nofile limit {nofile} < {NOFILE}")
    if memlock is not None and memlock != MEMLOCK_UNLIMITED:
        out.append(f"memlock limit {memlock}, EFA needs unlimited")
    t = record["time"]
    if t.get("synchronised") is False:
        out.append(f"clock not synchronised (source {t.get('source') or 'none'})")
    elif t.get("offset_ms") is not None and abs(t["offset_ms"]) > max_offset_ms:
        out.append(f"clock offset {t['offset_ms']:g} ms beyond {max_offset_ms:g} ms")
    if t.get("amazon_time_sync") is False:
        out.append(f"time source {t.get('source')}, not Amazon Time Sync ({AMAZON_TIME_SYNC[0]})")
    return out


# -- the baselines, kept as ConfigMaps -------------------------------------------------------------

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ConfigMaps:
    """Create-once ConfigMaps in one namespace through the in-cluster API (the pod's service account)."""

    def __init__(self, namespace: str):
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise BadInput("watch runs in a pod: KUBERNETES_SERVICE_HOST is not set")
        self.url = f"https://{host}:{port}/api/v1/namespaces/{namespace}/configmaps"
        self.token = (SA_DIR / "token").read_text(encoding="utf-8").strip()
        self.tls = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))

    def _call(self, method: str, url: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(
            url,
            method=method,
            data=json.dumps(body).encode() if body else None,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, context=self.tls, timeout=30) as resp:
            return json.loads(resp.read())

    def keep_first(self, name: str, data: dict[str, str]) -> dict[str, str]:
        """The ConfigMap's data: `data` if this call created it, else what the first caller stored."""
        try:
            return self._call(
                "POST",
                self.url,
                {"metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "supernode"}}, "data": data},
            )["data"]
        except urllib.error.HTTPError as e:
            if e.code != 409:  # AlreadyExists: the baseline was kept by an earlier round or node
                raise
        return self._call("GET", f"{self.url}/{name}")["data"]


def baseline_name(record: dict[str, Any]) -> str:
    key = record.get("instance_id") or record["node"]
    return "inventory-" + re.sub(r"[^a-z0-9-]+", "-", key.lower()).strip("-")[:50]


def check(
    record: dict[str, Any], keep_first: Callable[[str, dict[str, str]], dict[str, str]], max_offset_ms: float
) -> dict[str, Any]:
    """One round: keep the baselines (the node's own, the fleet's), compare, and the JSON line to print."""
    text = {"record.json": json.dumps(record, sort_keys=True)}
    node_base = json.loads(keep_first(baseline_name(record), text)["record.json"])
    fleet_base = json.loads(keep_first("inventory-fleet", text)["record.json"])
    node = drift(node_base, record)
    fleet = drift(fleet_base, record, FLEET_FIELDS)
    host = host_findings(record, max_offset_ms)
    return {
        "inventory": record["node"],
        "instance_id": record.get("instance_id"),
        "inventory_drift_count": len(node) + len(fleet) + len(host),
        "node_drift": node,
        "fleet_drift": fleet,
        "fleet_reference": fleet_base.get("node"),
        "host": host,
        "time": record["time"],
        "record": record,
    }


# -- command line ----------------------------------------------------------------------------------


def _load(path: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise BadInput(f"{path}: cannot be read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError):
        raise BadInput(
            f"{path}: not JSON; give a record written by `python -m supernode.trainer.node.inventory collect`"
        ) from None
    if not isinstance(doc, dict) or "gpus" not in doc:
        raise BadInput(
            f'{path}: not an inventory record (no "gpus"); give the output of '
            "`python -m supernode.trainer.node.inventory collect`"
        )
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supernode.trainer.node.inventory", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("collect", help="print this node's record")
    c = sub.add_parser("compare", help="drift between two records; exit 1 when they differ")
    c.add_argument("baseline")
    c.add_argument("current")
    w = sub.add_parser("watch", help="keep the baselines and report drift every --interval-s (the DaemonSet)")
    w.add_argument("--namespace", required=True, help="where the baseline ConfigMaps live")
    w.add_argument("--interval-s", type=int, default=3600)
    w.add_argument(
        "--max-clock-offset-ms", type=float, default=10.0, help="flag a clock offset (or estimated error) beyond this"
    )
    w.add_argument("--once", action="store_true", help="one round, then exit")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return EXIT_BAD_INPUT if e.code else EXIT_OK
    try:
        if args.cmd == "collect":
            print(json.dumps(collect(), sort_keys=True))
            return EXIT_OK
        if args.cmd == "compare":
            found = drift(_load(args.baseline), _load(args.current))
            print(json.dumps({"inventory_drift_count": len(found), "drift": found}, sort_keys=True))
            return EXIT_FAILED if found else EXIT_OK
        if args.interval_s < 60 or args.max_clock_offset_ms <= 0:
            raise BadInput("--interval-s must be at least 60 and --max-clock-offset-ms positive")
        store = ConfigMaps(args.namespace)
        exit_on_sigterm()
        while True:
            try:
                print(
                    json.dumps(check(collect(), store.keep_first, args.max_clock_offset_ms), sort_keys=True), flush=True
                )
            except (OSError, urllib.error.URLError, ValueError, KeyError) as e:  # next round retries
                print(json.dumps({"inventory": "error", "error": str(e)}), flush=True)
            if args.once:
                return EXIT_OK
            time.sleep(args.interval_s)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
