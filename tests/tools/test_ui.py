"""The management page (supernode.tools.ui) in-process: starlette's TestClient against the ASGI app over a
local job store filled through the real LocalBackend API (no runner: jobs are moved on by the store's
own transitions and metrics files written where the trainer writes them).

Every route with bad input answers 400 naming the field (never a 500), state-changing requests need
the session's CSRF token (403), a viewer of team A neither sees nor cancels team B's jobs, and a
submit shows the CLI's field-named config errors and refusals.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from supernode.core.checkpoints import COMPLETE, step_dir
from supernode.core.config import from_mapping, load_stack
from supernode.core.jobs import JobStatus, job_from_mapping
from supernode.core.runs import run_dir
from supernode.tools.jobs_local import job_dir, local_job_plan
from supernode.tools.ui import ALL_TEAMS, create_app, expert_load_svg, local_context, loss_svg, tokens_vs_plan

ROOT = Path(__file__).resolve().parents[2]
TOKEN = re.compile(r'name="csrf" value="([0-9a-f]+)"')
TOO_BIG = "name: huge\nteam: research\ntraining: {microBatch: 65536, globalBatch: 131072}\n"


def dev_config():
    data = load_stack("dev", ROOT).to_mapping()
    data["local"]["model"]["seqLen"] = 2048  # so that a big micro-batch is over the local plan's memory
    return from_mapping(data)


@pytest.fixture(scope="module")
def dev():
    return dev_config()


def spec(name: str, team: str = "research", priority: str = "normal", steps: int = 20):
    return job_from_mapping({"name": name, "team": team, "priority": priority, "training": {"steps": steps}})


def metrics(home: Path, name: str, steps: int, checkpoints: tuple[int, ...] = ()) -> Path:
    run = run_dir(job_dir(home, name), name)
    run.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {
                "step": i,
                "loss": 6.0 - 0.1 * i,
                "tokens_per_s": 2000.0,
                "step_s": 0.5,
                "expert_load_max_over_mean": [1.5, 1.2 + i / 100],
            }
        )
        for i in range(1, steps + 1)
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for step in checkpoints:
        step_dir(run / "checkpoints", step).mkdir(parents=True)
        (step_dir(run / "checkpoints", step) / COMPLETE).write_text("{}")
    return run


@pytest.fixture
def ui(tmp_path, dev):
    """(client, ctx) over a store with two teams' jobs: a running one with metrics and a queued one."""
    ctx = local_context(tmp_path / "jobs", "dev", dev, ["--stack", "dev", "--root", str(ROOT)], start_runner=False)
    b = ctx.backend
    for name, team in (("alpha", "research"), ("beta", "research"), ("gamma", "vision")):
        s = spec(name, team)
        b.submit(s, local_job_plan("dev", dev, s), Path(f"{name}.yaml"), [])
    with b.db(write=True) as con:
        con.execute("UPDATE jobs SET state = 'running', attempts = 1, waited_s = 1.5 WHERE name = 'alpha'")
    metrics(b.home, "alpha", 12, checkpoints=(10,))
    log = "".join(f"rank0 step {i}\n" for i in range(1, 500))
    log += "memory per rank, measured / plan: parameters 1.0 / 1.0 MiB, peak 372.1 / 10.5 MiB\n"
    (job_dir(b.home, "alpha") / "log").write_text(log)
    client = TestClient(create_app(ctx, allowed_hosts=["testserver"]))
    return client, ctx


def token(client: TestClient, path: str = "/submit") -> str:
    return TOKEN.search(client.get(path).text).group(1)


def field_of(response) -> str:
    m = re.search(r'<code class="field">([^<]+)</code>', response.text)
    return m.group(1) if m else ""


