"""The management page's load balancer and identities through the real prod program and the pack
(issue 37, item 2): prod passes; an open or unlisted range, a plain-HTTP or unauthenticated listener, an
internet-facing load balancer, a wider IAM policy and a cluster-wide binding each fail naming the resource."""

from __future__ import annotations

import copy
import json

import pytest
from policy_resources import ROOT, find, mutate

from supernode.core import resource_types as T
from supernode.core.config import ConfigError, from_mapping, load_stack
from supernode.tools.policycheck import check, config_from_stack
from supernode.tools.preview import run_program

pytestmark = pytest.mark.slow  # the Pulumi program under the mock engine

POLICIES = ("lb-ingress-allowed-cidrs", "lb-listener-https-authenticated", "management-ui-least-privilege")


@pytest.fixture(scope="module")
def prod():
    cfg = load_stack("prod", ROOT)
    return cfg, [r.to_json() for r in run_program("prod", cfg).resources]


def found(resources: list[dict], cfg) -> list[tuple[str, str, str]]:
    """(policy, resource name, message) of the management policies' violations."""
    names = {r["urn"]: r["name"] for r in resources}
    return [
        (v.policy, names.get(v.urn, ""), v.message)
        for v in check(resources, config_from_stack(cfg)).violations
        if v.policy in POLICIES
    ]


def test_prod_has_the_page_behind_an_internal_https_authenticated_lb_and_passes(prod):
    cfg, resources = prod
    lb = find(resources, T.LOAD_BALANCER)["inputs"]
    assert lb["internal"] is True and lb["loadBalancerType"] == "application"
    [listener] = [r["inputs"] for r in resources if r["type"] == T.LB_LISTENER]
    assert listener["protocol"] == "HTTPS" and listener["certificateArn"] == cfg.management.ui.certificate_arn
    assert [a["type"] for a in listener["defaultActions"]] == ["authenticate-oidc", "forward"]
    rules = [r["inputs"] for r in resources if r["type"] == T.SG_INGRESS and r["name"].startswith("management-https")]
    assert sorted(r.get("cidrIpv4") for r in rules) == sorted(cfg.management.allowed_cidrs)
    assert all(r["fromPort"] == r["toPort"] == 443 for r in rules)
    audit = find(resources, T.LOG_GROUP, "management-audit")["inputs"]
    assert audit["retentionInDays"] == cfg.management.ui.audit_retention_days and audit["kmsKeyId"]
    assert found(resources, cfg) == []


@pytest.mark.parametrize("cidr", ["0.0.0.0/0", "192.168.0.0/16", "10.8.0.0/8"])
def test_ingress_outside_the_allowed_ranges_fails_naming_the_rule(prod, cidr):
    cfg, resources = prod
    bad = mutate(resources, T.SG_INGRESS, lambda i: i.update(cidrIpv4=cidr), "management-https-0")
    hits = [(p, n) for p, n, m in found(bad, cfg) if cidr in m]
    assert hits == [("lb-ingress-allowed-cidrs", "management-https-0")]


def test_ipv6_anywhere_fails_and_no_configured_ranges_fails_every_rule(prod):
    cfg, resources = prod
    bad = mutate(resources, T.SG_INGRESS, lambda i: i.update(cidrIpv4=None, cidrIpv6="::/0"), "management-https-1")
    assert [(p, n) for p, n, _ in found(bad, cfg)] == [("lb-ingress-allowed-cidrs", "management-https-1")]
    closed = cfg.model_copy(update={"management": cfg.management.model_copy(update={"allowed_cidrs": []})})
    assert sorted(n for _, n, _ in found(resources, closed)) == ["management-https-0", "management-https-1"]


def test_an_internet_facing_load_balancer_fails(prod):
    cfg, resources = prod
    bad = mutate(resources, T.LOAD_BALANCER, lambda i: i.update(internal=False))
    assert [(p, "internet-facing" in m) for p, _, m in found(bad, cfg)] == [("lb-ingress-allowed-cidrs", True)]


def http_listener(inputs: dict, actions: list[dict]) -> None:
    inputs.update(protocol="HTTP", port=80, defaultActions=actions)
    inputs.pop("certificateArn"), inputs.pop("sslPolicy")


