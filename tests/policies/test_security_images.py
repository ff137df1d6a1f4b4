"""Image policies (issue 19): every container image pinned by digest, none the placeholder digest;
advisory in a dev stack (images.requireDigests false), mandatory in prod and by default."""

from __future__ import annotations

import pytest
from policy_resources import ROOT, built_images, mutate, res

from supernode.core import resource_types as T
from supernode.core.config import load_stack
from supernode.core.config.schema import PLACEHOLDER_DIGEST
from supernode.policies.security import IMAGE_POLICIES
from supernode.tools.policycheck import check, config_from_stack
from supernode.tools.preview import run_program

DCGM = "dcgm-exporter"


def _container(i: dict) -> dict:
    return i["spec"]["template"]["spec"]["containers"][0]


def findings(resources: list[dict], config: dict | None = None) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for v in check(resources, config).violations:
        out.setdefault(v.policy, set()).add(v.enforcement)
    return out


def test_an_addon_by_tag_fails_image_digests(stack):
    bad = mutate(stack, T.DAEMON_SET, lambda i: _container(i).update(image="nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3"))
    found = check(bad).violations
    assert [(v.policy, v.enforcement) for v in found] == [("image-digests", "mandatory")]
    assert "dcgm-exporter:4.2.3" in found[0].message and "supernode:images.addons" in found[0].message


def test_an_init_container_by_tag_is_found_too(stack):
    bad = mutate(
        stack,
        T.DAEMON_SET,
        lambda i: i["spec"]["template"]["spec"].update(
            initContainers=[{"name": "init", "image": "busybox:1.36", "resources": _container(i)["resources"]}]
        ),
    )
    assert findings(bad) == {"image-digests": {"mandatory"}}


def test_the_placeholder_digest_fails_image_placeholder(stack):
    def placeholder(i: dict) -> None:
        c = i["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        c["image"] = c["image"].split("@")[0] + "@" + PLACEHOLDER_DIGEST

    found = check(mutate(stack, T.PYTORCH_JOB, placeholder)).violations
    assert {v.policy for v in found} >= {"image-placeholder"}
    v = next(v for v in found if v.policy == "image-placeholder")
    assert v.enforcement == "mandatory" and "make image" in v.message and PLACEHOLDER_DIGEST in v.message


@pytest.mark.parametrize("stack_name,level", [("dev", "advisory"), ("prod", "mandatory")])
def test_the_stack_sets_the_level(stack_name, level):
    cfg = load_stack(stack_name, ROOT)
    assert cfg.images.require_digests is (stack_name == "prod")
    conf = config_from_stack(cfg)
    assert {name: conf[name] for name in IMAGE_POLICIES} == {
        name: {"enforcementLevel": level} for name in IMAGE_POLICIES
    }


@pytest.mark.slow  # runs the program under the mock engine
@pytest.mark.parametrize("stack_name,level", [("dev", "advisory"), ("prod", "mandatory")])
def test_the_repositorys_stacks_warn_in_dev_and_fail_in_prod(stack_name, level):
    """Both stack files carry the placeholder trainer digest and run the add-ons by tag."""
    cfg = load_stack(stack_name, ROOT)
    assert cfg.images.trainer.endswith("@" + PLACEHOLDER_DIGEST)
    report = check([r.to_json() for r in run_program(stack_name, cfg).resources], config_from_stack(cfg))
    by_policy = {}
    for v in report.violations:
        by_policy.setdefault(v.policy, []).append(v)
    assert set(by_policy) == set(IMAGE_POLICIES)
    assert {v.enforcement for vs in by_policy.values() for v in vs} == {level}
    # the add-on workloads, by tag: both device plugins, DCGM, the training operator, the Kueue controller,
    # the CloudWatch agent's Prometheus scrape, serving's Prometheus and adapter; and in prod, whose serving
    # replicas span two nodes, the LeaderWorkerSet controller
    spans_nodes = stack_name == "prod"
    assert len(by_policy["image-digests"]) == 8 + spans_nodes
    assert any("lws" in v.urn for v in by_policy["image-digests"]) is spans_nodes
    # every workload of the trainer image (job, gate, scheduled fabric check, restore drill, checkpoint
    # retention, inventory, node health agent, the queue-wait and serving SLO relays) and
    # vLLM's server and weight check: CronJobs and init containers included
    assert {v.urn.rsplit("::", 1)[-1] for v in by_policy["image-placeholder"]} == {
        "workload-trainer-job",
        "workload-gate-job",
        "workload-ops-fabric-check",
        "workload-ops-restore-drill",
        "workload-ops-checkpoint-retention",
        "workload-queue-metrics-relay",
        "workload-serving-deployment-prometheus",  # the serving SLO relay beside serving's Prometheus
        "workload-ops-inventory",
        "workload-ops-node-health",
        "workload-serving-server",
        *(["workload-management-ui-deploy"] if stack_name == "prod" else []),  # the page in the cluster
    }
    assert report.passed is (level == "advisory")


@pytest.mark.slow
def test_prod_with_built_images_passes():
    cfg = built_images(load_stack("prod", ROOT))
    result = run_program("prod", cfg)
    report = check([r.to_json() for r in result.resources], config_from_stack(cfg))
    assert report.violations == [] and report.passed
    ds = next(r for r in result.resources if r.type == T.DAEMON_SET and r.inputs["metadata"]["name"] == DCGM)
    assert _container(ds.inputs)["image"] == cfg.images.addons[DCGM]  # the config's digest reaches the add-on


def test_a_trainer_digest_from_a_repository_the_stack_does_not_create_is_caught(stack, dev_cfg):
    """Issue 30 #15: gb200/b300 carried a real-looking digest in `supernode-trainer`, a repository no
    stack creates; the placeholder policy passed it. Only the stack's own ECR repository counts."""
    own = dev_cfg.images.trainer.split("@")[0].split("/", 1)[1]  # the repository the fixture's image names
    assert check([*stack, res(T.ECR_REPOSITORY, "trainer", {"name": own})]).violations == []
    found = check([*stack, res(T.ECR_REPOSITORY, "trainer", {"name": "supernode-other-trainer"})]).violations
    assert [(v.policy, v.enforcement) for v in found] == [("image-placeholder", "mandatory")]
    assert f"from repository '{own}', which this stack does not create" in found[0].message


@pytest.mark.parametrize("stack_name", ["dev", "prod", "gb200", "b300"])
def test_every_stack_file_names_its_own_trainer_repository(stack_name):
    from supernode.components.aws.registry import repository_name

    cfg = load_stack(stack_name, ROOT)
    assert cfg.images.trainer.split("@")[0].endswith("/" + repository_name(stack_name))
