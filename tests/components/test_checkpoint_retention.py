"""Run identities and retention in the cluster (issue 28): the trainer job trains into the stack's run
(`training.run`, else the stack's name); `supernode checkpoints --retain` runs on a schedule as its own
service account, whose IRSA role lists the checkpoint prefix, reads the markers and run.json files and
reads and writes object tags there, nothing more; the policy pack accepts that role and rejects a wider
one; an s3:// initFrom in another bucket is readable by the trainer role on exactly its prefix."""

from __future__ import annotations

import json
from fnmatch import fnmatchcase

import pytest
from aws_preview import ROOT, Stack, as_list, policy, preview, statements

from supernode.components.aws.identity import pretrained_statements
from supernode.components.k8s.common import MESH_LABEL
from supernode.components.k8s.operations import RETENTION_SA
from supernode.core import resource_types as T
from supernode.core.config import from_mapping, load_stack
from supernode.core.errors import ConfigError
from supernode.core.observability import PROFILE_EVERY
from supernode.tools import manifests as mf
from supernode.tools.policycheck import check
from supernode.trainer.train import build_parser as train_parser

ROOT_STACK = "dev"
RETENTION = "checkpoint-retention-role"
ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:GetObjectTagging", "s3:PutObjectTagging")


def allowed(doc: dict, action: str, resource: str) -> bool:
    return any(
        s["Effect"] == "Allow"
        and action in as_list(s["Action"])
        and any(fnmatchcase(resource, pattern) for pattern in as_list(s["Resource"]))
        for s in statements(doc)
    )


def objects(stack: Stack) -> dict[tuple[str, str], dict]:
    return {(m["kind"], m["metadata"]["name"]): m for m in mf.from_resources(stack.result.resources)}