def test_a_plain_http_listener_fails_unless_it_only_redirects_to_https(prod):
    cfg, resources = prod
    forward = [{"type": "forward", "order": 1, "targetGroupArn": "arn:tg"}]
    bad = mutate(resources, T.LB_LISTENER, lambda i: http_listener(i, forward))
    assert [(p, n) for p, n, _ in found(bad, cfg)] == [("lb-listener-https-authenticated", "management-https")]
    redirect = [{"type": "redirect", "redirect": {"protocol": "HTTPS", "port": "443", "statusCode": "HTTP_301"}}]
    assert found(mutate(resources, T.LB_LISTENER, lambda i: http_listener(i, redirect)), cfg) == []


def test_an_https_listener_without_authentication_or_with_old_tls_fails(prod):
    cfg, resources = prod
    unauthenticated = mutate(
        resources,
        T.LB_LISTENER,
        lambda i: i.update(defaultActions=[a for a in i["defaultActions"] if a["type"] == "forward"]),
    )
    [(policy, name, message)] = found(unauthenticated, cfg)
    assert (policy, name) == ("lb-listener-https-authenticated", "management-https")
    assert "forwards without authenticating" in message
    old = mutate(resources, T.LB_LISTENER, lambda i: i.update(sslPolicy="ELBSecurityPolicy-2016-08"))
    assert ["below 1.2" in m for _, _, m in found(old, cfg)] == [True]


def widen(statement: dict):
    def change(inputs: dict) -> None:
        doc = json.loads(inputs["policy"])
        doc["Statement"][0].update(statement)
        inputs["policy"] = json.dumps(doc)

    return change


@pytest.mark.parametrize(
    "statement", [{"Action": ["logs:PutLogEvents", "logs:DeleteLogGroup"]}, {"Resource": "*"}, {"Action": "logs:*"}]
)
def test_a_wider_ui_role_policy_fails(prod, statement):
    cfg, resources = prod
    bad = mutate(resources, T.IAM_ROLE_POLICY, widen(statement), "management-ui-role")
    assert [(p, n) for p, n, _ in found(bad, cfg)] == [("management-ui-least-privilege", "management-ui-role")]


def test_a_cluster_wide_binding_or_a_wildcard_in_the_ui_role_fails(prod):
    cfg, resources = prod
    binding = copy.deepcopy(
        next(r for r in resources if r["type"] == T.ROLE_BINDING and r["name"].endswith("team-research"))
    )
    binding.update(type=T.CLUSTER_ROLE_BINDING, name="ui-everywhere", urn=binding["urn"] + "-everywhere")
    binding["inputs"]["metadata"].pop("namespace")
    assert [(p, n) for p, n, _ in found([*resources, binding], cfg)] == [
        ("management-ui-least-privilege", "ui-everywhere")
    ]
    wildcard = mutate(
        resources,
        T.CLUSTER_ROLE,
        lambda i: i["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}),
        "workload-management-ui-role",
    )
    assert [(p, n) for p, n, _ in found(wildcard, cfg)] == [
        ("management-ui-least-privilege", "workload-management-ui-role")
    ]
    # the nodes page's cluster-wide role lists the nodes and nothing more: a get of the pods everywhere fails
    wider = mutate(
        resources,
        T.CLUSTER_ROLE,
        lambda i: i["rules"].append({"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}),
        "workload-management-ui-nodes-role",
    )
    assert [(p, n, "more than listing the nodes" in m) for p, n, m in found(wider, cfg)] == [
        ("management-ui-least-privilege", "workload-management-ui-nodes-role", True)
    ]


@pytest.mark.parametrize(
    ("cidrs", "value", "words"),
    [
        (["0.0.0.0/0"], "0.0.0.0/0", "whole internet"),
        (["::/0"], "::/0", "whole internet"),
        (["10.8.0.0/33"], "10.8.0.0/33", "not a valid CIDR"),
    ],
)
def test_config_refuses_an_open_or_bad_range_naming_field_and_value(cidrs, value, words):
    data = copy.deepcopy(load_stack("prod", ROOT).to_mapping())
    data["management"]["allowedCidrs"] = cidrs
    with pytest.raises(ConfigError) as e:
        from_mapping(data, "prod variant")
    [issue] = e.value.issues
    assert issue.path == "supernode:management.allowedCidrs[0]" and issue.value == value and words in issue.message


def test_config_refuses_the_page_without_ranges_or_teams():
    data = copy.deepcopy(load_stack("prod", ROOT).to_mapping())
    data["management"]["allowedCidrs"] = []
    data.pop("teams")
    with pytest.raises(ConfigError) as e:
        from_mapping(data, "prod variant")
    assert sorted(i.path for i in e.value.issues) == ["supernode:management.allowedCidrs", "supernode:teams"]
