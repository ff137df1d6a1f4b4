"""The management page in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright's
Python package with `executable_path`: nothing is downloaded at run time; `make test` installs the
Debian package where it is absent).

The server is the real one (uvicorn on a free 127.0.0.1 port, in a thread of the test process) over a
local store filled and moved on through the LocalBackend API, as in test_ui.py.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from test_ui import TOO_BIG, dev_config, metrics, spec

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dev():
    return dev_config()


@pytest.fixture(scope="module")
def browser():
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)  # a new empty profile
        yield b
        b.close()


@pytest.fixture
def served(tmp_path, dev):
    """(url, ctx): the page over a store with a running job that has metrics and a queued one."""
    import uvicorn

    from supernode.tools.jobs_local import job_dir, local_job_plan
    from supernode.tools.ui import create_app, local_context

    ctx = local_context(tmp_path / "jobs", "dev", dev, ["--stack", "dev", "--root", str(ROOT)], start_runner=False)
    b = ctx.backend
    for name in ("alpha", "beta"):
        s = spec(name)
        b.submit(s, local_job_plan("dev", dev, s), Path(f"{name}.yaml"), [])
    with b.db(write=True) as con:
        con.execute("UPDATE jobs SET state = 'running', attempts = 1 WHERE name = 'alpha'")
    metrics(b.home, "alpha", 15, checkpoints=(10,))
    (job_dir(b.home, "alpha") / "log").write_text("rank0: step 15 loss 4.5\n")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(ctx), log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", ctx
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1366, "height": 768})  # a laptop's screen
    p = context.new_page()
    p.set_default_timeout(15_000)
    yield p
    context.close()


def state_cell(page, name: str):
    return page.locator(f'tr[data-job="{name}"] td.state')


def test_the_job_list_updates_as_a_job_changes_state(served, page):
    url, ctx = served
    page.goto(url + "/")
    assert state_cell(page, "beta").inner_text() == "queued"
    ctx.backend.cancel("beta")  # through the job API, not the page
    page.wait_for_function(
        "() => document.querySelector('tr[data-job=\"beta\"] td.state').textContent.trim() === 'cancelled'"
    )
    with ctx.backend.db(write=True) as con:  # the runner's own transition: the running job ends
        con.execute("UPDATE jobs SET state = 'succeeded', step = 20 WHERE name = 'alpha'")
    page.wait_for_function(
        "() => document.querySelector('tr[data-job=\"alpha\"] td.state').textContent.trim() === 'succeeded'"
    )
    assert page.url == url + "/"  # refreshed in place, not reloaded


def test_a_job_page_shows_its_loss_curve(served, page):
    url, _ = served
    page.goto(url + "/")
    page.get_by_role("link", name="alpha").click()
    page.wait_for_url(url + "/jobs/alpha")
    curve = page.locator("svg.loss polyline")
    assert curve.is_visible()
    assert len(curve.get_attribute("points").split()) == 15
    box = page.locator("svg.loss").bounding_box()
    assert box["width"] > 300 and box["height"] > 100
    assert "loss from 5.900 at step 1 to 4.500 at step 15" in page.locator("svg.loss title").text_content()
    assert "the newest is step 10" in page.content()


def test_a_submit_that_does_not_fit_or_has_a_bad_key_shows_the_refusal_naming_the_field(served, page):
    url, ctx = served
    page.goto(url + "/submit")
    page.get_by_label("Job file (YAML)").fill(TOO_BIG)
    page.get_by_role("button", name="Plan").click()
    refusal = page.locator("li.refusal")
    assert refusal.first.inner_text().startswith("refused: memory:")
    page.get_by_role("button", name="Submit").click()  # the textarea keeps the job file
    assert page.locator("li.refusal").first.inner_text().startswith("refused: memory:")
    assert "huge" not in [s.name for s in ctx.backend.list()]
    page.get_by_label("Job file (YAML)").fill("name: typo\nteam: research\ntraining: {stepz: 3}\n")
    page.get_by_role("button", name="Plan").click()
    issue = page.locator("#issues li")
    assert issue.locator("code.field").inner_text() == "training.stepz"
    assert "did you mean 'steps'" in issue.inner_text()


def test_submit_then_cancel(served, page):
    url, ctx = served
    page.goto(url + "/submit")
    page.get_by_label("Job file (YAML)").fill("name: fresh\nteam: research\npriority: high\ntraining: {steps: 40}\n")
    page.get_by_role("button", name="Submit").click()
    page.wait_for_url(url + "/jobs/fresh?*")
    assert ctx.backend.describe("fresh").state == "queued"
    page.get_by_role("button", name="Cancel fresh").click()
    page.wait_for_url(url + "/jobs/fresh?notice=*")
    assert "cancelled while queued" in page.locator(".notice").inner_text()
    assert ctx.backend.describe("fresh").state == "cancelled"


def test_cancel_by_keyboard(served, page):
    url, ctx = served
    page.goto(url + "/jobs/beta")
    for _ in range(30):  # Tab through the page's links and controls to the cancel button
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "cancel":
            break
    else:
        pytest.fail("Tab never reached the cancel button")
    outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline not in ("", "none")  # the focus is visible
    page.keyboard.press("Enter")
    page.wait_for_url(url + "/jobs/beta?notice=*")
    assert ctx.backend.describe("beta").state == "cancelled"


def test_the_teams_link_is_reached_and_followed_by_keyboard(served, page):
    url, _ = served
    page.goto(url + "/")
    for _ in range(10):  # the skip link, then the nav's links
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "nav-teams":
            break
    else:
        pytest.fail("Tab never reached the Teams link")
    page.keyboard.press("Enter")
    page.wait_for_url(url + "/teams")
    assert "declares no teams" in page.locator("#no-teams").inner_text()


def test_the_list_follows_a_real_local_job_from_queued_to_succeeded(tmp_path, browser):
    """The runner and the trainer for real (the dev stack's local run): a job submitted on the page is
    watched on the list, refreshed in place, through running (with its step) to succeeded."""
    import uvicorn

    from supernode.core.config import load_stack
    from supernode.tools.ui import create_app, local_context

    ctx = local_context(tmp_path / "jobs", "dev", load_stack("dev", ROOT), ["--stack", "dev", "--root", str(ROOT)])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(ctx), log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(url + "/submit")
        page.get_by_label("Job file (YAML)").fill(
            "name: live\nteam: research\ntraining: {steps: 12, checkpointInterval: 6, warmupSteps: 2}\n"
        )
        page.get_by_role("button", name="Submit").click()
        page.wait_for_url(url + "/jobs/live?*")
        page.goto(url + "/")
        cell = "document.querySelector('tr[data-job=\"live\"] td:nth-child(%d)').textContent.trim()"
        page.wait_for_function(f"() => {cell % 4} === 'running'", timeout=120_000)
        page.wait_for_function(f"() => {cell % 4} === 'succeeded'", timeout=180_000)
        assert page.locator('tr[data-job="live"] td').nth(7).inner_text() == "12/12"
        assert page.url == url + "/"
    finally:
        context.close()
        if ctx.backend.describe("live").state not in ("succeeded", "failed", "cancelled"):
            ctx.backend.cancel("live")
        server.should_exit = True
        thread.join(10)
