"""Helpers for the policy tests: a hand-built, compliant stack in the `supernode preview --json` resources format.

Every checklist policy has something to check in it, and it passes with zero violations; each test
breaks one thing and expects exactly the policy that guards it. Built from the dev stack's config
and plan (nothing hard-coded that the catalog or planner decides).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supernode.core import resource_types as T
from supernode.core.catalog import CATALOG
from supernode.core.config import StackConfig, from_mapping
from supernode.core.plan import PLAN_MOUNT_DIR, PLAN_MOUNT_PATH, Plan
from supernode.core.pools import ROLE_LABEL

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = "123456789012"


def bounded() -> dict[str, dict[str, str]]:
    """CPU and memory requests and limits (container-resources), a fresh dict per container."""
    return {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}}


def urn(typ: str, name: str) -> str:
    return f"urn:pulumi:test::supernode::{typ}::{name}"


def res(typ: str, name: str, inputs: dict[str, Any], deps: tuple[str, ...] = (), parent: str = "") -> dict[str, Any]:
    return {
        "urn": urn(typ, name),
        "type": typ,
        "name": name,
        "parent": parent,
        "inputs": inputs,
        "dependencies": list(deps),
        "custom": True,
    }


def doc(*statements: dict) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


def efa_interfaces(instance_type: str) -> list[dict[str, Any]]:
    """The catalog's interface layout, as the launch template lists it."""
    return [
        {
            "networkCardIndex": i.network_card_index,
            "deviceIndex": i.device_index,
            "interfaceType": i.interface_type,
            "securityGroups": ["sg-efa"],
        }
        for i in CATALOG[instance_type].network_interfaces
    ]


