"""The management page (issue 37, items 1 and 3): a web application over the job API.

`supernode ui --local` serves it on 127.0.0.1 over the local backend (supernode.tools.jobs_local);
the page is one more client of the backends' API (`list`, `describe`, `logs`, `cancel`, `submit`,
and the same `job_from_mapping` / plan / `refusals` as `supernode job plan | submit`), never a second
path to the store: what it shows is what `supernode job list | describe` print.

Why Starlette + uvicorn + Jinja2, server-rendered: the page is a few tables and forms over data the
process already has in Python objects; rendering them on the server keeps one code path (no JSON API
and a JavaScript front end drawing the same tables again), no build step and no front-end packages, and
works with the keyboard and without scripts (real links, buttons and labels). Starlette is the small,
long-maintained ASGI toolkit under FastAPI (routing, forms, cookies, a TestClient for in-process
tests) without FastAPI's extra layers that a page of forms does not use; uvicorn is its reference
server; Jinja2 (already installed with torch) autoescapes every value. A few lines of vanilla JS
(ui.js, served by the app like its CSS: no CDN) refresh the job list and a job's figures in place.

- Who: every request has a viewer, `viewer_teams(request)`, the teams whose jobs it may see, cancel
  and submit for; a job of another team is answered as unknown (404), a submit for it 403 naming
  `team`. The local page has no login (it listens on 127.0.0.1 only) and sees every team
  (`ALL_TEAMS`). In the cluster (issue 37 item 2, `cluster_context`) every request but the load
  balancer's health check is authenticated first (`UiContext.authenticate`: the ALB's signed identity
  header, supernode.tools.ui_auth; 401 without one) and the person's team groups decide what they see
  (`viewer_teams`) and what they may submit and cancel for (`acting_teams`); each submit and cancel is
  recorded in the audit log (`UiContext.audit`).
- State-changing requests (submit, cancel) are POSTs carrying the session's CSRF token: a random
  session id in an HttpOnly SameSite=Strict cookie, and the token HMAC(the app's secret, that id) in
  each form, recomputed and compared server-side; a missing or wrong one is 403.
- `/teams`: the stack's Plan's team quotas (`UiContext.stack_plan`, plan.teams: never recomputed) beside
  what the viewer's teams' jobs hold now (`team_rows`); `/nodes`: the cluster's Nodes (ClusterBackend.nodes:
  role, the node agent's health and reason, its taints) and the plan's spares; the local page has none.
- Bad input (a query value, a path's job name, a form field, a job file) is 400 naming the field,
  never a 500: the same field-named ConfigError issues and refusals as the CLI.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import statistics
import time
from collections import deque
from collections.abc import Callable, Collection, Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import URL
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from supernode.core.checkpoints import complete_checkpoints
from supernode.core.errors import BadInput, ConfigError
from supernode.core.inputs import MIB, InputError, load_yaml
from supernode.core.jobs import FINAL_STATES, NAME, STATES, JobSpec, JobStatus, job_from_mapping, refusals
from supernode.core.plan import Plan
from supernode.core.runs import run_dir

HERE = Path(__file__).parent / "ui_files"
SESSION_COOKIE = "supernode_session"
MAX_JOB_BYTES = MIB
LOG_LINES = 200
ENDED_SHOWN = 50  # the job list's newest ended jobs (all=1: every one)
PLOTS = ("loss.png", "expert_load.png")
HEALTH_PATH = "/healthz"  # the load balancer's health check: answered without an identity
NAME_RE = re.compile(NAME)
JOB_KEYS = {f.alias or name for name, f in JobSpec.model_fields.items()}  # a job file's top-level keys


class _AllTeams(Container[str]):
    """Every team: the local page's viewer (no login on 127.0.0.1). It only answers `in`: it names no
    team, so the page's team filter lists the teams its jobs have."""

    def __contains__(self, team: object) -> bool:
        return isinstance(team, str)

    def __repr__(self) -> str:
        return "ALL_TEAMS"


ALL_TEAMS: Container[str] = _AllTeams()