def test_the_retention_role_lists_reads_markers_and_tags_the_checkpoint_prefix_only(stack: Stack):
    doc = policy(stack.one(T.IAM_ROLE_POLICY, RETENTION))
    bucket = f"arn:aws:s3:::{stack.outputs['bucket_name']}"
    ck, ds = stack.cfg.storage.checkpoint_prefix, stack.cfg.storage.dataset_prefix
    step = f"{bucket}/{ck}runs/base/checkpoints/step_00000040"
    assert allowed(doc, "s3:GetObjectTagging", f"{step}/__0_0.distcp")
    assert allowed(doc, "s3:PutObjectTagging", f"{step}/__0_0.distcp")
    assert allowed(doc, "s3:GetObject", f"{step}/COMPLETE")
    assert allowed(doc, "s3:GetObject", f"{bucket}/{ck}runs/base/run.json")
    # the weights themselves: neither read, written nor deleted (the lifecycle rules expire)
    assert not any(allowed(doc, a, f"{step}/__0_0.distcp") for a in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"))
    for elsewhere in (f"{bucket}/{ds}shard-0.bin", f"{bucket}/logs/x", "arn:aws:s3:::another-bucket/checkpoints/x"):
        assert not any(allowed(doc, a, elsewhere) for a in ACTIONS), elsewhere
    by_sid = {s["Sid"]: s for s in statements(doc)}
    assert sorted(a for s in statements(doc) for a in as_list(s["Action"])) == [
        "kms:Decrypt",
        "s3:GetObject",
        "s3:GetObjectTagging",
        "s3:ListBucket",
        "s3:PutObjectTagging",
    ]
    listing = by_sid["ListCheckpoints"]
    assert listing["Resource"] == bucket and listing["Condition"]["StringLike"]["s3:prefix"] == [ck, f"{ck}*"]
    kms = by_sid["DecryptMarkersThroughS3"]
    assert kms["Resource"] == stack.outputs["kms_key_arns"]["data"]
    assert kms["Condition"] == {"StringEquals": {"kms:ViaService": f"s3.{stack.cfg.region}.amazonaws.com"}}
    (trust,) = statements(policy(stack.one(T.IAM_ROLE, RETENTION), "assumeRolePolicy"))
    assert list(trust["Condition"]["StringEquals"].values())[0] == (
        f"system:serviceaccount:{stack.cfg.workload.namespace}:{RETENTION_SA}"
    )


def _iam_findings(resource: dict, statement: dict) -> list[str]:
    changed = json.loads(json.dumps(resource))
    changed["inputs"]["policy"] = json.dumps({"Version": "2012-10-17", "Statement": [statement]})
    return [v.message for v in check([changed]).violations if v.policy == "iam-no-wildcards"]


def test_the_policy_pack_accepts_the_role_and_rejects_a_wider_grant(stack: Stack):
    (resource,) = [r.to_json() for r in stack.all(T.IAM_ROLE_POLICY) if r.name == RETENTION]
    assert [v.message for v in check([resource]).violations if v.policy == "iam-no-wildcards"] == []
    bucket = f"arn:aws:s3:::{stack.outputs['bucket_name']}"
    wider = {
        "the whole bucket": {"Effect": "Allow", "Action": "s3:PutObjectTagging", "Resource": f"{bucket}/*"},
        "every bucket listed": {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "*"},
        "any resource": {"Effect": "Allow", "Action": ["s3:PutObjectTagging"], "Resource": "*"},
        "a wildcard action": {"Effect": "Allow", "Action": "s3:*Tagging", "Resource": f"{bucket}/checkpoints/*"},
    }
    for what, statement in wider.items():
        found = _iam_findings(resource, statement)
        assert len(found) == 1 and RETENTION in found[0], (what, found)
    # the same prefix-scoped grant, which the role has, passes
    scoped = {"Effect": "Allow", "Action": "s3:PutObjectTagging", "Resource": f"{bucket}/checkpoints/*"}
    assert _iam_findings(resource, scoped) == []


@pytest.mark.slow
def test_the_retention_cronjob_runs_retain_as_its_own_service_account():
    s = preview(ROOT_STACK)
    found = objects(s)
    cron = found[("CronJob", f"{ROOT_STACK}-checkpoint-retention")]
    assert cron["spec"]["schedule"] == s.cfg.workload.checkpoint_retention_schedule
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    argv = c["command"] + c["args"]
    assert argv[:2] == ["supernode", "checkpoints"] and "--retain" in argv and "--json" in argv
    assert argv[argv.index("--bucket") + 1] == "$(BUCKET)"
    assert {e["name"]: e["value"] for e in c["env"]} == {"BUCKET": s.outputs["bucket_name"]}
    sa = found[("ServiceAccount", RETENTION_SA)]
    assert pod["serviceAccountName"] == RETENTION_SA != s.cfg.workload.service_account  # not the trainer's
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == s.one(T.IAM_ROLE, RETENTION).outputs["arn"]
    assert cron["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"] == {
        MESH_LABEL: "checkpoint-retention"
    }  # the namespace's HTTPS egress (S3, STS)
    assert [v["configMap"]["name"] for v in pod["volumes"]] == ["supernode-stack"]  # no FSx, no GPU
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    # the command line is one the CLI accepts
    from supernode.cli import build_parser

    args = build_parser().parse_args(argv[1:])
    assert args.retain and args.bucket == "$(BUCKET)" and not args.dry_run
    assert mf.validate([cron, sa], s.cfg.cluster.kubernetes_version) == []


@pytest.mark.slow
@pytest.mark.parametrize("run", [None, "continued-pretraining"])
def test_the_trainer_job_trains_into_the_stacks_run(run):
    def change(data: dict) -> None:
        if run:
            data["training"]["run"] = run

    s = preview(ROOT_STACK, f"run-{run}", change)
    job = objects(s)[("PyTorchJob", f"{ROOT_STACK}-train")]
    (c,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--run-id") + 1] == (run or ROOT_STACK)
    # metrics every step, Kineto on a sample only (issue 39: it profiled every step)
    args = train_parser().parse_args(c["args"])
    assert (args.log_every, args.profile_every) == (1, PROFILE_EVERY) and PROFILE_EVERY > 1


@pytest.mark.parametrize("value, message", [("new", "'new' is the word"), ("a/b", "should match pattern")])
def test_training_run_is_a_run_name(value, message):
    data = load_stack(ROOT_STACK, ROOT).to_mapping()
    data["training"]["run"] = value
    with pytest.raises(ConfigError) as e:
        from_mapping(data)
    assert str(e.value).startswith("supernode:training.run: ") and message in str(e.value)
    assert f"(got '{value}')" in str(e.value)


# -- initFrom in another bucket -------------------------------------------------------------------


def test_an_s3_init_from_elsewhere_is_readable_on_exactly_its_prefix():
    def change(data: dict) -> None:
        data["training"].update(initFrom="s3://models-bucket/qwen3-moe/v1", initFromSha256="ab" * 32)

    s = preview(ROOT_STACK, "init-from-elsewhere", change)
    doc = policy(s.one(T.IAM_ROLE_POLICY, "trainer-role-data"))
    assert allowed(doc, "s3:GetObject", "arn:aws:s3:::models-bucket/qwen3-moe/v1/model-00001.safetensors")
    for outside in (
        "arn:aws:s3:::models-bucket/qwen3-moe/v2/x",
        "arn:aws:s3:::models-bucket/other",
        "arn:aws:s3:::x/y",
    ):
        assert not allowed(doc, "s3:GetObject", outside), outside
    assert not any(
        allowed(doc, a, "arn:aws:s3:::models-bucket/qwen3-moe/v1/x") for a in ("s3:PutObject", "s3:DeleteObject")
    )
    (listing,) = [st for st in statements(doc) if st.get("Sid") == "ListPretrained"]
    assert listing["Resource"] == "arn:aws:s3:::models-bucket"
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["qwen3-moe/v1/", "qwen3-moe/v1/*"]}}
    resource = next(r.to_json() for r in s.all(T.IAM_ROLE_POLICY) if r.name == "trainer-role-data")
    assert [v.message for v in check([resource]).violations if v.policy == "iam-no-wildcards"] == []
    # without initFrom (or with a path) the role reads no other bucket
    plain = policy(preview(ROOT_STACK).one(T.IAM_ROLE_POLICY, "trainer-role-data"))
    assert not [st for st in statements(plain) if st.get("Sid") in ("ListPretrained", "ReadPretrained")]
    assert pretrained_statements("/fsx/models/qwen3-moe") == []