def test_the_job_list_shows_every_column_and_filters(ui):
    client, _ = ui
    r = client.get("/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    row = re.search(r'<tr data-job="alpha">(.*?)</tr>', r.text, re.S).group(1)
    cells = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
    assert cells[:4] == ["alpha", "research", "normal", "running"]
    assert cells[5] == "1.5 s" and cells[6] == "2" and cells[7] == "12/20" and cells[8] == "4.800"
    assert re.fullmatch(r"2,000 / [\d,]+ \((x\d\.\d\d|<x0\.01)\)", cells[9]) and cells[10] == "step 10"
    beta = re.search(r'<tr data-job="beta">(.*?)</tr>', r.text, re.S).group(1)
    assert ">#1<" in beta  # queued first
    assert re.findall(r'data-job="([^"]+)"', client.get("/?team=vision").text) == ["gamma"]
    assert re.findall(r'data-job="([^"]+)"', client.get("/?state=queued").text) == ["beta", "gamma"]
    fragment = client.get("/?fragment=1&state=running")  # what ui.js fetches to refresh the list
    assert fragment.text.startswith("<table") and re.findall(r'data-job="([^"]+)"', fragment.text) == ["alpha"]


def test_an_unchanged_page_is_revalidated_without_its_body(ui):
    client, ctx = ui
    with ctx.backend.db(write=True) as con:  # no queued job: nothing on the list moves by itself
        con.execute("UPDATE jobs SET state = 'succeeded' WHERE state = 'queued'")
    first = client.get("/?fragment=1")
    etag = first.headers["etag"]
    again = client.get("/?fragment=1", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    ctx.backend.describe("alpha")
    metrics(ctx.backend.home, "alpha", 13)  # the running job logs a step: the list changes
    changed = client.get("/?fragment=1", headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag and "13/20" in changed.text


def test_the_list_shows_the_newest_ended_jobs_and_every_one_on_demand(tmp_path, dev, monkeypatch):
    import supernode.tools.ui as ui_module

    monkeypatch.setattr(ui_module, "ENDED_SHOWN", 2)
    ctx = local_context(tmp_path / "jobs", "dev", dev, ["--stack", "dev"], start_runner=False)
    for i in range(5):
        s = spec(f"j{i}")
        ctx.backend.submit(s, local_job_plan("dev", dev, s), Path("j.yaml"), [])
    with ctx.backend.db(write=True) as con:
        con.execute("UPDATE jobs SET state = 'succeeded' WHERE name != 'j0'")
    client = TestClient(create_app(ctx, allowed_hosts=["testserver"]))
    r = client.get("/")
    assert re.findall(r'data-job="([^"]+)"', r.text) == ["j0", "j3", "j4"]  # under way, then the newest ended
    assert "2 older ended job(s) not shown" in r.text and 'href="/?team=&amp;all=1"' in r.text
    assert re.findall(r'data-job="([^"]+)"', client.get("/?all=1").text) == [f"j{i}" for i in range(5)]
    assert len(re.findall(r"data-job=", client.get("/?state=succeeded").text)) == 4  # a state filter: all


def test_the_job_list_follows_the_backend(ui):
    client, ctx = ui
    ctx.backend.cancel("beta")
    assert 'data-job="beta">' in client.get("/?state=cancelled").text


def test_a_job_page_shows_plan_loss_checkpoints_log_and_cancel(ui):
    client, ctx = ui
    r = client.get("/jobs/alpha")
    assert r.status_code == 200
    assert "<polyline" in r.text and "loss from 5.900 at step 1 to 4.800 at step 12" in r.text
    for figure in ("layout", "memory per rank", "step time", "dp_shard 2", "GiB of 72.0 GiB usable"):
        assert figure in r.text
    assert "expert load (max over mean, worst layer) from 1.500 at step 1 to 1.500 at step 12" in r.text
    assert "0.5 s (median of the last 12 logged) / plan" in r.text
    assert "parameters 1.0 / 1.0 MiB, peak 372.1 / 10.5 MiB" in r.text  # rank 0's memory, measured / plan
    assert "the newest is step 10" in r.text
    assert "rank0 step 499" in r.text and "rank0 step 299\n" not in r.text  # the last 200 lines
    assert 'id="cancel"' in r.text and 'action="/jobs/alpha/cancel"' in r.text
    run = run_dir(job_dir(ctx.backend.home, "alpha"), "alpha")
    (run / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    r = client.get("/jobs/alpha")
    assert 'href="/jobs/alpha/plots/loss.png"' in r.text
    png = client.get("/jobs/alpha/plots/loss.png")
    assert png.status_code == 200 and png.headers["content-type"] == "image/png" and png.content.startswith(b"\x89PNG")


def test_tokens_per_s_against_the_plan():
    s = JobStatus(name="a", team="t", priority="low", state="running", backend="local", submitted_at=0, steps=9)
    assert tokens_vs_plan(s) == ""
    assert tokens_vs_plan(s.model_copy(update={"tokens_per_s": 950.0})) == "950"
    assert (
        tokens_vs_plan(s.model_copy(update={"tokens_per_s": 950.0, "plan_tokens_per_s": 1000.0}))
        == "950 / 1,000 (x0.95)"
    )
    assert (
        tokens_vs_plan(s.model_copy(update={"tokens_per_s": 1.0, "plan_tokens_per_s": 1e6})) == "1 / 1,000,000 (<x0.01)"
    )


def test_loss_svg_needs_two_finite_points():
    assert loss_svg([{"step": 1, "loss": 2.0}]) is None
    assert loss_svg([{"step": 1, "loss": 2.0}, {"step": 2, "loss": float("nan")}]) is None
    svg = loss_svg([{"step": 1, "loss": 2.0}, {"step": 5, "loss": 1.0}, {"step": 6}])
    assert svg.count("<polyline") == 1 and "step 5" in svg
    assert expert_load_svg([{"step": 1, "expert_load_max_over_mean": [1.1, 1.9]}, {"step": 2}]) is None
    svg = expert_load_svg([{"step": s, "expert_load_max_over_mean": [1.1, 1.0 + s]} for s in (1, 2)])
    assert "from 2.000 at step 1 to 3.000 at step 2" in svg


def test_cancel_needs_the_sessions_csrf_token(ui):
    client, ctx = ui
    assert client.post("/jobs/beta/cancel").status_code == 403
    r = client.post("/jobs/beta/cancel", data={"csrf": "0" * 64})
    assert r.status_code == 403 and field_of(r) == "csrf"
    other = TestClient(client.app)  # another session's token is not this one's
    assert other.post("/jobs/beta/cancel", data={"csrf": token(client)}).status_code == 403
    assert ctx.backend.describe("beta").state == "queued"
    r = client.post("/jobs/beta/cancel", data={"csrf": token(client, "/jobs/beta")}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/jobs/beta?notice=cancelled")
    assert ctx.backend.describe("beta").state == "cancelled"
    assert "cancelled while queued" in client.get(r.headers["location"]).text
    again = client.post("/jobs/beta/cancel", data={"csrf": token(client)})
    assert again.status_code == 409 and field_of(again) == "name" and "already ended" in again.text


def test_a_running_job_is_cancelled_through_the_runner(ui):
    client, ctx = ui
    r = client.post("/jobs/alpha/cancel", data={"csrf": token(client)})
    assert r.status_code == 200 and ctx.backend.describe("alpha").state == "cancelling"


def test_submit_needs_the_csrf_token(ui):
    client, ctx = ui
    r = client.post("/submit", data={"action": "submit", "text": "name: new\nteam: research\n"})
    assert r.status_code == 403 and field_of(r) == "csrf"
    assert "new" not in [s.name for s in ctx.backend.list()]


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/?state=bogus", "state"),
        ("/?team=Not_A_Team", "team"),
        ("/?all=yes", "all"),
        ("/jobs/Bad_Name", "name"),
        ("/jobs/" + "x" * 60, "name"),
        ("/jobs/alpha/plots/secrets.txt", "plot"),
        ("/jobs/Bad_Name/plots/loss.png", "name"),
    ],
)
def test_bad_input_in_a_get_is_400_naming_the_field(ui, path, field):
    client, _ = ui
    r = client.get(path)
    assert r.status_code == 400, r.text
    assert field_of(r) == field


def test_unknown_jobs_and_routes_are_404_not_500(ui):
    client, _ = ui
    assert client.get("/jobs/nosuch").status_code == 404
    assert client.get("/jobs/alpha/plots/expert_load.png").status_code == 404  # not written yet
    assert client.get("/nowhere").status_code == 404
    assert client.get("/jobs/alpha/plots/..%2f..%2fjobs.db").status_code == 404  # no route: nothing read
    assert client.post("/jobs/nosuch/cancel", data={"csrf": token(client)}).status_code == 404
    assert client.delete("/jobs/alpha").status_code == 405


def test_an_unusable_store_is_named_not_a_500(ui):
    client, ctx = ui
    for f in ctx.backend.home.glob("jobs.db*"):
        f.unlink()
    (ctx.backend.home / "jobs.db").write_bytes(b"not a database" * 100)
    r = client.get("/")
    assert r.status_code == 503 and field_of(r) == "backend" and "not a usable job store" in r.text


@pytest.mark.parametrize(
    ("form", "field"),
    [
        ({"action": "launch", "text": "name: a\nteam: b\n"}, "action"),
        ({"text": "name: a\nteam: b\n"}, "action"),
        ({"action": "plan", "text": "  "}, "text"),
        ({"action": "plan"}, "text"),
        ({"action": "plan", "text": "name: a\nteam: [b\n"}, "job file"),
        ({"action": "plan", "text": "- a list\n"}, "job"),
        ({"action": "plan", "text": "name: a\nteam: research\nmodel: {dimm: 3}\n"}, "model.dimm"),
        ({"action": "plan", "text": "name: Bad\nteam: research\n"}, "name"),
        ({"action": "submit", "text": "name: a\nteam: research\ntraining: {steps: -1}\n"}, "training.steps"),
        ({"action": "plan", "text": "name: a\nteam: research\nnodes: {max: 99}\n"}, "nodes.max"),
        ({"action": "plan", "text": "name: a\nteam: research\nbranch: {fromRun: r, step: 3}\n"}, "branch"),
    ],
)
def test_bad_input_in_a_submit_is_400_naming_the_field(ui, form, field):
    client, ctx = ui
    r = client.post("/submit", data={"csrf": token(client), **form})
    assert r.status_code == 400, r.text
    assert field_of(r) == field, r.text
    assert len(ctx.backend.list()) == 3  # nothing submitted


def test_a_bad_upload_is_400_naming_the_file_field(ui):
    client, _ = ui
    r = client.post(
        "/submit",
        data={"csrf": token(client), "action": "plan"},
        files={"file": ("job.yaml", b"\xff\xfe", "text/yaml")},
    )
    assert r.status_code == 400 and field_of(r) == "file"
    big = b"name: a\n" + b"#" * (1 << 21)
    r = client.post("/submit", data={"csrf": token(client), "action": "plan"}, files={"file": ("big.yaml", big)})
    assert r.status_code == 400 and field_of(r) == "file" and "at most 1048576 bytes" in r.text
    r = client.post("/submit", data={"csrf": token(client), "action": "plan", "text": big.decode()})
    assert r.status_code == 400 and field_of(r) == "body" and "maximum size" in r.text  # over 1 MiB: not parsed
    r = client.post("/submit", content=b"not a form", headers={"content-type": "multipart/form-data; boundary=x"})
    assert r.status_code in (400, 403)


def test_plan_shows_the_refusal_and_submit_refuses_it(ui):
    client, ctx = ui
    r = client.post("/submit", data={"csrf": token(client), "action": "plan", "text": TOO_BIG})
    assert r.status_code == 200
    refusal = re.search(r'<li class="refusal">refused: (memory: [^<]+)</li>', r.text).group(1)
    assert "GiB per rank is over the usable 72.0 GiB" in refusal
    r = client.post("/submit", data={"csrf": token(client), "action": "submit", "text": TOO_BIG})
    assert r.status_code == 409 and "refused: memory:" in r.text
    assert "huge" not in [s.name for s in ctx.backend.list()]


def test_plan_then_submit_an_upload(ui):
    client, ctx = ui
    text = b"name: delta\nteam: research\npriority: high\ntraining: {steps: 30}\n"
    files = {"file": ("delta.yaml", text, "text/yaml")}
    r = client.post("/submit", data={"csrf": token(client), "action": "plan"}, files=files)
    assert r.status_code == 200, r.text
    assert "it may be submitted" in r.text and "delta" not in [j.name for j in ctx.backend.list()]
    r = client.post("/submit", data={"csrf": token(client), "action": "submit"}, files=files, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/jobs/delta?notice=queued")
    s = ctx.backend.describe("delta")
    assert (s.team, s.priority, s.steps, s.state) == ("research", "high", 30, "queued")
    again = client.post(
        "/submit", data={"csrf": token(client), "action": "submit", "text": "name: delta\nteam: research\n"}
    )
    assert again.status_code == 409 and field_of(again) == "name" and "already in the local queue" in again.text


def test_a_viewer_of_one_team_cannot_see_or_cancel_anothers_jobs(tmp_path, dev, ui):
    _, ctx = ui
    ctx.viewer_teams = lambda request: {"vision"}  # the cluster's per-request who: here, team vision
    client = TestClient(create_app(ctx, allowed_hosts=["testserver"]))
    assert re.findall(r'data-job="([^"]+)"', client.get("/").text) == ["gamma"]
    assert re.findall(r'data-job="([^"]+)"', client.get("/?team=research").text) == []
    assert client.get("/jobs/alpha").status_code == 404 and client.get("/jobs/gamma").status_code == 200
    assert client.get("/jobs/alpha/plots/loss.png").status_code == 404
    r = client.post("/jobs/alpha/cancel", data={"csrf": token(client)})
    assert r.status_code == 404 and ctx.backend.describe("alpha").state == "running"
    r = client.post("/submit", data={"csrf": token(client), "action": "plan", "text": "name: x\nteam: research\n"})
    assert r.status_code == 403 and field_of(r) == "team"
    r = client.post("/jobs/gamma/cancel", data={"csrf": token(client)})
    assert r.status_code == 200 and ctx.backend.describe("gamma").state == "cancelled"


def test_local_mode_sees_every_team():
    assert "research" in ALL_TEAMS and "anything" in ALL_TEAMS and None not in ALL_TEAMS


def test_only_localhost_host_headers_are_served(ui):
    _, ctx = ui
    client = TestClient(create_app(ctx), base_url="http://evil.example")
    assert client.get("/").status_code == 400
    assert TestClient(create_app(ctx), base_url="http://127.0.0.1:8080").get("/").status_code == 200


def test_static_files_are_served_by_the_app(ui):
    client, _ = ui
    page = client.get("/").text
    for asset in re.findall(r'(?:href|src)="(/static/[^"]+)"', page):
        assert client.get(asset).status_code == 200
    assert "http" not in "".join(re.findall(r'(?:href|src)="([^"]+)"', page))  # no CDN: nothing external
    assert "default-src 'self'" in client.get("/").headers["content-security-policy"]


# -- the command ------------------------------------------------------------------------------------


def test_the_command_serves_only_the_local_page_and_checks_its_port(capsys):
    from supernode.cli import main

    assert main(["ui"]) == 2
    assert "--local" in capsys.readouterr().err
    assert main(["ui", "--local", "--port", "70000"]) == 2
    assert "--port 70000" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_prints_its_url_serves_and_stops(tmp_path):
    """What `make demo` does: start it on a free port, read the URL it prints, open it, stop it."""
    import signal
    import subprocess
    import sys
    import urllib.request

    proc = subprocess.Popen(
        [sys.executable, "-m", "supernode", "ui", "--local", "--home", str(tmp_path / "jobs"), "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        with urllib.request.urlopen(url, timeout=60) as r:
            assert r.status == 200 and "0 job(s)" in r.read().decode()
        with urllib.request.urlopen(url + "submit", timeout=60) as r:
            assert 'name="csrf"' in r.read().decode()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stdout.read()


def test_the_local_teams_and_nodes_pages_say_what_there_is_and_show_no_made_up_figures(ui, tmp_path):
    client, _ = ui
    teams = client.get("/teams")
    assert teams.status_code == 200 and 'id="no-teams"' in teams.text and "declares no teams" in teams.text
    assert "<table" not in teams.text  # dev has no teams: a sentence, not an empty table
    nodes = client.get("/nodes")
    assert nodes.status_code == 200 and "processes on this machine: there are no cluster nodes" in nodes.text
    assert "data-node" not in nodes.text and "data-count" not in nodes.text
    assert client.get("/nodes?role=gpu").status_code == 400 and field_of(client.get("/nodes?role=gpu")) == "role"
    assert field_of(client.get("/teams?team=BAD")) == "team"
    # A local queue over a stack with teams (prod): the Plan's quotas, and no GPUs counted as used (its
    # jobs' nodes are local processes)
    prod = load_stack("prod", ROOT)
    ctx = local_context(tmp_path / "prod-jobs", "prod", prod, ["--stack", "prod"], start_runner=False)
    page = TestClient(create_app(ctx, allowed_hosts=["testserver"])).get("/teams")
    (pool,) = ctx.stack_plan().teams
    research = next(t for t in pool.teams if t.name == "research")
    row = re.search(r'<tr data-team="research"[^>]*>(.*?)</tr>', page.text, re.S).group(1)
    cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
    assert cells[2:] == [
        str(research.nominal),
        str(research.borrowing_limit),
        str(research.lending_limit),
        "-",
        "-",
        "-",
    ]
    assert "Local jobs run as processes on this machine" in page.text