@dataclass
class JobFiles:
    """Where a job's plan and run are read from (the local backend's HOME/jobs/NAME)."""

    plan: Path
    run: Path


@dataclass
class UiContext:
    """What the page needs of a backend: the job API itself, and how a job file is planned and
    submitted there (the local queue's stack flags, the cluster's stack)."""

    backend: Any  # LocalBackend or ClusterBackend: list / describe / logs / cancel
    plan_job: Callable[[JobSpec], Plan]  # the job's plan on this backend's hardware (may raise ConfigError)
    submit_job: Callable[[JobSpec, Plan, str], JobStatus]  # (job, plan, where its file came from) -> queued
    stack: str
    files: Callable[[str], JobFiles | None] = lambda name: None  # a job's plan and run, where readable
    viewer_teams: Callable[[Request], Container[str]] = lambda request: ALL_TEAMS
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    mode: str = "local"
    # The cluster's page: who is asking (raises Unauthenticated: 401), the teams they may change jobs of
    # (None: those they see), and the audit record of each submit and cancel (who, team, job, action, result).
    authenticate: Callable[[Request], Any] | None = None
    acting_teams: Callable[[Request], Container[str]] | None = None
    audit: Callable[..., Any] | None = None
    stack_plan: Callable[[], Plan | None] = lambda: None  # the stack's Plan: its teams' quotas and spares


def _stack_plan(stack: str, cfg, root: Path | str = ".") -> Callable[[], Plan]:
    """The stack's Plan (build_plan, as `supernode plan`), built once on the first page that needs it."""
    from functools import cache

    from supernode.core.plan import build_plan

    return cache(lambda: build_plan(stack, cfg, root=root))


def cluster_context(
    stack: str, cfg, identity, audit, backend: Any | None = None, root: Path | None = None
) -> UiContext:
    """The page in the cluster: the cluster backend (in-cluster service account), plans as `supernode job
    plan` makes them, the person from `identity` (ui_auth.AlbIdentity), `audit` (ui_auth.AuditLog)."""
    from supernode.core.jobs import job_plan
    from supernode.tools.jobs_cluster import ClusterBackend
    from supernode.tools.ui_auth import IDENTITY_HEADER

    backend = backend or ClusterBackend(stack, cfg, in_cluster=True)
    return UiContext(
        backend=backend,
        plan_job=lambda job: job_plan(stack, cfg, job, root=root or "."),
        submit_job=lambda job, plan, source: backend.submit(job, plan),
        stack=stack,
        viewer_teams=lambda request: request.state.viewer.sees,
        acting_teams=lambda request: request.state.viewer.acts,
        authenticate=lambda request: identity.viewer(request.headers.get(IDENTITY_HEADER)),
        audit=audit.record,
        mode="cluster",
        stack_plan=_stack_plan(stack, cfg, root or "."),
    )


def local_context(home: Path, stack: str, cfg, stack_args: list[str], start_runner: bool = True) -> UiContext:
    """The page over the local queue in `home`: plans are the stack's local run (`local_job_plan`)."""
    from supernode.tools.jobs_local import LocalBackend, job_dir, local_job_plan

    backend = LocalBackend(home, start_runner=start_runner)

    def files(name: str) -> JobFiles:
        where = job_dir(backend.home, name)
        return JobFiles(plan=where / "plan.json", run=run_dir(where, name))

    return UiContext(
        backend=backend,
        plan_job=lambda job: local_job_plan(stack, cfg, job),
        submit_job=lambda job, plan, source: backend.submit(job, plan, Path(source), stack_args),
        stack=stack,
        files=files,
        stack_plan=_stack_plan(stack, cfg),
    )


# -- input -------------------------------------------------------------------------------------------


