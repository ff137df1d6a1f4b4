"""Checklist item 10, access control and keys: least-privilege IAM, encrypted and private storage,
a private EKS API, IMDSv2 out of pods' reach, rotated KMS keys, no ingress from the internet, and the
containers the stack deploys: images pinned by digest (never the placeholder), CPU and memory bounded.

Two remediations, both safe because they only tighten a setting and never change what a workload
can reach inside the VPC: IMDSv2 on launch templates and an all-true S3 public-access block. They
apply only where the Pulumi CLI runs the pack on an update; every check the project runs sets them
mandatory (`REMEDIATING_POLICIES`), so a weakened setting fails a PR instead of passing "fixed".
"""

from __future__ import annotations

import re
from typing import Any

from pulumi_policy import EnforcementLevel

from supernode.core import resource_types
from supernode.core.config import DIGEST_RE
from supernode.core.config.schema import PLACEHOLDER_DIGEST
from supernode.core.resource_types import (
    ACCESS_ENTRY,
    BUCKET,
    BUCKET_ACL,
    BUCKET_ACL_V2,
    BUCKET_LOGGING,
    BUCKET_PAB,
    BUCKET_POLICY,
    BUCKET_SSE,
    CRON_JOB,
    DAEMON_SET,
    DEPLOYMENT,
    ECR_REPOSITORY,
    EKS_CLUSTER,
    IAM_GROUP_POLICY,
    IAM_POLICY,
    IAM_ROLE,
    IAM_ROLE_POLICY,
    IAM_USER_POLICY,
    K8S_JOB,
    KMS_KEY,
    KMS_KEY_POLICY,
    LAUNCH_TEMPLATE,
    LEADER_WORKER_SET,
    POD,
    PYTORCH_JOB,
    SECURITY_GROUP,
    SG_INGRESS,
    SG_RULE,
    SNS_TOPIC_POLICY,
    STATEFUL_SET,
)

from .base import Registry, Report
from .view import OPEN_CIDRS, Res, Stack, as_list, containers, get, is_true, items, json_doc, plain, statements

POLICIES = Registry()

REMEDIATE = EnforcementLevel.REMEDIATE
PAB_FLAGS = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
# `*` resources are allowed only for read-only calls that AWS offers no resource-level permission for.
# Condition keys that confine an Allow to known accounts, networks or callers: AWS's own evaluation
# of "public" (S3 Block Public Access) does not count a statement confined by one of them.
CONFINING_KEYS = (
    "aws:sourcevpce",
    "aws:sourcevpc",
    "aws:principalorgid",
    "aws:principalaccount",
    "aws:principalarn",
    "aws:sourceaccount",
    "aws:sourcearn",
    "aws:sourceowner",
    "aws:userid",
)
PUBLIC_ACLS = ("public-read", "public-read-write", "authenticated-read")
PUBLIC_GRANTEES = (
    "http://acs.amazonaws.com/groups/global/AllUsers",
    "http://acs.amazonaws.com/groups/global/AuthenticatedUsers",
)
# What the pack has been reviewed against (see supernode/core/resource_types.py).
REVIEWED_AWS_TYPES = frozenset(v for v in vars(resource_types).values() if isinstance(v, str) and v.startswith("aws:"))
READ_ONLY_VERBS = ("Describe", "List")
NO_RESOURCE_LEVEL = {"sts:GetCallerIdentity", "ecr:GetAuthorizationToken"}
# s3:ListBucket names its bucket (listing every bucket's keys is not a read-only Describe call), and an
# identity policy's S3 object writes and tag changes name a prefix, never a whole bucket (`arn:aws:s3:::B/*`):
# each workload writes under its own prefix (checkpoints, baselines, weights). Bucket policies are exempt:
# a service principal's grant (S3 server access logs) is the bucket's whole.
IDENTITY_POLICY_TYPES = (IAM_ROLE, IAM_ROLE_POLICY, IAM_POLICY, IAM_USER_POLICY, IAM_GROUP_POLICY)
S3_WRITE_VERBS = ("put", "delete", "abort", "restore", "replicate")
WHOLE_BUCKET = re.compile(r"^arn:aws:s3:::[^/*]+/\*$")


