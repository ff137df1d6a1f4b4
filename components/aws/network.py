"""Network: VPC, private subnets, the GPU subnet in the GPU AZ, NAT only when asked for, private
VPC endpoints for image pulls and logs, and flow logs (issue 3, part 1). With network.existingVpcId
the VPC and subnets are someone else's: only their ids are passed on, and flow logs recorded."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from supernode.core.config import NetworkConfig

from ..context import StackContext
from .identity import assume_role_policy, policy_document

# Interface endpoints nodes need with no internet path: image pulls (ECR), IRSA (STS), logs.
INTERFACE_ENDPOINTS = ("ecr.api", "ecr.dkr", "sts", "logs")


@dataclass
class NetworkArgs:
    ctx: StackContext
    network: NetworkConfig
    gpu_availability_zone: str  # the node groups' AZ (the reservation's, when one is targeted)
    cluster_name: str  # subnet discovery tags for load balancers
    log_retention_days: int
    logs_kms_key_arn: pulumi.Input[str]


class Network(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    private_subnet_ids: list[pulumi.Output[str]]
    gpu_subnet_id: pulumi.Output[str]
    endpoint_security_group_id: pulumi.Output[str] | None  # None in an existing VPC
    flow_log_group_name: pulumi.Output[str] | None

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:network:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        net, tags = args.network, args.ctx.tagged()

        if net.existing_vpc_id:
            # Bring your own VPC: the VPC, its subnets, route tables, egress (NAT / internet gateway) and
            # VPC endpoints are the VPC owner's; the stack only places the cluster, nodes and FSx in the
            # configured subnets (preflight checks they exist, in this VPC and in their AZs).
            self.vpc_id = pulumi.Output.from_input(net.existing_vpc_id)
            self.private_subnet_ids = [pulumi.Output.from_input(s) for s in net.existing_private_subnet_ids]
            self.gpu_subnet_id = pulumi.Output.from_input(net.existing_gpu_subnet_id)
            self.endpoint_security_group_id = None
        else:
            self._create_vpc(name, args, child)

        self.flow_log_group_name = None
        if net.flow_logs:
            group = aws.cloudwatch.LogGroup(
                f"{name}-flow-logs",
                name=f"/supernode/{args.ctx.stack}/vpc-flow-logs",
                retention_in_days=args.log_retention_days,
                kms_key_id=args.logs_kms_key_arn,
                tags=tags,
                opts=child,
            )
            role = aws.iam.Role(
                f"{name}-flow-logs",
                assume_role_policy=assume_role_policy("vpc-flow-logs.amazonaws.com"),
                tags=tags,
                opts=child,
            )
            aws.iam.RolePolicy(
                f"{name}-flow-logs",
                role=role.id,
                opts=child,
                policy=group.arn.apply(
                    lambda arn: json.dumps(
                        policy_document(
                            {
                                "Effect": "Allow",
                                "Action": ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                                "Resource": [arn, f"{arn}:*"],
                            }
                        )
                    )
                ),
            )
            aws.ec2.FlowLog(
                name,
                vpc_id=self.vpc_id,
                traffic_type="ALL",
                log_destination_type="cloud-watch-logs",
                log_destination=group.arn,
                iam_role_arn=role.arn,
                max_aggregation_interval=60,
                tags=tags,
                opts=child,
            )
            self.flow_log_group_name = group.name

        self.register_outputs(
            {"vpc_id": self.vpc_id, "private_subnet_ids": self.private_subnet_ids, "gpu_subnet_id": self.gpu_subnet_id}
        )

    def _create_vpc(self, name: str, args: NetworkArgs, child: pulumi.ResourceOptions) -> None:
        """The VPC, private subnets, the GPU subnet, optional NAT and the private endpoints."""
        net, tagged = args.network, args.ctx.tagged

        vpc = aws.ec2.Vpc(
            name,
            cidr_block=net.vpc_cidr,
            enable_dns_hostnames=True,
            enable_dns_support=True,
            tags=tagged({"Name": f"supernode-{args.ctx.stack}"}),
            opts=child,
        )
        self.vpc_id = vpc.id
        private_rt = aws.ec2.RouteTable(
            f"{name}-private", vpc_id=vpc.id, tags=tagged({"Name": f"{name}-private"}), opts=child
        )
        private, gpu = _private_subnets(name, args, vpc.id, private_rt.id, child)
        self.private_subnet_ids = [s.id for s in private]
        self.gpu_subnet_id = gpu.id

        # Public subnets exist only to hold the NAT gateway: nodes never get public addresses.
        if net.use_nat_gateway and net.public_subnet_cidrs:
            _nat_egress(name, args, vpc.id, private_rt.id, child)
        self.endpoint_security_group_id = _private_endpoints(
            name, args, vpc.id, private_rt.id, self.private_subnet_ids, child
        )


def _private_subnets(
    name: str,
    args: NetworkArgs,
    vpc_id: pulumi.Input[str],
    route_table_id: pulumi.Input[str],
    child: pulumi.ResourceOptions,
) -> tuple[list[aws.ec2.Subnet], aws.ec2.Subnet]:
    """A private subnet in each AZ and the GPU subnet in the GPU AZ, all on the private route table:
    (the private subnets, the GPU subnet)."""
    net, tagged = args.network, args.ctx.tagged
    owned = {f"kubernetes.io/cluster/{args.cluster_name}": "shared"}
    private = []
    for az, cidr in zip(net.availability_zones, net.private_subnet_cidrs):
        s = aws.ec2.Subnet(
            f"{name}-private-{az}",
            vpc_id=vpc_id,
            cidr_block=cidr,
            availability_zone=az,
            map_public_ip_on_launch=False,
            tags=tagged({**owned, "Name": f"{name}-private-{az}", "kubernetes.io/role/internal-elb": "1"}),
            opts=child,
        )
        aws.ec2.RouteTableAssociation(f"{name}-private-{az}", subnet_id=s.id, route_table_id=route_table_id, opts=child)
        private.append(s)
    gpu = aws.ec2.Subnet(
        f"{name}-gpu",
        vpc_id=vpc_id,
        cidr_block=net.gpu_subnet_cidr,
        availability_zone=args.gpu_availability_zone,
        map_public_ip_on_launch=False,
        tags=tagged({**owned, "Name": f"{name}-gpu-{args.gpu_availability_zone}"}),
        opts=child,
    )
    aws.ec2.RouteTableAssociation(f"{name}-gpu", subnet_id=gpu.id, route_table_id=route_table_id, opts=child)
    return private, gpu


def _nat_egress(
    name: str,
    args: NetworkArgs,
    vpc_id: pulumi.Input[str],
    private_route_table_id: pulumi.Input[str],
    child: pulumi.ResourceOptions,
) -> None:
    """The internet gateway, the public subnets and one NAT gateway, the private route table's default route."""
    net, tagged = args.network, args.ctx.tagged
    igw = aws.ec2.InternetGateway(name, vpc_id=vpc_id, tags=tagged({"Name": name}), opts=child)
    public_rt = aws.ec2.RouteTable(f"{name}-public", vpc_id=vpc_id, tags=tagged({"Name": f"{name}-public"}), opts=child)
    aws.ec2.Route(
        f"{name}-public-default",
        route_table_id=public_rt.id,
        destination_cidr_block="0.0.0.0/0",
        gateway_id=igw.id,
        opts=child,
    )
    public = _public_subnets(name, args, vpc_id, public_rt.id, child)
    # One NAT, in the GPU AZ when it has a public subnet, so GPU egress stays in-zone.
    nat_az = args.gpu_availability_zone if args.gpu_availability_zone in public else net.availability_zones[0]
    eip = aws.ec2.Eip(f"{name}-nat", domain="vpc", tags=tagged({"Name": f"{name}-nat"}), opts=child)
    nat = aws.ec2.NatGateway(
        name,
        allocation_id=eip.id,
        subnet_id=public[nat_az].id,
        tags=tagged({"Name": name}),
        opts=pulumi.ResourceOptions(parent=child.parent, depends_on=[igw]),
    )
    aws.ec2.Route(
        f"{name}-private-default",
        route_table_id=private_route_table_id,
        destination_cidr_block="0.0.0.0/0",
        nat_gateway_id=nat.id,
        opts=child,
    )