def compliant_stack(cfg: StackConfig, plan: Plan) -> list[dict[str, Any]]:
    g = cfg.accelerator_node_groups[0]
    # A built image: the stack files carry the placeholder digest until `make image` runs.
    itype, image = g.instance_type, cfg.images.trainer.split("@")[0] + "@sha256:" + "a" * 64
    k8s = cfg.cluster.kubernetes_version
    bucket = "supernode-test-data"
    pg = res(T.PLACEMENT_GROUP, "gpu", {"name": "gpu-cluster", "strategy": "cluster"})
    sg = res(T.SECURITY_GROUP, "efa", {"description": "EFA", "vpcId": "vpc-1"})
    lt = res(
        T.LAUNCH_TEMPLATE,
        "gpu",
        {
            "instanceType": itype,
            "networkInterfaces": efa_interfaces(itype),
            "metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 1},
            "placement": {"groupName": "gpu-cluster"},
        },
        deps=(pg["urn"],),
    )
    ng = res(
        T.NODE_GROUP,
        "gpu",
        {
            "clusterName": "c",
            "amiType": "AL2023_x86_64_NVIDIA",
            "releaseVersion": g.ami_release_version,
            "version": k8s,
            "scalingConfig": {"desiredSize": g.nodes, "minSize": g.nodes, "maxSize": g.nodes},
            "launchTemplate": {"id": "lt-1", "version": "1"},
            "taints": [{"key": "nvidia.com/gpu", "effect": "NO_SCHEDULE"}],
        },
        deps=(lt["urn"],),
    )
    # Serving's reserved share of the pool (role: serving groups): outside the world, as the stack deploys it.
    serving_groups = [
        res(
            T.NODE_GROUP,
            f"gpu-{s.name}",
            {
                **ng["inputs"],
                "scalingConfig": {"desiredSize": s.nodes, "minSize": s.nodes, "maxSize": s.nodes},
                "labels": {ROLE_LABEL: "serving"},
            },
            deps=(lt["urn"],),
        )
        for s in cfg.accelerator_node_groups
        if s.role == "serving"
    ]
    key = res(
        T.KMS_KEY,
        "data",
        {
            "enableKeyRotation": True,
            "policy": doc(
                {
                    "Effect": "Allow",
                    "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"},
                    "Action": ["kms:Decrypt", "kms:Encrypt"],
                    "Resource": "*",
                }
            ),
        },
    )
    key_arn = f"arn:aws:kms:us-east-1:{ACCOUNT}:key/00000000-0000-4000-8000-000000000000"
    cluster = res(
        T.EKS_CLUSTER,
        "cluster",
        {
            "version": k8s,
            "vpcConfig": {"endpointPrivateAccess": True, "endpointPublicAccess": False},
            "encryptionConfig": {"resources": ["secrets"], "provider": {"keyArn": key_arn}},
        },
    )
    b = res(T.BUCKET, "data", {"bucket": bucket})
    s3 = [
        b,
        res(
            T.BUCKET_SSE,
            "data",
            {
                "bucket": bucket,
                "rules": [
                    {"applyServerSideEncryptionByDefault": {"sseAlgorithm": "aws:kms", "kmsMasterKeyId": key_arn}}
                ],
            },
            deps=(b["urn"],),
        ),
        res(
            T.BUCKET_PAB,
            "data",
            {
                "bucket": bucket,
                "blockPublicAcls": True,
                "blockPublicPolicy": True,
                "ignorePublicAcls": True,
                "restrictPublicBuckets": True,
            },
            deps=(b["urn"],),
        ),
        res(
            T.BUCKET_POLICY,
            "data",
            {
                "bucket": bucket,
                "policy": doc(
                    {
                        "Effect": "Deny",
                        "Principal": "*",
                        "Action": "s3:*",
                        "Resource": [f"arn:aws:s3:::{bucket}/*"],
                        "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                    }
                ),
            },
            deps=(b["urn"],),
        ),
        res(
            T.BUCKET_LIFECYCLE,
            "data",
            {
                "bucket": bucket,
                "rules": [
                    {
                        "id": "checkpoints",
                        "status": "Enabled",
                        "filter": {"prefix": cfg.storage.checkpoint_prefix},
                        "transitions": [{"days": 14, "storageClass": "GLACIER_IR"}],
                        "expiration": {"days": 90},
                    },
                    {
                        "id": "multipart",
                        "status": "Enabled",
                        "filter": {},
                        "abortIncompleteMultipartUpload": {"daysAfterInitiation": 3},
                    },
                ],
            },
            deps=(b["urn"],),
        ),
    ]
    fsx = res(
        T.FSX_LUSTRE,
        "fsx",
        {
            "deploymentType": "PERSISTENT_2",
            "storageCapacity": plan.checkpoint.fsx_capacity_gib,
            "perUnitStorageThroughput": cfg.storage.fsx.per_unit_throughput,
            "kmsKeyId": key_arn,
        },
    )
    dra = res(
        T.FSX_DRA,
        "fsx",
        {"fileSystemPath": "/data", "dataRepositoryPath": f"s3://{bucket}/"},
        deps=(fsx["urn"], b["urn"]),
    )
    role = res(
        T.IAM_ROLE,
        "trainer",
        {
            "assumeRolePolicy": doc(
                {
                    "Effect": "Allow",
                    "Principal": {"Federated": "arn:aws:iam::1:oidc-provider/x"},
                    "Action": "sts:AssumeRoleWithWebIdentity",
                }
            )
        },
    )
    role_policy = res(
        T.IAM_ROLE_POLICY,
        "trainer",
        {
            "role": "trainer",
            "policy": doc(
                {
                    "Effect": "Allow",
                    "Action": ["s3:GetObject"],
                    "Resource": [f"arn:aws:s3:::{bucket}/{cfg.storage.dataset_prefix}*"],
                },
                {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"]},
                {"Effect": "Allow", "Action": ["ec2:DescribeInstances"], "Resource": "*"},
            ),
        },
        deps=(role["urn"],),
    )
    topic_arn = f"arn:aws:sns:us-east-1:{ACCOUNT}:alarms"
    alarms = [
        res(
            T.METRIC_ALARM,
            name,
            {"metricName": metric, "namespace": "ContainerInsights", "alarmActions": [topic_arn], "threshold": 1},
        )
        for name, metric in (
            ("gpu-util-low", "DCGM_FI_DEV_GPU_UTIL"),
            ("node-not-ready", "node_status_condition_ready"),
            # the training queue's wait and its namespace's job failure rate (issue 36, item 5)
            ("queue-wait-gpu-h100", "supernode_queue_wait_p95_seconds"),
            ("job-failure-rate-training", "training_operator_jobs_failed_total"),
            # the served model's SLO alarms (issue 38, item 4): p99 TTFT and ITL, error ratio
            ("serving-ttft-test-vllm", "supernode_serving_ttft_p99_seconds"),
            ("serving-itl-test-vllm", "supernode_serving_itl_p99_seconds"),
            ("serving-errors-test-vllm", "supernode_serving_error_ratio"),
        )
    ]
    # Kueue's queues: training's ClusterQueue and serving's (which needs no wait alarm), a LocalQueue into each.
    queues = [
        res(T.CLUSTER_QUEUE, cq, {"metadata": {"name": cq}, "spec": {"cohort": "supernode-gpu"}})
        for cq in ("gpu-h100", "gpu-h100-serving")
    ] + [
        res(
            T.LOCAL_QUEUE,
            f"{ns}-gpu-h100",
            {"metadata": {"name": "gpu-h100", "namespace": ns}, "spec": {"clusterQueue": cq}},
        )
        for ns, cq in (("training", "gpu-h100"), ("serving", "gpu-h100-serving"))
    ]
    log_group = res(T.LOG_GROUP, "training", {"retentionInDays": cfg.monitoring.log_retention_days})
    cm = res(
        T.CONFIG_MAP,
        "plan",
        {"metadata": {"name": "supernode-plan", "namespace": "training"}, "data": {"plan.json": plan.to_json()}},
    )
    # The gate reads its bus-bandwidth floor from the plan, mounted like the trainer's.
    gate = res(
        T.K8S_JOB,
        "gate",
        {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "fabric",
                                "image": image,
                                "resources": bounded(),
                                "command": ["python", "-m", "supernode.trainer.node.fabric", "--plan", PLAN_MOUNT_PATH],
                                "volumeMounts": [{"name": "plan", "mountPath": PLAN_MOUNT_DIR}],
                            }
                        ],
                        "volumes": [{"name": "plan", "configMap": {"name": "supernode-plan"}}],
                    }
                }
            }
        },
        deps=(cm["urn"],),
    )
    worker = {
        "name": "trainer",
        "image": image,
        "command": ["python", "-m", "supernode.trainer.train", "--plan", PLAN_MOUNT_PATH],
        "resources": {
            "requests": bounded()["requests"],
            "limits": {
                "nvidia.com/gpu": CATALOG[itype].accelerators,
                "vpc.amazonaws.com/efa": CATALOG[itype].efa_interfaces,
                **bounded()["limits"],
            },
        },
        "volumeMounts": [{"name": "plan", "mountPath": PLAN_MOUNT_DIR}],
    }
    job = res(
        T.PYTORCH_JOB,
        "trainer",
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "spec": {
                "pytorchReplicaSpecs": {
                    "Worker": {
                        "replicas": g.nodes,
                        "template": {
                            "spec": {
                                "containers": [worker],
                                "terminationGracePeriodSeconds": cfg.workload.termination_grace_s,
                                "volumes": [{"name": "plan", "configMap": {"name": "supernode-plan"}}],
                            }
                        },
                    }
                }
            },
        },
        deps=(gate["urn"], cm["urn"]),
    )
    dcgm = res(
        T.DAEMON_SET,
        "dcgm-exporter",
        {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "dcgm-exporter",
                                "image": "nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04@sha256:" + "b" * 64,
                                "resources": bounded(),
                            }
                        ]
                    }
                }
            }
        },
    )
    device_plugin = res(
        T.DAEMON_SET,
        "nvidia-device-plugin",
        {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "nvidia-device-plugin",
                                "image": "nvcr.io/nvidia/k8s-device-plugin:v0.17.0@sha256:" + "d" * 64,
                                "resources": bounded(),
                            }
                        ]
                    }
                }
            }
        },
    )
    return [
        pg,
        sg,
        res(
            T.SG_INGRESS,
            "efa-self",
            {"securityGroupId": "sg-efa", "referencedSecurityGroupId": "sg-efa", "ipProtocol": "-1"},
            deps=(sg["urn"],),
        ),
        res(
            T.SG_EGRESS,
            "efa-self",
            {"securityGroupId": "sg-efa", "referencedSecurityGroupId": "sg-efa", "ipProtocol": "-1"},
            deps=(sg["urn"],),
        ),
        lt,
        ng,
        *serving_groups,
        key,
        cluster,
        *s3,
        fsx,
        dra,
        role,
        role_policy,
        *alarms,
        *queues,
        log_group,
        cm,
        gate,
        job,
        dcgm,
        device_plugin,
    ]