# -- IAM ------------------------------------------------------------------------------------------


def _documents(res: Res) -> list[tuple[str, dict | None]]:
    if res.type == IAM_ROLE:
        return [
            (f"inline policy '{get(p, 'name')}'", json_doc(get(p, "policy"))) for p in items(res.get("inlinePolicies"))
        ]
    return [("policy", json_doc(res.get("policy")))]


def _read_only(action: str) -> bool:
    verb = action.split(":", 1)[-1]
    return action in NO_RESOURCE_LEVEL or (verb.startswith(READ_ONLY_VERBS) and "*" not in action.split(":", 1)[0])


@POLICIES.resource(
    "iam-no-wildcards",
    10,
    "IAM documents allow no wildcard actions and no '*' resource beyond read-only calls; identity "
    "policies write S3 under a prefix, never a whole bucket.",
    (
        IAM_ROLE,
        IAM_ROLE_POLICY,
        IAM_POLICY,
        IAM_USER_POLICY,
        IAM_GROUP_POLICY,
        BUCKET_POLICY,
        KMS_KEY,
        KMS_KEY_POLICY,
        SNS_TOPIC_POLICY,
    ),
)
def _iam(res: Res, _conf: None, report: Report) -> None:
    for where, doc in _documents(res):
        for i, st in enumerate(statements(doc)):
            if st.get("Effect") != "Allow":
                continue  # a Deny with s3:* (e.g. TLS-only) only narrows access
            actions = [str(a) for a in as_list(st.get("Action"))]
            wild = [a for a in actions if "*" in a] + (["NotAction"] if "NotAction" in st else [])
            if wild:
                report(
                    res,
                    f"{res.label} {where} statement {i} allows wildcard actions {wild}. Fix: list the exact "
                    f"actions the workload calls.",
                )
            if res.type in (KMS_KEY, KMS_KEY_POLICY):
                continue  # in a key policy, Resource '*' means the key itself
            resources = [str(r) for r in as_list(st.get("Resource"))] + (["NotResource"] if "NotResource" in st else [])
            if any(r in ("*", "NotResource") for r in resources) and not all(
                _read_only(a) and a.lower() != "s3:listbucket" for a in actions if "*" not in a
            ):
                report(
                    res,
                    f"{res.label} {where} statement {i} grants {actions} on Resource '*'; only read-only "
                    f"Describe/List calls without resource-level permissions may. Fix: name the ARNs.",
                )
            writes = [a for a in actions if a.lower().startswith(tuple(f"s3:{v}" for v in S3_WRITE_VERBS))]
            whole = [r for r in resources if WHOLE_BUCKET.fullmatch(r)]
            if res.type in IDENTITY_POLICY_TYPES and writes and whole:
                report(
                    res,
                    f"{res.label} {where} statement {i} grants {writes} on the whole bucket {whole}. Fix: name "
                    f"the prefix the workload writes (arn:aws:s3:::BUCKET/PREFIX*).",
                )


# -- S3 -------------------------------------------------------------------------------------------


def bucket_name(stack: Stack, bucket: Res) -> str | None:
    """The bucket's name: its own `bucket` input, else what its configuration resources call it."""
    if bucket.get("bucket"):
        return bucket.get("bucket")
    names = {r.get("bucket") for r in stack.resources if r.deps == [bucket.urn] and r.get("bucket")}
    return names.pop() if len(names) == 1 else None


@POLICIES.stack("s3-kms-encryption", 10, "S3 buckets are encrypted with KMS.")
def _s3_kms(stack: Stack, _conf: None, report: Report) -> None:
    # S3 server access logging delivers only to SSE-S3 buckets (AWS does not support SSE-KMS there).
    log_targets = {r.get("targetBucket") for r in stack.of(BUCKET_LOGGING)}
    for b in stack.of(BUCKET):
        algos = [
            get(r, "applyServerSideEncryptionByDefault", "sseAlgorithm")
            for c in stack.attached(b, (BUCKET_SSE,))
            for r in items(c.get("rules"))
        ]
        accepted = ("aws:kms", "AES256") if bucket_name(stack, b) in log_targets else ("aws:kms",)
        if not any(str(a).startswith(accepted) for a in algos):
            report(
                b,
                f"{b.label} is not encrypted with KMS (default encryption: {algos or 'none'}). Fix: add an "
                f"aws.s3.BucketServerSideEncryptionConfiguration with sseAlgorithm 'aws:kms' and the stack's key.",
            )


