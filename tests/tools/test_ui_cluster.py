"""The management page in the cluster's mode (issue 37, item 2): every request authenticated by the load
balancer's signed identity header (ES256, this ALB as signer, unexpired), the person's team groups
deciding what they see and change, and one audit record per submit and cancel. Over the real cluster
backend against the in-process API double (tests/kube_api.py) on prod's two teams, and a real boto3
CloudWatch Logs client under botocore's Stubber (each call checked against the service's API model)."""

from __future__ import annotations

import base64
import io
import json
import re
import time
from pathlib import Path

import boto3
import pytest
import yaml
from botocore.stub import Stubber
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from starlette.testclient import TestClient

from supernode.components.aws import management
from supernode.core.config import load_stack
from supernode.core.jobs import job_from_mapping, job_plan
from supernode.tools import ui
from supernode.tools.jobs_cluster import ClusterBackend
from supernode.tools.ui_auth import IDENTITY_HEADER, AlbIdentity, AuditLog, Unauthenticated, viewer_for
from tests.kube_api import KubeApi

ROOT = Path(__file__).resolve().parents[2]
SIGNER = "arn:aws:elasticloadbalancing:us-east-1:123456789012:loadbalancer/app/management/0123456789abcdef"
HOST = "supernode-prod.internal.example.com"
KEY = ec.generate_private_key(ec.SECP256R1())
TOKEN = re.compile(r'name="csrf" value="([0-9a-f]+)"')
RESEARCH, PLATFORM = "supernode:team:research", "supernode:team:platform"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def identity_header(groups, who="ana@example.com", key=KEY, signer=SIGNER, exp_in=60.0, alg="ES256") -> str:
    """What the ALB sends: header and claims base64url, the ES256 signature as raw r || s."""
    head = b64(json.dumps({"alg": alg, "kid": "key-1", "signer": signer, "exp": time.time() + exp_in}).encode())
    body = b64(json.dumps({"email": who, "sub": "0001", "groups": groups}).encode())
    r, s = decode_dss_signature(key.sign(f"{head}.{body}".encode(), ec.ECDSA(hashes.SHA256())))
    return f"{head}.{body}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def public_pem(region: str, kid: str) -> bytes:
    assert (region, kid) == ("us-east-1", "key-1")
    return KEY.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture
def api():
    a = KubeApi()
    yield a
    a.close()


@pytest.fixture
def page(api, tmp_path):
    """(client, backend, audit stdout, stubber) with a research job and a platform job on the cluster."""
    cfg = load_stack("prod", ROOT)
    backend = ClusterBackend("prod", cfg, kubeconfig=api.kubeconfig(tmp_path / "kubeconfig"))
    for data in (
        {"name": "sweep", "team": "research"},
        {"name": "evaluation", "team": "platform", "nodes": {"max": 8}},
    ):
        job = job_from_mapping(data)
        backend.submit(job, job_plan("prod", cfg, job, root=ROOT))
    logs = boto3.client("logs", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stubber = Stubber(logs)
    out = io.StringIO()
    audit = AuditLog("/supernode/prod/management-audit", stream="ui-pod", client=logs, out=out)
    identity = AlbIdentity("us-east-1", SIGNER, "groups", [t.name for t in cfg.teams], fetch=public_pem)
    ctx = ui.cluster_context("prod", cfg, identity, audit, backend=backend, root=ROOT)
    client = TestClient(ui.create_app(ctx, allowed_hosts=[HOST]), base_url=f"https://{HOST}")
    with stubber:
        yield client, backend, out, stubber


def jobs_seen(client, header) -> list[str]:
    r = client.get("/", headers={IDENTITY_HEADER: header})
    assert r.status_code == 200, r.text
    return re.findall(r'data-job="([^"]+)"', r.text)


def audit_records(out: io.StringIO) -> list[dict]:
    return [json.loads(line.removeprefix("audit ")) for line in out.getvalue().splitlines()]


def test_a_team_sees_only_its_jobs_and_the_admins_see_every_team(page):
    client, *_ = page
    assert jobs_seen(client, identity_header([RESEARCH])) == ["sweep"]
    assert jobs_seen(client, identity_header([PLATFORM])) == ["evaluation"]
    assert sorted(jobs_seen(client, identity_header(["supernode:admins"]))) == ["evaluation", "sweep"]
    assert jobs_seen(client, identity_header(["engineering"])) == []  # no team group: nothing
    other = client.get("/jobs/evaluation", headers={IDENTITY_HEADER: identity_header([RESEARCH])})
    assert other.status_code == 404  # another team's job is answered as unknown


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "no x-amzn-oidc-data header"),
        (identity_header([RESEARCH], key=ec.generate_private_key(ec.SECP256R1())), "signature does not verify"),
        (identity_header([RESEARCH], signer=SIGNER.replace("management", "other")), "not this page's load balancer"),
        (identity_header([RESEARCH], exp_in=-1), "expired"),
        (identity_header([RESEARCH], alg="none"), "the load balancer signs ES256"),
        ("not-a-jwt", "is not a JWT"),
    ],
)
def test_a_missing_or_forged_identity_is_401(page, header, reason):
    client, *_ = page
    headers = {IDENTITY_HEADER: header} if header else {}
    for path in ("/", "/jobs/sweep", "/submit"):
        r = client.get(path, headers=headers)
        assert r.status_code == 401 and reason in r.text, (path, r.text)
    assert client.post("/jobs/sweep/cancel", headers=headers, data={"csrf": "0" * 64}).status_code == 401