def built_images(cfg: StackConfig) -> StackConfig:
    """The stack as deployed: the trainer image built (`make image`), every add-on pinned by digest
    (`make addon-digests`) and vLLM's image pinned, instead of the placeholders and tags the repository carries."""
    from supernode.components.k8s.addons import addon_images

    data = cfg.to_mapping()
    images = data["images"]
    images["trainer"] = images["trainer"].split("@")[0] + "@sha256:" + "a" * 64
    images["addons"] = {name: f"{image}@sha256:{'c' * 64}" for name, image in addon_images().items()}
    if data.get("inference"):  # the vLLM image, pinned like the others
        data["inference"]["image"] = data["inference"]["image"].split("@")[0] + "@sha256:" + "d" * 64
    return from_mapping(data, "built images")


def find(resources: list[dict], typ: str, name: str | None = None) -> dict:
    return next(r for r in resources if r["type"] == typ and (name is None or r["name"] == name))


def mutate(resources: list[dict], typ: str, change: Callable[[dict], None], name: str | None = None) -> list[dict]:
    out = copy.deepcopy(resources)
    change(find(out, typ, name)["inputs"])
    return out


def without(resources: list[dict], typ: str, name: str | None = None) -> list[dict]:
    gone = find(resources, typ, name)
    return [r for r in resources if r is not gone]