@POLICIES.stack("s3-public-access-block-attached", 10, "Every S3 bucket has a public-access block.")
def _pab_attached(stack: Stack, _conf: None, report: Report) -> None:
    for b in stack.of(BUCKET):
        if not stack.attached(b, (BUCKET_PAB,)):
            report(
                b,
                f"{b.label} has no public-access block, so a bucket policy or ACL could make it public. Fix: add "
                f"an aws.s3.BucketPublicAccessBlock with all four flags true.",
            )


def _pab_fix(res: Res) -> dict[str, Any] | None:
    if all(is_true(res.get(f)) for f in PAB_FLAGS):
        return None
    return {**plain(res.props), **{f: True for f in PAB_FLAGS}}


@POLICIES.resource(
    "s3-public-access-block",
    10,
    "S3 public-access blocks set all four flags.",
    (BUCKET_PAB,),
    level=REMEDIATE,
    remediate=_pab_fix,
)
def _pab(res: Res, _conf: None, report: Report) -> None:
    off = [f for f in PAB_FLAGS if not is_true(res.get(f))]
    if off:
        report(res, f"{res.label} leaves {off} off. Fix: set all of {', '.join(PAB_FLAGS)} to true.")


def _anyone(st: dict) -> bool:
    """The statement's principal is everyone: "*", {"AWS": "*"}, or a NotPrincipal (all but some)."""
    principal = st.get("Principal")
    aws = principal.get("AWS") if isinstance(principal, dict) else None
    return "NotPrincipal" in st or principal == "*" or "*" in [str(a) for a in as_list(aws)]


def _confined(st: dict) -> bool:
    condition = st.get("Condition")
    keys = {k.lower() for op in (condition or {}).values() if isinstance(op, dict) for k in op}
    return isinstance(condition, dict) and bool(keys & set(CONFINING_KEYS))


@POLICIES.resource(
    "s3-no-public-policy",
    10,
    "No bucket policy allows anyone (Principal '*') without a condition confining it.",
    (BUCKET_POLICY,),
)
def _public_policy(res: Res, _conf: None, report: Report) -> None:
    for i, st in enumerate(statements(json_doc(res.get("policy")))):
        if st.get("Effect") == "Allow" and _anyone(st) and not _confined(st):
            report(
                res,
                f"{res.label} statement {i} allows {as_list(st.get('Action'))} to anyone (Principal "
                f"{st.get('Principal', 'NotPrincipal')!r}, no condition confining it to an account, VPC or "
                f"organisation): the bucket is public. Fix: name the principals (the stack's roles).",
            )


@POLICIES.resource(
    "s3-no-public-acl",
    10,
    "No bucket ACL grants access to all or all authenticated AWS users.",
    (BUCKET, BUCKET_ACL, BUCKET_ACL_V2),
)
def _public_acl(res: Res, _conf: None, report: Report) -> None:
    acl = res.get("acl")
    grants = items(res.get("grants")) + items(res.get("accessControlPolicy", "grants"))
    grantees = [str(g) for g in (get(x, "uri") or get(x, "grantee", "uri") for x in grants) if g]
    public = ([f"acl {acl!r}"] if str(acl) in PUBLIC_ACLS else []) + [
        f"a grant to {g.rsplit('/', 1)[-1]}" for g in grantees if g in PUBLIC_GRANTEES
    ]
    if public:
        report(
            res,
            f"{res.label} makes objects public with {', '.join(public)}. Fix: drop the ACL (bucket owner "
            f"enforced ownership) and grant access by IAM to the stack's roles.",
        )