class FieldError(Exception):
    """Bad input: answered 400 with the field it names."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.status = field, message, status


def _name(value: str | None, field: str, optional: bool = False) -> str | None:
    if value in (None, "") and optional:
        return None
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise FieldError(field, f"{value!r} is not a job or team name (lowercase letters, digits and '-')")
    return value


def _state(value: str | None) -> str | None:
    if value in (None, ""):
        return None
    if value not in STATES:
        raise FieldError("state", f"{value!r} is not a state; expected one of {', '.join(STATES)}")
    return value


# -- figures -----------------------------------------------------------------------------------------


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def tokens_vs_plan(s: JobStatus) -> str:
    if s.tokens_per_s is None:
        return ""
    if not s.plan_tokens_per_s:
        return f"{s.tokens_per_s:,.0f}"
    ratio = s.tokens_per_s / s.plan_tokens_per_s
    # A local run on CPU is far below its plan's accelerators: say so rather than print x0.00.
    return f"{s.tokens_per_s:,.0f} / {s.plan_tokens_per_s:,.0f} (" + (f"x{ratio:.2f})" if ratio >= 0.01 else "<x0.01)")


def plan_figures(plan: Plan) -> list[tuple[str, str]]:
    """The plan's key figures, as `supernode plan` names them."""
    d = plan.degrees
    s = plan.step
    terms = [
        ("compute", s.compute_s),
        ("recompute", s.recompute_s),
        ("exposed all-to-all", s.exposed_all_to_all_s),
        ("exposed FSDP", s.exposed_fsdp_s),
        ("TP", s.tensor_parallel_s),
    ]
    if d.pp > 1:
        terms += [("p2p", s.p2p_s), ("bubble", s.pipeline_bubble_s)]
    return [
        ("hardware", f"{plan.nodes} x {plan.instance_type}, world {plan.world_size}"),
        (
            "layout",
            f"dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x tp {d.tp} x pp {d.pp}, ep {d.ep}",
        ),
        (
            "memory per rank",
            f"{plan.memory_per_rank_gib:.2f} GiB of {plan.usable_hbm_gib:.1f} GiB usable"
            + ("" if plan.fits else f" (over by {plan.over_by_gib:.1f} GiB)"),
        ),
        ("step time", " + ".join(f"{k} {v:.3g}" for k, v in terms) + f" = {s.step_s:.3g} s"),
        ("tokens/s", f"{plan.layout.tokens_per_s:,.0f}"),
        ("steps", f"{plan.training.steps}"),
        ("grace period", f"{plan.termination_grace_s} s (a preempted pod needs {plan.termination_grace_needed_s} s)"),
    ]