def test_the_load_balancers_health_check_needs_no_identity_and_no_host_name(page):
    client, *_ = page
    assert client.get(ui.HEALTH_PATH, headers={"host": "10.40.3.7:30443"}).text == "ok\n"
    assert ui.HEALTH_PATH == management.HEALTH_PATH  # what the target group's health check asks for


def csrf(client, header, path="/submit") -> str:
    return TOKEN.search(client.get(path, headers={IDENTITY_HEADER: header}).text).group(1)


def expect_audit(stubber: Stubber, first: bool = True) -> None:
    if first:
        stubber.add_response("create_log_stream", {})
    stubber.add_response("put_log_events", {"nextSequenceToken": "1"})


def test_each_submit_and_cancel_is_audited_and_a_team_changes_only_its_own_jobs(page, api):
    client, backend, out, stubber = page
    research = identity_header([RESEARCH])
    job_file = yaml.safe_dump({"name": "sweep-2", "team": "research"})
    expect_audit(stubber)
    r = client.post(
        "/submit",
        headers={IDENTITY_HEADER: research},
        data={"csrf": csrf(client, research), "action": "submit", "text": job_file},
        follow_redirects=False,
    )
    assert r.status_code == 303, r.text
    assert ("pytorchjobs", "team-research", "sweep-2") in api.objects
    # a job file for another team: refused before anything is planned or recorded as submitted
    other = client.post(
        "/submit",
        headers={IDENTITY_HEADER: research},
        data={"csrf": csrf(client, research), "action": "submit", "text": job_file.replace("research", "platform")},
    )
    assert other.status_code == 403 and ("pytorchjobs", "team-platform", "sweep-2") not in api.objects
    expect_audit(stubber, first=False)
    cancel = client.post(
        "/jobs/sweep/cancel",
        headers={IDENTITY_HEADER: research},
        data={"csrf": csrf(client, research, "/jobs/sweep")},
        follow_redirects=False,
    )
    assert cancel.status_code == 303
    assert [s.method for s in api.requests("DELETE", "/namespaces/team-research/pytorchjobs/sweep")] == ["DELETE"]
    # the admins read every team's jobs and change none (the CLI's admin role): refused and recorded
    admin = identity_header(["supernode:admins"], who="root@example.com")
    expect_audit(stubber, first=False)
    refused = client.post(
        "/jobs/evaluation/cancel",
        headers={IDENTITY_HEADER: admin},
        data={"csrf": csrf(client, admin, "/jobs/evaluation")},
    )
    assert refused.status_code == 403 and not api.requests("DELETE", "/namespaces/team-platform/")
    stubber.assert_no_pending_responses()  # every record went to the log group
    records = [(r["who"], r["team"], r["job"], r["action"], r["result"]) for r in audit_records(out)]
    assert records == [
        ("ana@example.com", "research", "sweep-2", "submit", "queued"),
        ("ana@example.com", "research", "sweep", "cancel", "cancelled"),
        ("root@example.com", "platform", "evaluation", "cancel", "forbidden"),
    ]


def test_an_audit_record_that_cannot_be_delivered_is_said_and_still_printed(capsys):
    logs = boto3.client("logs", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    out = io.StringIO()
    with Stubber(logs) as stubber:
        stubber.add_client_error("create_log_stream", "AccessDeniedException", "no")
        AuditLog("/g", stream="s", client=logs, out=out).record("ana", "research", "j", "cancel", "cancelled")
    assert audit_records(out)[0]["job"] == "j"
    assert "the record did not reach /g" in capsys.readouterr().err


def test_groups_map_to_teams_the_clis_way():
    v = viewer_for("ana", [RESEARCH, "supernode:admins", "supernode:team:marketing"], ["research", "platform"])
    assert v.acts == {"research"} and v.sees == {"research", "platform"}  # no team the stack lacks
    # the groups are read from the configured claim only (management.ui.oidc.groupsClaim)
    elsewhere = AlbIdentity("us-east-1", SIGNER, "roles", ["research"], fetch=public_pem)
    assert elsewhere.viewer(identity_header([RESEARCH])).acts == frozenset()
    with pytest.raises(Unauthenticated, match="could not be read"):
        AlbIdentity("us-east-1", SIGNER, "groups", ["research"], fetch=lambda r, k: b"junk").viewer(
            identity_header([RESEARCH])
        )


def cells_of(text: str, attr: str, value: str) -> list[str]:
    row = re.search(rf'<tr {attr}="{value}"[^>]*>(.*?)</tr>', text, re.S)
    assert row, f"no row {attr}={value}"
    return [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)]