@POLICIES.stack("s3-tls-only", 10, "S3 buckets deny non-TLS requests.")
def _tls_only(stack: Stack, _conf: None, report: Report) -> None:
    for b in stack.of(BUCKET):
        denies = [
            st
            for p in stack.attached(b, (BUCKET_POLICY,))
            for st in statements(json_doc(p.get("policy")))
            if st.get("Effect") == "Deny"
            and str(get(st, "Condition", "Bool", "aws:SecureTransport")).lower() == "false"
        ]
        if not denies:
            report(
                b,
                f"{b.label} accepts plain-HTTP requests: no bucket policy denies aws:SecureTransport false. Fix: "
                f"add a Deny s3:* statement with Condition Bool aws:SecureTransport 'false'.",
            )


# -- EKS, EC2, KMS, network -----------------------------------------------------------------------


@POLICIES.resource("eks-secrets-encryption", 10, "EKS encrypts secrets with KMS.", (EKS_CLUSTER,))
def _eks_secrets(res: Res, _conf: None, report: Report) -> None:
    configs = items(res.get("encryptionConfig")) or (
        [res.get("encryptionConfig")] if res.get("encryptionConfig") else []
    )
    if not any("secrets" in items(get(c, "resources")) and get(c, "provider", "keyArn") for c in configs):
        report(
            res,
            f"{res.label} does not encrypt Kubernetes secrets with KMS. Fix: set encryptionConfig "
            f"{{resources: ['secrets'], provider: {{keyArn: <KMS key ARN>}}}}.",
        )


@POLICIES.resource("eks-endpoint-restricted", 10, "The EKS API endpoint is not open to 0.0.0.0/0.", (EKS_CLUSTER,))
def _eks_endpoint(res: Res, _conf: None, report: Report) -> None:
    public = res.get("vpcConfig", "endpointPublicAccess")
    cidrs = [str(c) for c in items(res.get("vpcConfig", "publicAccessCidrs"))]
    if public is False:
        return
    if not cidrs or any(c in OPEN_CIDRS for c in cidrs):
        report(
            res,
            f"{res.label} exposes its API endpoint to the internet (endpointPublicAccess "
            f"{'unset (AWS default: public)' if public is None else public}, publicAccessCidrs "
            f"{cidrs or 'unset = 0.0.0.0/0'}). Fix: endpointPublicAccess false, or list the allowed CIDRs "
            f"(supernode:cluster.publicAccessCidrs).",
        )


def _imdsv2_fix(res: Res) -> dict[str, Any] | None:
    if res.get("metadataOptions", "httpTokens") == "required":
        return None
    props = plain(res.props)
    props["metadataOptions"] = {**(props.get("metadataOptions") or {}), "httpTokens": "required"}
    return props


@POLICIES.resource(
    "ec2-imdsv2", 10, "Launch templates require IMDSv2.", (LAUNCH_TEMPLATE,), level=REMEDIATE, remediate=_imdsv2_fix
)
def _imdsv2(res: Res, _conf: None, report: Report) -> None:
    if res.get("metadataOptions", "httpTokens") != "required":
        report(
            res,
            f"{res.label} allows IMDSv1 (metadataOptions.httpTokens "
            f"{res.get('metadataOptions', 'httpTokens')!r}), which SSRF can use to steal node credentials. "
            f"Fix: metadataOptions {{httpTokens: 'required', httpPutResponseHopLimit: 1}}.",
        )


@POLICIES.resource(
    "ec2-imds-hop-limit", 10, "Launch templates keep IMDS answers on the node (hop limit 1).", (LAUNCH_TEMPLATE,)
)
def _imds_hop_limit(res: Res, _conf: None, report: Report) -> None:
    hops = res.get("metadataOptions", "httpPutResponseHopLimit")
    if hops != 1:
        report(
            res,
            f"{res.label} lets IMDS answers travel {hops if hops is not None else 'the default number of'} "
            f"hops, so a pod in its own network namespace can take the node role's credentials. Fix: "
            f"metadataOptions.httpPutResponseHopLimit 1, and give pods that call AWS an IRSA or Pod Identity "
            f"role.",
        )


