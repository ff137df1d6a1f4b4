"""The management page (supernode.tools.ui): page load and the job list at 1,000 jobs against 10.

    python -m supernode.bench.ui [--jobs 10,1000] [--repeats 7] [--stack dev]

The real server (uvicorn on a free 127.0.0.1 port, in a thread) over a local store of N jobs (the
mix of supernode.bench.jobs: mostly ended, a tenth queued, one running with metrics); each page is
fetched --repeats times over HTTP after one warm-up: time to first byte (request sent -> status line
and headers read; the page is rendered whole before its first byte), total time, and the payload's
bytes. Pages: the job list (`/`: every job under way and the 50 newest ended ones), every job
(`/?all=1`), the list's refresh fragment (`/?fragment=1`, what the page fetches every 2 s), the same
fragment revalidated (If-None-Match: 304 without a body where nothing changed; a queued job's wait
grows, so a waiting queue changes it), and the running job's page. Ratios are against the smallest N.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from supernode.bench.jobs import _job, _store
from supernode.core.config import load_stack
from supernode.core.runs import run_dir
from supernode.tools.jobs_local import job_dir, local_job_plan
from supernode.tools.ui import create_app, local_context

ROOT = Path(__file__).resolve().parents[2]
PAGES = {"list": "/", "list_all": "/?all=1", "fragment": "/?fragment=1", "job": "/jobs/job-00009"}


class Served:
    """uvicorn serving `app` on a free 127.0.0.1 port in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def fetch(port: int, path: str, headers: dict | None = None) -> tuple[float, float, int, dict]:
    """(time to first byte s, total s, body bytes, headers) of one GET on a fresh connection."""
    con = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.perf_counter()
    con.request("GET", path, headers=headers or {})
    response = con.getresponse()
    ttfb = time.perf_counter() - t0
    body = response.read()
    total = time.perf_counter() - t0
    con.close()
    if response.status not in (200, 304):
        raise RuntimeError(f"GET {path}: {response.status}")
    return ttfb, total, len(body), dict(response.getheaders())


def measure(stack: str, sizes: list[int], repeats: int, work: Path) -> list[dict]:
    cfg = load_stack(stack, ROOT)
    plan = local_job_plan(stack, cfg, _job("plan"))
    rows = []
    for n in sizes:
        home = work / f"ui-{n}"
        _store(home, n, plan, stack)
        run = run_dir(job_dir(home, "job-00009"), "job-00009")  # the running job (seq 10) has 20 steps of metrics
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i, "loss": 6 - i / 10, "tokens_per_s": 1e4}) + "\n" for i in range(1, 21))
        )
        ctx = local_context(home, stack, cfg, ["--stack", stack], start_runner=False)
        with Served(create_app(ctx)) as served:
            first = fetch(served.port, "/")  # the session cookie and an ETag, as a browser keeps them
            cookie = first[3]["set-cookie"].split(";", 1)[0]
            for page, path in PAGES.items():
                warm = fetch(served.port, path, {"Cookie": cookie})  # warm-up: templates compiled, imports done
                samples = [fetch(served.port, path, {"Cookie": cookie}) for _ in range(repeats)]
                rows.append(
                    {
                        "n": n,
                        "page": page,
                        "ttfb_s": statistics.median(s[0] for s in samples),
                        "total_s": statistics.median(s[1] for s in samples),
                        "bytes": samples[-1][2],
                    }
                )
                if page != "fragment":
                    continue
                # The refresh of an unchanged list: revalidated (If-None-Match), answered 304 without a body.
                again = {"Cookie": cookie, "If-None-Match": warm[3]["etag"]}
                samples = [fetch(served.port, path, again) for _ in range(repeats)]
                rows.append(
                    {
                        "n": n,
                        "page": "fragment_revalidated",
                        "ttfb_s": statistics.median(s[0] for s in samples),
                        "total_s": statistics.median(s[1] for s in samples),
                        "bytes": samples[-1][2],
                    }
                )
    base = {r["page"]: r for r in rows if r["n"] == sizes[0]}
    return [
        {
            "bench": "ui",
            "page": r["page"],
            "jobs": r["n"],
            "ttfb_ms": round(r["ttfb_s"] * 1e3, 1),
            "total_ms": round(r["total_s"] * 1e3, 1),
            "kib": round(r["bytes"] / 1024, 1),
            "ttfb_ratio": round(r["ttfb_s"] / base[r["page"]]["ttfb_s"], 1),
            "size_ratio": round(r["bytes"] / base[r["page"]]["bytes"], 1) if base[r["page"]]["bytes"] else None,
            "jobs_ratio": r["n"] // sizes[0],
        }
        for r in rows
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="supernode bench ui", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="10,1000", help="store sizes (comma-separated)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--stack", default="dev")
    args = p.parse_args(argv)
    sizes = sorted(int(x) for x in args.jobs.split(","))
    if sizes[0] < 10:
        p.error("--jobs: every size at least 10 (the running job is the tenth)")
    with tempfile.TemporaryDirectory(prefix="bench-ui-") as tmp:
        for line in measure(args.stack, sizes, args.repeats, Path(tmp)):
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
