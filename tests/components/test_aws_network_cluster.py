"""Network (subnets, NAT only when asked, private endpoints, flow logs) and the EKS cluster
(version, endpoint access, secrets encryption, control-plane logs, OIDC, pinned add-ons)."""

from __future__ import annotations

import json

from aws_preview import Stack, preview

from supernode.core import resource_types as T
from supernode.core.catalog import EKS_ADDON_VERSIONS

SUBNET = T.SUBNET
ENDPOINT = T.VPC_ENDPOINT
CLUSTER = T.EKS_CLUSTER
ADDON = T.EKS_ADDON
LOG_GROUP = T.LOG_GROUP


def test_subnets_gpu_subnet_in_the_gpu_az(stack: Stack):
    net, az = stack.cfg.network, stack.cfg.availability_zone
    subnets = {r.id: r.inputs for r in stack.all(SUBNET)}
    private = [subnets[i] for i in stack.outputs["private_subnet_ids"]]
    assert [(s["availabilityZone"], s["cidrBlock"]) for s in private] == list(
        zip(net.availability_zones, net.private_subnet_cidrs)
    )
    gpu = subnets[stack.outputs["gpu_subnet_id"]]
    assert (gpu["availabilityZone"], gpu["cidrBlock"]) == (az, net.gpu_subnet_cidr)
    for g in stack.cfg.accelerator_node_groups:  # the reservation's AZ is the GPU subnet's
        assert g.capacity.availability_zone in (None, gpu["availabilityZone"])
    assert not any(s.get("mapPublicIpOnLaunch") for s in subnets.values())
    assert stack.one(T.VPC).inputs["cidrBlock"] == net.vpc_cidr


def test_one_nat_in_a_public_subnet_and_private_default_route(stack: Stack):
    (nat,) = stack.all(T.NAT_GATEWAY)
    public = {r.id: r.inputs for r in stack.all(SUBNET) if r.name.startswith("network-public-")}
    assert len(public) == len(stack.cfg.network.public_subnet_cidrs)
    assert nat.inputs["subnetId"] in public
    routes = [r.inputs for r in stack.all(T.ROUTE) if r.inputs.get("natGatewayId") == nat.id]
    assert [r["destinationCidrBlock"] for r in routes] == ["0.0.0.0/0"]


def test_no_public_subnets_or_nat_when_not_wanted():
    def change(data: dict) -> None:
        data["network"].update(natGateway=False, publicSubnetCidrs=[])

    s = preview("prod", "no-nat", change)
    for typ in (T.NAT_GATEWAY, T.INTERNET_GATEWAY, T.EIP):
        assert s.all(typ) == []
    assert not [r for r in s.all(SUBNET) if r.name.startswith("network-public-")]
    assert len(s.all(ENDPOINT)) == 5  # nodes still pull images and ship logs, privately


def test_private_endpoints(stack: Stack):
    region = stack.cfg.region
    endpoints = {
        r.inputs["serviceName"].removeprefix(f"com.amazonaws.{region}."): r.inputs for r in stack.all(ENDPOINT)
    }
    assert set(endpoints) == {"s3", "ecr.api", "ecr.dkr", "sts", "logs"}
    assert endpoints["s3"]["vpcEndpointType"] == "Gateway" and endpoints["s3"]["routeTableIds"]
    for name in ("ecr.api", "ecr.dkr", "sts", "logs"):
        e = endpoints[name]
        assert e["vpcEndpointType"] == "Interface" and e["privateDnsEnabled"] is True
        assert e["subnetIds"] == stack.outputs["private_subnet_ids"]


def test_flow_logs_to_an_encrypted_log_group(stack: Stack):
    flow = stack.one(T.FLOW_LOG).inputs
    group = stack.one(LOG_GROUP, "network-flow-logs")
    assert flow["trafficType"] == "ALL" and flow["logDestination"] == group.outputs["arn"]
    assert flow["vpcId"] == stack.outputs["vpc_id"]
    assert group.inputs["retentionInDays"] == stack.cfg.monitoring.log_retention_days
    assert group.inputs["kmsKeyId"] == stack.outputs["kms_key_arns"]["ops"]


def test_cluster_version_endpoint_encryption_and_logging(stack: Stack):
    c, cfg = stack.one(CLUSTER).inputs, stack.cfg.cluster
    assert c["version"] == cfg.kubernetes_version == stack.outputs["cluster_version"]
    vpc = c["vpcConfig"]
    assert vpc["endpointPrivateAccess"] is cfg.endpoint_private_access
    assert vpc["endpointPublicAccess"] is cfg.endpoint_public_access
    if cfg.endpoint_public_access:
        assert vpc["publicAccessCidrs"] == cfg.public_access_cidrs and "0.0.0.0/0" not in vpc["publicAccessCidrs"]
    else:
        assert "publicAccessCidrs" not in vpc
    assert c["encryptionConfig"] == {
        "resources": ["secrets"],
        "provider": {"keyArn": stack.outputs["kms_key_arns"]["eks"]},
    }
    assert set(c["enabledClusterLogTypes"]) == {"api", "audit", "authenticator", "controllerManager", "scheduler"}
    group = stack.one(LOG_GROUP, "cluster-control-plane").inputs
    assert group["name"] == f"/aws/eks/{stack.outputs['cluster_name']}/cluster"
    assert group["kmsKeyId"] == stack.outputs["kms_key_arns"]["ops"]


def test_prod_endpoint_is_private_only():
    vpc = preview("prod").one(CLUSTER).inputs["vpcConfig"]
    assert (vpc["endpointPrivateAccess"], vpc["endpointPublicAccess"]) == (True, False)


def test_oidc_provider_and_pinned_addons(stack: Stack):
    oidc = stack.one(T.IAM_OIDC_PROVIDER).inputs
    assert oidc["url"] == stack.outputs["oidc_issuer_url"] and oidc["clientIdLists"] == ["sts.amazonaws.com"]
    addons = {a.inputs["addonName"]: a.inputs["addonVersion"] for a in stack.all(ADDON)}
    pinned = EKS_ADDON_VERSIONS[stack.cfg.cluster.kubernetes_version]
    assert addons == pinned
    assert {
        "vpc-cni",
        "coredns",
        "kube-proxy",
        "aws-fsx-csi-driver",
        "eks-node-monitoring-agent",
        "eks-pod-identity-agent",
        "amazon-cloudwatch-observability",
    } <= set(addons)


def test_addons_with_pods_wait_for_nodes_and_nodes_wait_for_the_cni(stack: Stack):
    addons = {a.inputs["addonName"]: a for a in stack.all(ADDON)}
    node_groups = {r.urn for r in stack.all(T.NODE_GROUP)}
    for name in ("coredns", "aws-fsx-csi-driver", "eks-node-monitoring-agent", "amazon-cloudwatch-observability"):
        assert node_groups <= set(addons[name].dependencies), name
    for ng in stack.all(T.NODE_GROUP):
        assert addons["vpc-cni"].urn in ng.dependencies


def test_kubeconfig_is_secret_and_uses_get_token(stack: Stack):
    assert stack.result.secret_outputs == ["kubeconfig"]
    kc = json.loads(stack.outputs["kubeconfig"])
    name = stack.outputs["cluster_name"]
    assert kc["clusters"][0]["cluster"]["server"] == stack.outputs["cluster_endpoint"]
    assert kc["users"][0]["user"]["exec"]["args"][:4] == ["eks", "get-token", "--cluster-name", name]