@POLICIES.resource(
    "eks-access-entries",
    10,
    "EKS access entries map a role to Kubernetes groups only: no access policy, no system: group.",
    (ACCESS_ENTRY,),
)
def _access_entry(res: Res, _conf: None, report: Report) -> None:
    """A team's access entry gives its role exactly the RBAC bound to its group (its own namespace): type
    STANDARD with groups, never a system: group (system:masters is cluster-admin, bypassing RBAC)."""
    groups = [str(g) for g in items(res.get("kubernetesGroups"))]
    system = [g for g in groups if g.startswith("system:")]
    if system:
        report(
            res,
            f"{res.label} maps {res.get('principalArn')} to {system}: a system: group is granted by Kubernetes "
            "itself (system:masters bypasses RBAC). Fix: map it to the team's group (supernode:team:<name>).",
        )
    if res.get("type", default="STANDARD") != "STANDARD":
        report(
            res,
            f"{res.label} is of type {res.get('type')!r}: only a STANDARD entry takes its rights from RBAC alone. "
            "Fix: type STANDARD.",
        )
    if not groups:
        report(
            res,
            f"{res.label} names no Kubernetes group: its role would reach the cluster with nothing bound, or "
            "through an access policy nothing here reads. Fix: kubernetesGroups [supernode:team:<name>].",
        )


@POLICIES.resource("kms-key-rotation", 10, "KMS keys rotate.", (KMS_KEY,))
def _kms_rotation(res: Res, _conf: None, report: Report) -> None:
    spec = res.get("customerMasterKeySpec") or res.get("keySpec") or "SYMMETRIC_DEFAULT"
    if spec == "SYMMETRIC_DEFAULT" and not is_true(res.get("enableKeyRotation")):
        report(
            res,
            f"{res.label} does not rotate its key material. Fix: enableKeyRotation true "
            f"(supernode:identity.kmsKeyRotation).",
        )


@POLICIES.resource(
    "no-open-ingress",
    10,
    "No security group allows ingress from 0.0.0.0/0 or ::/0.",
    (SECURITY_GROUP, SG_RULE, SG_INGRESS),
)
def _open_ingress(res: Res, _conf: None, report: Report) -> None:
    if res.type == SECURITY_GROUP:
        rules = [(r, items(get(r, "cidrBlocks")) + items(get(r, "ipv6CidrBlocks"))) for r in items(res.get("ingress"))]
    elif res.type == SG_RULE:
        if res.get("type") != "ingress":
            return
        rules = [(res.props, items(res.get("cidrBlocks")) + items(res.get("ipv6CidrBlocks")))]
    else:
        rules = [(res.props, [res.get("cidrIpv4"), res.get("cidrIpv6")])]
    for rule, cidrs in rules:
        open_ = [c for c in cidrs if c in OPEN_CIDRS]
        if open_:
            port = get(rule, "fromPort", default="all")
            report(
                res,
                f"{res.label} allows ingress from {open_} (port {port}). Fix: restrict the source to the VPC "
                f"or a named security group; reach nodes through SSM, not the internet.",
            )


# -- containers the stack deploys ------------------------------------------------------------------

WORKLOADS = (POD, K8S_JOB, CRON_JOB, DAEMON_SET, DEPLOYMENT, STATEFUL_SET, PYTORCH_JOB, LEADER_WORKER_SET)
BOUNDED = ("cpu", "memory")


def _all_containers(stack: Stack) -> list[tuple[Res, Any]]:
    return [(w, c) for w in stack.of(*WORKLOADS) for c in containers(w, init=True)]


# Both image policies are mandatory unless the stack says otherwise (supernode:images.requireDigests
# false, a dev stack: `supernode policy config` makes them advisory).
@POLICIES.stack("image-digests", 10, "Every container image the stack deploys is pinned by digest.")
def _image_digests(stack: Stack, _conf: None, report: Report) -> None:
    # The trainer job and the gate are the checklist's (images-pinned): not reported twice.
    jobs = {r.urn for r in stack.trainer_jobs() + stack.gates()}
    for w, c in _all_containers(stack):
        image = str(get(c, "image", default=""))
        if w.urn not in jobs and not DIGEST_RE.fullmatch(image):
            report(
                w,
                f"{w.label} container '{get(c, 'name')}' runs {image!r}, a tag that can be re-pointed. Fix: pin "
                f"it by digest in supernode:images.addons (`make addon-digests` prints the mapping).",
            )


