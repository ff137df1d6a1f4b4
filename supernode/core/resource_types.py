"""Pulumi type tokens (`package:module/version:Type`), as pulumi_aws 7.x / pulumi_kubernetes 4.x register them.

One module for everything that names resources by type: the policy pack (which resources a check
reads), the offline preview's mocks (what ids and outputs a resource gets) and the tests. A provider
upgrade that renames a token then changes one line here, not a string in each of them. Plain strings,
so the core stays free of pulumi.

Every AWS type named here is one the security policies have been reviewed against: the pack's
`aws-types-reviewed` policy fails a stack with an AWS resource of any other type (it could grant
access in a way no policy reads). Add a type here only after checking what it can open.
"""

# -- AWS: network ---------------------------------------------------------------------------------
VPC = "aws:ec2/vpc:Vpc"
SUBNET = "aws:ec2/subnet:Subnet"
ROUTE_TABLE = "aws:ec2/routeTable:RouteTable"
ROUTE_TABLE_ASSOCIATION = "aws:ec2/routeTableAssociation:RouteTableAssociation"
ROUTE = "aws:ec2/route:Route"
INTERNET_GATEWAY = "aws:ec2/internetGateway:InternetGateway"
NAT_GATEWAY = "aws:ec2/natGateway:NatGateway"
EIP = "aws:ec2/eip:Eip"
VPC_ENDPOINT = "aws:ec2/vpcEndpoint:VpcEndpoint"
FLOW_LOG = "aws:ec2/flowLog:FlowLog"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
SG_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
SG_INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
SG_EGRESS = "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule"

# -- AWS: compute and EKS -------------------------------------------------------------------------
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
PLACEMENT_GROUP = "aws:ec2/placementGroup:PlacementGroup"
EKS_CLUSTER = "aws:eks/cluster:Cluster"
NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
ASG_SCHEDULE = "aws:autoscaling/schedule:Schedule"
EKS_ADDON = "aws:eks/addon:Addon"
POD_IDENTITY_ASSOCIATION = "aws:eks/podIdentityAssociation:PodIdentityAssociation"
# A team's IAM role -> its Kubernetes group (components/aws/cluster.py TeamAccess); read by eks-access-entries.
ACCESS_ENTRY = "aws:eks/accessEntry:AccessEntry"

# -- AWS: storage ---------------------------------------------------------------------------------
BUCKET = "aws:s3/bucket:Bucket"
BUCKET_SSE = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
BUCKET_PAB = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
BUCKET_POLICY = "aws:s3/bucketPolicy:BucketPolicy"
BUCKET_LOGGING = "aws:s3/bucketLogging:BucketLogging"
BUCKET_LIFECYCLE = "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration"
BUCKET_VERSIONING = "aws:s3/bucketVersioning:BucketVersioning"
BUCKET_OWNERSHIP = "aws:s3/bucketOwnershipControls:BucketOwnershipControls"
BUCKET_ACL = "aws:s3/bucketAcl:BucketAcl"
BUCKET_ACL_V2 = "aws:s3/bucketAclV2:BucketAclV2"  # the deprecated name pulumi_aws 7 still registers
FSX_LUSTRE = "aws:fsx/lustreFileSystem:LustreFileSystem"
FSX_DRA = "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation"

# -- AWS: identity and keys -----------------------------------------------------------------------
IAM_ROLE = "aws:iam/role:Role"
IAM_ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
IAM_POLICY = "aws:iam/policy:Policy"
IAM_ATTACHMENT = "aws:iam/rolePolicyAttachment:RolePolicyAttachment"
IAM_USER_POLICY = "aws:iam/userPolicy:UserPolicy"
IAM_GROUP_POLICY = "aws:iam/groupPolicy:GroupPolicy"
IAM_OIDC_PROVIDER = "aws:iam/openIdConnectProvider:OpenIdConnectProvider"
KMS_KEY = "aws:kms/key:Key"
KMS_KEY_POLICY = "aws:kms/keyPolicy:KeyPolicy"
KMS_ALIAS = "aws:kms/alias:Alias"