def curve_svg(points: list[tuple[int, float]], what: str, css: str, width: int = 640, height: int = 240) -> str | None:
    """A series against the step as an inline SVG polyline (None without two points)."""
    pts = [(x, y) for x, y in points if math.isfinite(y)]
    if len(pts) < 2:
        return None
    pad_l, pad_b, pad_t, pad_r = 56, 28, 12, 12
    x0, x1 = pts[0][0], max(pts[-1][0], pts[0][0] + 1)
    lo, hi = min(p[1] for p in pts), max(p[1] for p in pts)
    hi = hi if hi > lo else lo + 1

    def xy(step: float, value: float) -> str:
        x = pad_l + (step - x0) / (x1 - x0) * (width - pad_l - pad_r)
        y = pad_t + (hi - value) / (hi - lo) * (height - pad_t - pad_b)
        return f"{x:.1f},{y:.1f}"

    line = " ".join(xy(*p) for p in pts)
    bottom, right = height - pad_b, width - pad_r
    return (
        f'<svg class="curve {css}" role="img" aria-labelledby="{css}-title" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
        f'<title id="{css}-title">{what} from {pts[0][1]:.3f} at step {pts[0][0]} to {pts[-1][1]:.3f} '
        f"at step {pts[-1][0]}</title>"
        f'<line x1="{pad_l}" y1="{bottom}" x2="{right}" y2="{bottom}" class="axis"/>'
        f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{bottom}" class="axis"/>'
        f'<text x="{pad_l - 4}" y="{pad_t + 10}" text-anchor="end">{hi:.2f}</text>'
        f'<text x="{pad_l - 4}" y="{bottom}" text-anchor="end">{lo:.2f}</text>'
        f'<text x="{pad_l}" y="{height - 8}">step {x0}</text>'
        f'<text x="{right}" y="{height - 8}" text-anchor="end">step {x1}</text>'
        f'<polyline points="{line}" class="line"/></svg>'
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def loss_svg(records: Iterable[dict]) -> str | None:
    """The loss curve of a run's metrics records."""
    points = [(r["step"], v) for r in records if (v := _number(r.get("loss"))) is not None]
    return curve_svg(points, "loss", "loss")


def expert_load_svg(records: Iterable[dict]) -> str | None:
    """The most loaded expert's share over the mean (the worst MoE layer) per logged step; 1.0 is balanced."""
    points = []
    for r in records:
        loads = [v for v in (r.get("expert_load_max_over_mean") or []) if _number(v) is not None]
        if loads:
            points.append((r["step"], float(max(loads))))
    return curve_svg(points, "expert load (max over mean, worst layer)", "expert-load")


HOLDING = tuple(s for s in STATES if s not in FINAL_STATES and s != "queued")  # the states that hold nodes
ROLES = ("training", "serving")  # supernode.io/gpu-role's values (supernode.core.pools)


@dataclass(frozen=True)
class TeamRow:
    """One team in one pool on the teams page: its quotas as the Plan has them (devices), and what its
    jobs hold now (None where the jobs' holdings are not the pool's devices: the local backend)."""

    team: str
    accelerator: str
    nominal: int
    borrowing_limit: int
    lending_limit: int
    used: int | None
    borrowed: int | None  # used beyond nominal
    lendable: int | None  # idle it may lend: min(lending limit, nominal - used), not negative


def team_rows(plan: Plan, jobs: Iterable[JobStatus], teams: Container[str], cluster: bool) -> list[TeamRow]:
    """The Plan's teams (plan.teams: never recomputed) the viewer may see, with their jobs' holdings: a
    cluster job's nodes x the pool's devices per node. A job does not say which pool it runs in, so the
    holdings are counted only where the stack has one pool."""
    held: dict[str, int] = {}
    for s in jobs:
        if s.state in HOLDING:
            held[s.team] = held.get(s.team, 0) + s.nodes
    counted = cluster and len(plan.teams) == 1
    rows = []
    for pool in plan.teams:
        for t in pool.teams:
            if t.name not in teams:
                continue
            used = held.get(t.name, 0) * pool.devices_per_node if counted else None
            rows.append(
                TeamRow(
                    team=t.name,
                    accelerator=pool.accelerator,
                    nominal=t.nominal,
                    borrowing_limit=t.borrowing_limit,
                    lending_limit=t.lending_limit,
                    used=used,
                    borrowed=None if used is None else max(0, used - t.nominal),
                    lendable=None if used is None else max(0, min(t.lending_limit, t.nominal - used)),
                )
            )
    return rows


MEMORY_LINE = "memory per rank, measured / plan: "


def measured_figures(records: list[dict], plan: Plan | None, log: str) -> list[tuple[str, str]]:
    """Measured against planned: the step time (median of the last logged steps), tokens/s, and rank 0's
    memory by term (the trainer's log line)."""
    out = []
    recent = [v for r in records[-20:] if (v := _number(r.get("step_s"))) is not None]
    if recent:
        measured = statistics.median(recent)
        planned = f" / plan {plan.step.step_s:.3g} s (x{measured / plan.step.step_s:.3g})" if plan else ""
        out.append(("step time", f"{measured:.3g} s (median of the last {len(recent)} logged){planned}"))
    tps = [v for r in records[-20:] if (v := _number(r.get("tokens_per_s"))) is not None]
    if tps:
        planned = f" / plan {plan.layout.tokens_per_s:,.0f}" if plan else ""
        out.append(("tokens/s", f"{statistics.median(tps):,.0f}{planned}"))
    lines = [line for line in log.splitlines() if MEMORY_LINE in line]
    if lines:
        out.append(("memory per rank (MiB, measured / plan)", lines[-1].split(MEMORY_LINE, 1)[1]))
    return out


# -- the app -----------------------------------------------------------------------------------------


class UiApp:
    """The application over one UiContext: each page a method; `app` the Starlette application."""

    def __init__(self, ctx: UiContext, allowed_hosts: list[str] | None = None):
        self.ctx = ctx
        self.env = Environment(loader=FileSystemLoader(HERE), autoescape=select_autoescape(["html"]))
        self.env.filters["secs"] = fmt_s
        self.env.globals.update(tokens_vs_plan=tokens_vs_plan, states=STATES, mode=self.ctx.mode, stack=self.ctx.stack)
        routes = [
            Route("/", self.jobs_page, name="jobs"),
            Route(HEALTH_PATH, self.health, name="health"),
            Route("/jobs/{name}", self.job_page, name="job"),
            Route("/jobs/{name}/plots/{plot}", self.plot, name="plot"),
            Route("/jobs/{name}/cancel", self.cancel, methods=["POST"], name="cancel"),
            Route("/teams", self.teams_page, name="teams"),
            Route("/nodes", self.nodes_page, name="nodes"),
            Route("/submit", self.submit_page, name="submit_page"),
            Route("/submit", self.submit, methods=["POST"], name="submit"),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]
        hosts = allowed_hosts or ["127.0.0.1", "localhost"]  # a DNS-rebinding page is refused by its Host
        self.app = Starlette(
            routes=routes,
            # Outermost first: in the cluster the load balancer's health check (Host: a node's address) is
            # answered before the host check; every other request is authenticated, then host-checked.
            middleware=[
                *([Middleware(BaseHTTPMiddleware, dispatch=self.authenticated)] if ctx.authenticate else []),
                Middleware(TrustedHostMiddleware, allowed_hosts=hosts),
            ],
            exception_handlers={
                FieldError: self.field_error,
                BadInput: self.backend_error,
                HTTPException: self.http_error,
            },
        )

    async def authenticated(self, request: Request, call_next: Callable) -> Response:
        """Every request but the health check names its person (request.state.viewer), or is 401."""
        from supernode.tools.ui_auth import Unauthenticated

        if request.url.path == HEALTH_PATH:
            return await self.health(request)
        try:
            request.state.viewer = self.ctx.authenticate(request)
        except Unauthenticated as e:
            return PlainTextResponse(f"401 Unauthorized: {e}\n", status_code=401)
        return await call_next(request)

    async def health(self, request: Request) -> Response:
        return PlainTextResponse("ok\n")

    def acting(self, request: Request) -> Container[str]:
        return (self.ctx.acting_teams or self.ctx.viewer_teams)(request)

    def audited(self, request: Request, team: str, job: str, action: str, result: str, message: str) -> None:
        if self.ctx.audit is not None:
            viewer = getattr(request.state, "viewer", None)
            self.ctx.audit(getattr(viewer, "who", "local"), team, job, action, result, message)

    def url_for(self, route: str, /, **params: Any) -> URL:
        """A route's path (relative: the page works behind any host name or proxy)."""
        return URL(str(self.app.url_path_for(route, **params)))

    def session(self, request: Request) -> str:
        sid = request.cookies.get(SESSION_COOKIE, "")
        return sid if re.fullmatch(r"[A-Za-z0-9_-]{43}", sid) else ""

    def token(self, sid: str) -> str:
        return hmac.new(self.ctx.secret, sid.encode(), hashlib.sha256).hexdigest()

    def page(self, request: Request, template: str, status: int = 200, **values) -> HTMLResponse:
        sid = self.session(request)
        fresh = not sid
        sid = sid or secrets.token_urlsafe(32)
        body = self.env.get_template(template).render(
            request=request, csrf=self.token(sid), url_for=self.url_for, **values
        )
        # The refresh asks every 2 s: an unchanged page is answered 304 without its body (the browser
        # revalidates its copy: no-cache), so a long job list costs its bytes only when it changes.
        etag = '"' + hashlib.sha256(body.encode()).hexdigest()[:32] + '"'
        if status == 200 and not fresh and request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"ETag": etag, "Cache-Control": "no-cache"})
        response = HTMLResponse(body, status_code=status)
        response.headers["ETag"], response.headers["Cache-Control"] = etag, "no-cache"
        if fresh:
            response.set_cookie(SESSION_COOKIE, sid, httponly=True, samesite="strict", path="/")
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; img-src 'self'; style-src 'self'; script-src 'self'; frame-ancestors 'none'"
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    async def checked_form(self, request: Request) -> Any:
        try:
            form = await request.form(max_files=1, max_fields=20, max_part_size=MAX_JOB_BYTES)
        except Exception as e:  # a malformed or oversized body: bad input, not a server error
            raise FieldError("body", f"not a readable form ({e})") from None
        sid = self.session(request)
        sent = form.get("csrf")
        if not sid or not isinstance(sent, str) or not hmac.compare_digest(sent, self.token(sid)):
            raise FieldError("csrf", "missing or wrong CSRF token: reload the page and try again", status=403)
        return form

    def visible(self, request: Request, name: str) -> JobStatus:
        """The job, if the viewer's teams include its team; else unknown (404), as for a job that is not."""
        try:
            status = self.ctx.backend.describe(name)
        except BadInput as e:
            raise FieldError("name", str(e), status=404) from None
        if status.team not in self.ctx.viewer_teams(request):
            raise FieldError("name", f"no job {name!r} among your teams' jobs", status=404)
        return status

    def list_jobs(self, request: Request) -> tuple[list[JobStatus], dict]:
        team = _name(request.query_params.get("team"), "team", optional=True)
        state = _state(request.query_params.get("state"))
        every = request.query_params.get("all", "")
        if every not in ("", "1"):
            raise FieldError("all", f"{every!r}: expected 1 (every ended job) or nothing")
        teams = self.ctx.viewer_teams(request)
        everything = [s for s in self.ctx.backend.list() if s.team in teams]  # one listing: the filter's teams too
        jobs = [s for s in everything if (team is None or s.team == team) and (state is None or s.state == state)]
        # Every job under way, and the newest ended ones (all of them with all=1 or a state filter).
        ended = [s for s in jobs if s.state in FINAL_STATES]
        hidden = 0 if every or state else max(0, len(ended) - ENDED_SHOWN)
        if hidden:
            drop = {id(s) for s in ended[:hidden]}  # oldest first (the list is in submission order)
            jobs = [s for s in jobs if id(s) not in drop]
        shown = {s.team for s in everything} | (set(teams) if isinstance(teams, Collection) else set())
        filters = {"team": team or "", "state": state or "", "all": every, "teams": sorted(shown), "hidden": hidden}
        return jobs, filters

    def jobs_page(self, request: Request) -> Response:
        jobs, filters = self.list_jobs(request)
        template = "jobs_table.html" if request.query_params.get("fragment") == "1" else "jobs.html"
        return self.page(request, template, jobs=jobs, filters=filters, now=time.time())

    def teams_page(self, request: Request) -> Response:
        team = _name(request.query_params.get("team"), "team", optional=True)
        plan = self.ctx.stack_plan()
        teams = self.ctx.viewer_teams(request)
        wanted = teams if team is None else ({team} if team in teams else set())
        jobs = self.ctx.backend.list() if plan is not None and plan.teams else []
        rows = team_rows(plan, jobs, wanted, self.ctx.mode == "cluster") if plan is not None else []
        has_teams = bool(plan is not None and plan.teams)
        pools = len(plan.teams) if has_teams else 0
        return self.page(request, "teams.html", rows=rows, has_teams=has_teams, pools=pools, team=team or "")

    def nodes_page(self, request: Request) -> Response:
        role = request.query_params.get("role", "")
        if role not in ("", *ROLES):
            raise FieldError("role", f"{role!r}: expected one of {', '.join(ROLES)} or nothing")
        if self.ctx.mode != "cluster":
            return self.page(request, "nodes.html", nodes=None, role=role)
        every = self.ctx.backend.nodes()
        plan = self.ctx.stack_plan()
        summary = {
            "per_role": {r: sum(n.role == r for n in every) for r in ROLES},
            "other": sum(n.role not in ROLES for n in every),
            "quarantined": sum(n.health == "quarantined" for n in every),
            "unchecked": sum(n.unchecked for n in every),
            "spares": plan.spare_nodes if plan is not None else None,
        }
        nodes = [n for n in every if not role or n.role == role]
        return self.page(request, "nodes.html", nodes=nodes, summary=summary, role=role)

    def job_values(self, request: Request, name: str) -> dict:
        status = self.visible(request, name)
        files = self.ctx.files(name)
        values: dict[str, Any] = {"job": status, "figures": None, "svgs": [], "plots": [], "checkpoints": []}
        try:
            values["log"] = "".join(deque(self.ctx.backend.logs(name, follow=False), maxlen=LOG_LINES))
        except BadInput as e:  # the cluster's queued job has no pod, so no log yet: say so on its page
            values["log"] = f"({e})"
        values["measured"] = []
        if files is not None:
            plan = None
            if files.plan.is_file():
                try:
                    plan = Plan.from_json(files.plan.read_text(encoding="utf-8"))
                except ValueError:
                    plan = None
            values["figures"] = plan_figures(plan) if plan else None
            from supernode.core.observability import JSONL, read_records

            records = read_records(files.run / JSONL)
            curves = (
                ("loss", loss_svg(records)),
                ("expert load: max over mean, worst layer", expert_load_svg(records)),
            )
            values["svgs"] = [(caption, svg) for caption, svg in curves if svg]
            values["measured"] = measured_figures(records, plan, values["log"])
            values["plots"] = [p for p in PLOTS if (files.run / p).is_file()]
            values["checkpoints"] = [step for step, _ in complete_checkpoints(files.run / "checkpoints")]
        return values

    def job_page(self, request: Request) -> Response:
        name = _name(request.path_params["name"], "name")
        values = self.job_values(request, name)
        values["notice"] = request.query_params.get("notice", "")[:300]
        template = "job_live.html" if request.query_params.get("fragment") == "1" else "job.html"
        return self.page(request, template, **values)

    def plot(self, request: Request) -> Response:
        name = _name(request.path_params["name"], "name")
        which = request.path_params["plot"]
        if which not in PLOTS:
            raise FieldError("plot", f"{which!r}: expected one of {', '.join(PLOTS)}")
        self.visible(request, name)
        files = self.ctx.files(name)
        if files is None or not (files.run / which).is_file():
            raise FieldError("plot", f"job {name!r} has no {which} yet (written when its run ends)", status=404)
        return FileResponse(files.run / which, media_type="image/png")

    def cancel_job(self, request: Request, name: str) -> JobStatus:
        team = self.visible(request, name).team
        if team not in self.acting(request):
            self.audited(request, team, name, "cancel", "forbidden", "not one of the person's teams")
            raise FieldError("name", f"job {name!r} is team {team}'s: you may read it, not cancel it", status=403)
        try:
            status = self.ctx.backend.cancel(name)
        except BadInput as e:
            self.audited(request, team, name, "cancel", "refused", str(e))
            raise FieldError("name", str(e), status=409) from None
        self.audited(request, team, name, "cancel", status.state, status.message)
        return status

    async def cancel(self, request: Request) -> Response:
        name = _name(request.path_params["name"], "name")
        await self.checked_form(request)
        status = await run_in_threadpool(self.cancel_job, request, name)
        notice = f"{status.state}: {status.message}"
        return RedirectResponse(self.url_for("job", name=name).include_query_params(notice=notice), status_code=303)

    def submit_page(self, request: Request) -> Response:
        return self.page(request, "submit.html", text="", result=None)

    async def submit(self, request: Request) -> Response:
        form = await self.checked_form(request)
        action = form.get("action")
        if action not in ("plan", "submit"):
            raise FieldError("action", f"{action!r}: expected plan or submit")
        text, source = form.get("text") or "", "the pasted job file"
        upload = form.get("file")
        if upload is not None and not isinstance(upload, str) and upload.filename:
            data = await upload.read()
            if len(data) > MAX_JOB_BYTES:
                raise FieldError("file", f"{len(data)} bytes: a job file is at most {MAX_JOB_BYTES} bytes")
            try:
                text, source = data.decode("utf-8"), upload.filename
            except UnicodeDecodeError:
                raise FieldError("file", "not UTF-8 text (a YAML job file)") from None
        if not isinstance(text, str) or not text.strip():
            raise FieldError("text", "paste a job file (YAML: name, team, priority, training, ...) or upload one")
        return await run_in_threadpool(self.plan_or_submit, request, action, text, source)

    def plan_or_submit(self, request: Request, action: str, text: str, source: str) -> Response:
        """The job file planned as `supernode job plan` does, and with action=submit queued as `job submit`
        does unless refused: 400 with each problem under its key, 409 refused (nothing queued), else 303."""
        values: dict[str, Any] = {"text": text, "result": None, "issues": [], "refusals": [], "figures": None}
        try:
            job = job_from_mapping(load_yaml(text, "job file"), "job file")
            if job.team not in self.acting(request):
                raise FieldError("team", f"{job.team!r} is not one of your teams", status=403)
            plan = self.ctx.plan_job(job)
        except InputError as e:
            values["issues"] = [("job file", str(e).removeprefix("job file: "))]
            return self.page(request, "submit.html", status=400, **values)
        except ConfigError as e:
            values["issues"] = [(i.path, i.message) for i in e.issues]
            return self.page(request, "submit.html", status=400, **values)
        except BadInput as e:  # the backend's own refusal of a key (a local job's branch)
            key, _, rest = str(e).partition(": ")
            values["issues"] = [(key, rest) if key in JOB_KEYS else ("job file", str(e))]
            return self.page(request, "submit.html", status=400, **values)
        values.update(job=job, figures=plan_figures(plan), refusals=refusals(plan))
        if action == "plan" or values["refusals"]:
            status = 409 if action == "submit" else 200  # submit refused: the same refusals as the CLI's exit 1
            if action == "submit":
                self.audited(request, job.team, job.name, "submit", "refused", "; ".join(values["refusals"]))
            return self.page(request, "submit.html", status=status, **values)
        try:
            result = self.ctx.submit_job(job, plan, source)
        except BadInput as e:
            self.audited(request, job.team, job.name, "submit", "refused", str(e))
            values["issues"] = [("name", str(e))]
            return self.page(request, "submit.html", status=409, **values)
        self.audited(request, job.team, job.name, "submit", result.state, result.message)
        return RedirectResponse(
            self.url_for("job", name=result.name).include_query_params(notice=f"{result.state}: {result.message}"),
            status_code=303,
        )

    async def field_error(self, request: Request, exc: FieldError) -> Response:
        return self.page(request, "error.html", status=exc.status, field=exc.field, message=exc.message)

    async def backend_error(self, request: Request, exc: BadInput) -> Response:
        # The job API refused (an unusable store, a cluster that does not answer): its message, not a 500.
        return self.page(request, "error.html", status=503, field="backend", message=str(exc))

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        return self.page(request, "error.html", status=exc.status_code, field="path", message=exc.detail)


def create_app(ctx: UiContext, allowed_hosts: list[str] | None = None) -> Starlette:
    return UiApp(ctx, allowed_hosts).app


def job_yaml(job: JobSpec) -> str:
    return yaml.safe_dump(job.model_dump(by_alias=True, mode="json", exclude_defaults=True), sort_keys=False)


def serve(
    ctx: UiContext,
    port: int = 8080,
    ready: Callable[[str], None] | None = None,
    host: str = "127.0.0.1",
    allowed_hosts: list[str] | None = None,
) -> None:
    """Serve the page on host:port (0: a free one) until interrupted; `ready(url)` once listening. The
    cluster's page listens on every address of its pod (its NetworkPolicy admits the load balancer only)."""
    import asyncio
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise BadInput(f"--port {port}: cannot listen on {host}:{port} ({e.strerror})") from None
    sock.listen(128)  # from here a browser's connection waits in the backlog until the server takes it
    url = f"http://{host}:{sock.getsockname()[1]}/"
    if ready is not None:
        ready(url)
    import supernode.trainer.metrics  # noqa: F401  (its torch import paid at start, not by the first job page)

    config = uvicorn.Config(create_app(ctx, allowed_hosts), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    asyncio.run(server.serve(sockets=[sock]))