def _repository(image: str) -> str:
    """`ACCOUNT.dkr.ecr.REGION.amazonaws.com/NAME[:TAG]@sha256:...` -> NAME: the path after the registry
    host (which may carry a port), less a tag."""
    path = image.split("@", 1)[0].partition("/")[2]
    return path.rsplit(":", 1)[0] if ":" in path.rsplit("/", 1)[-1] else path


# The fix for a placeholder: the trainer image is built here (`make image`); the serving pods run the
# vLLM release image named in inference.image, which nothing here builds.
_TRAINER_IMAGE_FIX = "`make image STACK=<stack>` and put the digest it prints in supernode:images.trainer."
_SERVING_IMAGE_FIX = (
    "pin the vLLM server image you run by digest in supernode:inference.image (`make image` builds only the "
    "trainer image; `docker buildx imagetools inspect vllm/vllm-openai:<version>` prints a release's digest)."
)


@POLICIES.stack(
    "image-placeholder",
    10,
    "No container runs the placeholder image digest; the trainer's comes from the stack's own repository.",
)
def _image_placeholder(stack: Stack, _conf: None, report: Report) -> None:
    for w, c in _all_containers(stack):
        image = str(get(c, "image", default=""))
        if image.endswith("@" + PLACEHOLDER_DIGEST):
            serving = w.get("metadata", "labels", "app.kubernetes.io/component") == "serving"
            report(
                w,
                f"{w.label} container '{get(c, 'name')}' runs the placeholder digest {image!r}: no such image "
                f"exists, so its pods never start. Fix: {_SERVING_IMAGE_FIX if serving else _TRAINER_IMAGE_FIX}",
            )
    # The trainer image is built into the stack's own ECR repository (`make image`): a digest in any
    # other repository is one this stack never pushed, however real it looks.
    own = {str(r.get("name")) for r in stack.of(ECR_REPOSITORY) if r.get("name")}
    if not own:
        return
    for w in stack.trainer_jobs():
        for c in containers(w, init=True):
            image = str(get(c, "image", default=""))
            if (
                DIGEST_RE.fullmatch(image)
                and not image.endswith("@" + PLACEHOLDER_DIGEST)
                and _repository(image) not in own
            ):
                report(
                    w,
                    f"{w.label} container '{get(c, 'name')}' runs {image!r}, from repository "
                    f"{_repository(image)!r}, which this stack does not create (its trainer repository: "
                    f"{', '.join(sorted(own))}): no `make image` of this stack pushed that digest. Fix: "
                    f"`make image STACK=<stack>` and put the line it prints in supernode:images.trainer.",
                )


@POLICIES.stack("container-resources", 10, "Every container sets CPU and memory requests and limits.")
def _container_resources(stack: Stack, _conf: None, report: Report) -> None:
    for w, c in _all_containers(stack):
        missing = [
            f"{kind}.{r}"
            for kind in ("requests", "limits")
            for r in BOUNDED
            if get(c, "resources", kind, r) in (None, "")
        ]
        if missing:
            report(
                w,
                f"{w.label} container '{get(c, 'name')}' sets no {', '.join(missing)}, so it can starve its "
                f"node's other pods. Fix: set CPU and memory requests and limits (add-ons: their file in "
                f"components/addons/).",
            )


IMAGE_POLICIES = ("image-digests", "image-placeholder")
# Remediated where the Pulumi CLI applies the pack to an update; a check (the offline preview, the
# PR check, a plain `pulumi up` without the pack) must fail instead: nothing else applies the fix.
REMEDIATING_POLICIES = ("s3-public-access-block", "ec2-imdsv2")


@POLICIES.stack("aws-types-reviewed", 10, "Every AWS resource is of a type the security policies read.")
def _aws_types_reviewed(stack: Stack, _conf: None, report: Report) -> None:
    for r in stack.resources:
        if r.type.startswith("aws:") and r.type not in REVIEWED_AWS_TYPES:
            report(
                r,
                f"{r.label} is of type {r.type}, which no security policy has been reviewed against: it could "
                f"open access that nothing here reads. Fix: check what it can grant, add a policy if it can, "
                f"and name the type in supernode/core/resource_types.py.",
            )