# -- AWS: registry ------------------------------------------------------------------------------
ECR_REPOSITORY = "aws:ecr/repository:Repository"
ECR_LIFECYCLE_POLICY = "aws:ecr/lifecyclePolicy:LifecyclePolicy"

# -- AWS: monitoring ------------------------------------------------------------------------------
LOG_GROUP = "aws:cloudwatch/logGroup:LogGroup"
LOG_METRIC_FILTER = "aws:cloudwatch/logMetricFilter:LogMetricFilter"
METRIC_ALARM = "aws:cloudwatch/metricAlarm:MetricAlarm"
DASHBOARD = "aws:cloudwatch/dashboard:Dashboard"
SNS_TOPIC = "aws:sns/topic:Topic"
SNS_TOPIC_SUBSCRIPTION = "aws:sns/topicSubscription:TopicSubscription"
SNS_TOPIC_POLICY = "aws:sns/topicPolicy:TopicPolicy"

# -- Kubernetes -----------------------------------------------------------------------------------
CONFIG_MAP = "kubernetes:core/v1:ConfigMap"
POD = "kubernetes:core/v1:Pod"
K8S_JOB = "kubernetes:batch/v1:Job"
CRON_JOB = "kubernetes:batch/v1:CronJob"
DAEMON_SET = "kubernetes:apps/v1:DaemonSet"
DEPLOYMENT = "kubernetes:apps/v1:Deployment"
STATEFUL_SET = "kubernetes:apps/v1:StatefulSet"
CRD = "kubernetes:apiextensions.k8s.io/v1:CustomResourceDefinition"
PYTORCH_JOB = "kubernetes:kubeflow.org/v1:PyTorchJob"
CLUSTER_QUEUE = "kubernetes:kueue.x-k8s.io/v1beta1:ClusterQueue"

# The engine's own resources.
STACK = "pulumi:pulumi:Stack"
STACK_REFERENCE = "pulumi:pulumi:StackReference"
COMPUTE_DOMAIN = "kubernetes:resource.nvidia.com/v1beta1:ComputeDomain"

# Serving (components/k8s/serving.py).
LEADER_WORKER_SET = "kubernetes:leaderworkerset.x-k8s.io/v1:LeaderWorkerSet"
K8S_SERVICE = "kubernetes:core/v1:Service"
PDB = "kubernetes:policy/v1:PodDisruptionBudget"
HPA = "kubernetes:autoscaling/v2:HorizontalPodAutoscaler"
NETWORK_POLICY = "kubernetes:networking.k8s.io/v1:NetworkPolicy"

# Kueue's queues (components/k8s/queues.py): the queue alarms (policies/monitoring.py) follow them.
CLUSTER_QUEUE = "kubernetes:kueue.x-k8s.io/v1beta1:ClusterQueue"
LOCAL_QUEUE = "kubernetes:kueue.x-k8s.io/v1beta1:LocalQueue"

# The management page's load balancer (components/aws/management.py; policies/management.py reads them).
LOAD_BALANCER = "aws:lb/loadBalancer:LoadBalancer"
LB_LISTENER = "aws:lb/listener:Listener"
LB_TARGET_GROUP = "aws:lb/targetGroup:TargetGroup"
ASG_ATTACHMENT = "aws:autoscaling/attachment:Attachment"
# RBAC (policies/management.py reads the management page's).
CLUSTER_ROLE = "kubernetes:rbac.authorization.k8s.io/v1:ClusterRole"
ROLE_BINDING = "kubernetes:rbac.authorization.k8s.io/v1:RoleBinding"
CLUSTER_ROLE_BINDING = "kubernetes:rbac.authorization.k8s.io/v1:ClusterRoleBinding"
