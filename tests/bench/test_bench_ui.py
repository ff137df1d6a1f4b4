"""`supernode bench ui` runs end to end on a small store and prints one JSON line per page and size."""

from __future__ import annotations

import json

from supernode.bench import ui
from supernode.cli.commands.bench import BENCHES


def test_bench_ui_prints_each_page_at_each_size(capsys):
    assert BENCHES["ui"] == "supernode.bench.ui"
    assert ui.main(["--jobs", "10,20", "--repeats", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    pages = {"list", "list_all", "fragment", "fragment_revalidated", "job"}
    assert {(r["page"], r["jobs"]) for r in lines} == {(p, n) for p in pages for n in (10, 20)}
    for r in lines:
        assert r["bench"] == "ui" and r["ttfb_ms"] > 0 and r["total_ms"] >= r["ttfb_ms"]
    size = {(r["page"], r["jobs"]): r["kib"] for r in lines}
    assert size[("list", 20)] > size[("list", 10)] and size[("job", 20)] == size[("job", 10)]