def test_the_teams_page_shows_the_plans_quotas_and_what_the_running_job_holds(page, api):
    client, backend, *_ = page
    api.add_workload("team-research", "sweep", created=time.time() - 60, admitted_at=time.time() - 30, nodes=10)
    for i in range(10):  # one worker pod per node: JobStatus.nodes counts the running ones
        api.add_pod("team-research", "sweep", i)
    assert {s.name: (s.state, s.nodes) for s in backend.list()}["sweep"] == ("running", 10)
    plan = ui._stack_plan("prod", load_stack("prod", ROOT), ROOT)()
    (pool,) = plan.teams  # prod: one H100 pool, two teams
    share = {t.name: t for t in pool.teams}
    admin = client.get("/teams", headers={IDENTITY_HEADER: identity_header(["supernode:admins"])})
    assert admin.status_code == 200
    r, p = share["research"], share["platform"]
    used = 10 * pool.devices_per_node  # 80 of its nominal 96: nothing borrowed, 16 idle (under its lending limit 32)
    lend = min(r.lending_limit, r.nominal - used)
    assert (r.nominal, r.lending_limit, lend) == (96, 32, 16)
    research = cells_of(admin.text, "data-team", "research")
    assert research == ["research", pool.accelerator, "96", str(r.borrowing_limit), "32", str(used), "0", "16"]
    platform = cells_of(admin.text, "data-team", "platform")  # the queued job holds nothing
    assert platform == ["platform", pool.accelerator, str(p.nominal), str(p.borrowing_limit), str(p.lending_limit)] + [
        "0",
        "0",
        str(min(p.lending_limit, p.nominal)),
    ]
    mine = client.get("/teams", headers={IDENTITY_HEADER: identity_header([RESEARCH])})
    assert re.findall(r'data-team="([^"]+)"', mine.text) == ["research"]  # team A does not see team B's row
    other = client.get("/teams?team=platform", headers={IDENTITY_HEADER: identity_header([RESEARCH])})
    assert re.findall(r'data-team="([^"]+)"', other.text) == []
    bad = client.get("/teams?team=Not_A_Team", headers={IDENTITY_HEADER: identity_header([RESEARCH])})
    assert bad.status_code == 400 and '<code class="field">team</code>' in bad.text


def test_the_nodes_page_shows_health_roles_and_the_plans_spares(page, api):
    from supernode.core.pools import ROLE_LABEL
    from supernode.trainer.node import agent

    client, *_ = page
    h100 = {agent.INSTANCE_TYPE_LABEL: "p5.48xlarge"}
    api.add_node("ip-10-0-0-1", labels=h100 | {ROLE_LABEL: "training", agent.HEALTH_LABEL: "ok"})
    finding = "EFA bandwidth 120 GB/s under the 160 GB/s expected"
    api.add_node(
        "ip-10-0-0-2",
        labels=h100 | {ROLE_LABEL: "training", agent.HEALTH_LABEL: "quarantined"},
        annotations={agent.REASON_ANNOTATION: finding},
        taints=[{"key": agent.UNHEALTHY_TAINT, "value": "slow-efa", "effect": "NoSchedule"}],
    )
    api.add_node(
        "ip-10-0-0-3",
        labels=h100 | {ROLE_LABEL: "serving"},
        taints=[{"key": agent.UNCHECKED_TAINT, "effect": "NoSchedule"}],
    )
    assert not api.rejected
    r = client.get("/nodes", headers={IDENTITY_HEADER: identity_header([RESEARCH])})
    assert r.status_code == 200, r.text
    assert cells_of(r.text, "data-node", "ip-10-0-0-1") == [
        "ip-10-0-0-1", "p5.48xlarge", "training", "ok", "", "", "yes"
    ]  # fmt: skip
    quarantined = cells_of(r.text, "data-node", "ip-10-0-0-2")
    assert quarantined[3:6] == ["quarantined", finding, "unhealthy"]
    assert cells_of(r.text, "data-node", "ip-10-0-0-3")[2:6] == ["serving", "not checked yet", "", "unchecked"]
    counts = dict(re.findall(r'data-count="([a-z]+)">(\d+)<', r.text))
    spares = ui._stack_plan("prod", load_stack("prod", ROOT), ROOT)().spare_nodes
    assert counts == {"training": "2", "serving": "1", "quarantined": "1", "unchecked": "1", "spares": str(spares)}
    serving = client.get("/nodes?role=serving", headers={IDENTITY_HEADER: identity_header([RESEARCH])})
    assert re.findall(r'data-node="([^"]+)"', serving.text) == ["ip-10-0-0-3"]
    bad = client.get("/nodes?role=gpu", headers={IDENTITY_HEADER: identity_header([RESEARCH])})
    assert bad.status_code == 400 and '<code class="field">role</code>' in bad.text


def test_a_nodes_list_the_cluster_refuses_is_a_503_naming_the_backend(page, api):
    client, *_ = page
    api.forbid_cluster_list = True  # as without the nodes role's ClusterRoleBinding
    r = client.get("/nodes", headers={IDENTITY_HEADER: identity_header([RESEARCH])})
    assert r.status_code == 503 and '<code class="field">backend</code>' in r.text
    assert "listing the cluster&#39;s nodes: forbidden (403)" in r.text