def _public_subnets(
    name: str,
    args: NetworkArgs,
    vpc_id: pulumi.Input[str],
    route_table_id: pulumi.Input[str],
    child: pulumi.ResourceOptions,
) -> dict[str, aws.ec2.Subnet]:
    """A public subnet in each AZ with a public CIDR, on the public route table, by AZ."""
    net, tagged = args.network, args.ctx.tagged
    public = {}
    for az, cidr in zip(net.availability_zones, net.public_subnet_cidrs):
        s = aws.ec2.Subnet(
            f"{name}-public-{az}",
            vpc_id=vpc_id,
            cidr_block=cidr,
            availability_zone=az,
            map_public_ip_on_launch=False,
            tags=tagged({"Name": f"{name}-public-{az}", "kubernetes.io/role/elb": "1"}),
            opts=child,
        )
        aws.ec2.RouteTableAssociation(f"{name}-public-{az}", subnet_id=s.id, route_table_id=route_table_id, opts=child)
        public[az] = s
    return public


def _private_endpoints(
    name: str,
    args: NetworkArgs,
    vpc_id: pulumi.Input[str],
    private_route_table_id: pulumi.Input[str],
    subnet_ids: list[pulumi.Output[str]],
    child: pulumi.ResourceOptions,
) -> pulumi.Output[str]:
    """Private endpoints: S3 (gateway, free) and the interface endpoints nodes need, behind one security
    group that admits HTTPS from the VPC. Returns that security group's id."""
    net, tagged = args.network, args.ctx.tagged
    aws.ec2.VpcEndpoint(
        f"{name}-s3",
        vpc_id=vpc_id,
        service_name=f"com.amazonaws.{args.ctx.region}.s3",
        vpc_endpoint_type="Gateway",
        route_table_ids=[private_route_table_id],
        tags=tagged({}),
        opts=child,
    )
    endpoint_sg = aws.ec2.SecurityGroup(
        f"{name}-endpoints",
        vpc_id=vpc_id,
        description="HTTPS from the VPC to interface endpoints",
        tags=tagged({"Name": f"{name}-endpoints"}),
        opts=child,
    )
    aws.vpc.SecurityGroupIngressRule(
        f"{name}-endpoints-https",
        security_group_id=endpoint_sg.id,
        ip_protocol="tcp",
        from_port=443,
        to_port=443,
        cidr_ipv4=net.vpc_cidr,
        description="HTTPS from inside the VPC",
        opts=child,
    )
    for service in INTERFACE_ENDPOINTS:
        aws.ec2.VpcEndpoint(
            f"{name}-{service.replace('.', '-')}",
            vpc_id=vpc_id,
            service_name=f"com.amazonaws.{args.ctx.region}.{service}",
            vpc_endpoint_type="Interface",
            private_dns_enabled=True,
            subnet_ids=subnet_ids,
            security_group_ids=[endpoint_sg.id],
            tags=tagged({}),
            opts=child,
        )
    return endpoint_sg.id
