"""Cluster add-ons the training job needs, as explicit objects (so `supernode preview --manifests`
can render and validate them offline, which Helm releases cannot): the NVIDIA and EFA device
plugins, the DCGM exporter with a Prometheus scrape endpoint, the Kubeflow training operator
(PyTorchJob only) and, where the plan's NVLink domain spans nodes (GB200 UltraServers), the NVIDIA DRA
driver in ComputeDomain mode with the ComputeDomain CRD. The FSx CSI driver is an EKS add-on on the AWS side, so it
is not here.

The manifests are third-party software, so they live as pinned YAML files in `components/addons/`
(and the CRD in `components/crds/`), reviewed and bumped as files. This module loads them and
patches only what depends on the stack: the add-ons' namespace, ownership labels, which nodes
the DaemonSets run on (GpuNodes), the images (supernode:images.addons pins them by digest), the EKS
registry's region, and the references between objects.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from supernode.core.catalog import CATALOG
from supernode.core.vendors import VENDORS

from .common import ADDON_DIR, GpuNodes, load_addon, meta, namespace_selector, shipped_crd

SYSTEM_NAMESPACE = "supernode-system"  # where the add-on files place their namespaced objects
OPERATOR = "training-operator"
ADDON_FILES = (
    "nvidia-device-plugin.yaml",
    "aws-efa-k8s-device-plugin.yaml",
    "dcgm-exporter.yaml",
    "neuron-device-plugin.yaml",
    "neuron-monitor.yaml",
    "training-operator.yaml",
    "kueue.yaml",
    "lws.yaml",
)  # kueue.yaml: installed by components/k8s/queues.py; lws.yaml by components/k8s/lws.py (multi-node serving)
# Per accelerator vendor (InstanceType.vendor): the device plugin and the metrics exporter the stack installs.
# The metrics pipelines: the CloudWatch agent's Prometheus scrape (components/k8s/operations.py) and, with
# serving, the Prometheus and adapter behind the serving HPA (components/k8s/serving.py).
METRICS_ADDON_FILES = ("cwagent-prometheus.yaml", "prometheus.yaml", "prometheus-adapter.yaml")
WORKLOADS = ("DaemonSet", "Deployment")  # the kinds in the add-on files that run containers
CONFIG_HASH = "supernode.io/config-sha256"  # on a pod template: the configuration its pods started with
# The NVIDIA DRA driver (ComputeDomain mode), only on plans whose NVLink domain spans nodes. One image
# for all its containers (and the compute-domain daemons its controller launches): its images.addons
# entry is named after the driver, not after a container.
DRA_DRIVER = "nvidia-dra-driver-gpu"
DRA_DRIVER_FILE = "nvidia-dra-driver.yaml"

# The typed resource for each kind in the add-on files: typed resources are what the engine records,
# `preview --manifests` validates and the policies read (a generic YAML resource would hide them).
KINDS = {
    "DaemonSet": k8s.apps.v1.DaemonSet,
    "Deployment": k8s.apps.v1.Deployment,
    "Service": k8s.core.v1.Service,
    "ConfigMap": k8s.core.v1.ConfigMap,
    "ServiceAccount": k8s.core.v1.ServiceAccount,
    "Secret": k8s.core.v1.Secret,
    "ClusterRole": k8s.rbac.v1.ClusterRole,
    "ClusterRoleBinding": k8s.rbac.v1.ClusterRoleBinding,
    "Role": k8s.rbac.v1.Role,
    "RoleBinding": k8s.rbac.v1.RoleBinding,
    "ValidatingWebhookConfiguration": k8s.admissionregistration.v1.ValidatingWebhookConfiguration,
    "MutatingWebhookConfiguration": k8s.admissionregistration.v1.MutatingWebhookConfiguration,
    "DeviceClass": k8s.resource.v1beta1.DeviceClass,  # resource.k8s.io/v1beta1: Kubernetes 1.33 and 1.34
    "APIService": k8s.apiregistration.v1.APIService,
    "NetworkPolicy": k8s.networking.v1.NetworkPolicy,
}


@dataclass(frozen=True)
class AddonArgs:
    region: str
    gpu_nodes: GpuNodes
    # Container name -> image (supernode:images.addons): digests in prod; an add-on not named runs the
    # tag its file pins.
    images: Mapping[str, str] = field(default_factory=dict)
    # The plan spans nodes over NVLink (GB200 UltraServers): install the ComputeDomain CRD the jobs'
    # ComputeDomains need (components/crds/computedomain.yaml) and the NVIDIA DRA driver that serves them.
    compute_domains: bool = False
    # Whose accelerators the node groups carry (the plan's InstanceType.vendor): picks the device
    # plugin and the exporter (NVIDIA's and DCGM, or AWS Neuron's and neuron-monitor).
    vendor: str = "nvidia"


def _efa_instance_types() -> list[str]:
    """Nodes the EFA plugin runs on: every catalog type with EFA devices (so a new type is one catalog line)."""
    return sorted(name for name, t in CATALOG.items() if t.efa_interfaces > 0)


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def on_gpu_nodes(obj: dict[str, Any], gpu: GpuNodes, extra: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """A DaemonSet of an add-on file placed on the GPU nodes: their taints tolerated ahead of the
    file's own tolerations, required affinity to their labels plus `extra` match expressions."""
    spec = _pod_spec(obj)
    spec["tolerations"] = gpu.daemon_tolerations() + spec.get("tolerations", [])
    spec["affinity"] = gpu.affinity(extra=extra)
    return obj


def regional_image(image: str, region: str) -> str:
    """An image of an ECR registry pulled from `region`: EKS add-on images are replicated to every
    commercial region, and nodes reach ECR through their own region's endpoints."""
    return re.sub(r"\.dkr\.ecr\.[a-z0-9-]+\.amazonaws\.com/", f".dkr.ecr.{region}.amazonaws.com/", image)


def _image_tag(obj: dict[str, Any]) -> tuple[str, str]:
    c = _pod_spec(obj)["containers"][0]
    return c["name"], c["image"].split("@", 1)[0].rsplit(":", 1)[1]


def load_addon_objects(filename: str) -> list[dict[str, Any]]:
    """Every object of an add-on file, in file order (for files with several objects of one kind)."""
    return [obj for obj in yaml.safe_load_all((ADDON_DIR / filename).read_text(encoding="utf-8")) if obj]


def _dra_driver_image() -> str:
    """The DRA driver image as its file pins it (by tag)."""
    return next(
        _pod_spec(obj)["containers"][0]["image"]
        for obj in load_addon_objects(DRA_DRIVER_FILE)
        if obj["kind"] == "Deployment"
    )


def addon_images() -> dict[str, str]:
    """Each add-on container's image as its file pins it (by tag), and the DRA driver's image: what
    supernode:images.addons overrides."""
    images = {
        c["name"]: c["image"]
        for f in ADDON_FILES + METRICS_ADDON_FILES
        for obj in load_addon_objects(f)
        if obj["kind"] in WORKLOADS
        for c in _pod_spec(obj)["containers"]
    }
    return {**images, DRA_DRIVER: _dra_driver_image()}


def with_images(obj: dict[str, Any], images: Mapping[str, str]) -> dict[str, Any]:
    """An add-on workload with the stack's image for each container it names (by container name)."""
    for c in _pod_spec(obj)["containers"]:
        c["image"] = images.get(c["name"], c["image"])
    return obj


def with_config_hash(obj: dict[str, Any], *config: str) -> dict[str, Any]:
    """An add-on workload whose pods roll when the configuration they mount changes: the kubelet
    updates a mounted ConfigMap in place, and these programs read theirs only at start."""
    digest = hashlib.sha256("\0".join(config).encode()).hexdigest()
    obj["spec"]["template"].setdefault("metadata", {}).setdefault("annotations", {})[CONFIG_HASH] = digest
    return obj


def _snake(field: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", field).lower()  # roleRef -> role_ref, as the SDK names arguments


def addon_resource(
    resource_name: str, obj: dict[str, Any], opts: pulumi.ResourceOptions, namespace: pulumi.Input[str] | None = None
) -> pulumi.CustomResource:
    """The typed resource (KINDS) for one object of an add-on file, with the ownership labels, in
    `namespace` (a created Namespace's name, so after it) or else the file's own."""
    md = obj["metadata"]
    body = {_snake(k): v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    return KINDS[obj["kind"]](
        resource_name,
        metadata=meta(md["name"], namespace or md.get("namespace"), md.get("labels"), md.get("annotations")),
        opts=opts,
        **body,
    )


def webhook_controller(
    name: str,
    objs: Mapping[str, dict[str, Any]],
    namespace: pulumi.Input[str],
    opts: pulumi.ResourceOptions,
    *,
    role: str,
    config: tuple[str, str],
    scoped: Callable[[dict[str, Any]], bool],
    namespaces: Sequence[str],
    images: Mapping[str, str],
    after: Sequence[pulumi.Resource],
) -> tuple[pulumi.CustomResource, str]:
    """A kubebuilder controller-manager from its pinned release file (Kueue's, the LeaderWorkerSet's),
    one object of each kind in `objs`, in `namespace`: its service account bound to its ClusterRole and
    to its namespace's Role (resources named `role`), the webhook certificate's Secret and Service, its
    configuration (`config`: key, text), both webhook configurations with the hooks `scoped` picks
    limited to `namespaces` (they fail closed: nowhere else), and the Deployment after `after` (its
    CRDs), its rights and its webhooks: it reports ready once it has put its CA into them, so what they
    intercept may be created from then on. The Deployment and the controller's version (its image tag)."""

    def create(suffix: str, obj: dict[str, Any], **options: Any) -> pulumi.CustomResource:
        where = namespace if "namespace" in obj["metadata"] else None
        return addon_resource(
            f"{name}-{suffix}", obj, pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(**options)), where
        )

    account = create("sa", objs["ServiceAccount"])

    def bind(binding: dict[str, Any], granted: pulumi.CustomResource) -> dict[str, Any]:
        binding["roleRef"]["name"] = granted.metadata.name
        for subject in binding["subjects"]:
            subject.update(name=account.metadata.name, namespace=namespace)
        return binding

    bindings = [
        create("manager", bind(objs["ClusterRoleBinding"], create("manager", objs["ClusterRole"]))),
        create(role, bind(objs["RoleBinding"], create(role, objs["Role"]))),
    ]
    # The controller writes and rotates the certificate in this Secret and injects its CA into both
    # webhook configurations: Pulumi must not fight over either. Their names are the controller's own.
    cert = create("webhook-cert", objs["Secret"], ignore_changes=["data"])
    service = create("webhook", objs["Service"])
    key, text = config
    config_map = create("config", {**objs["ConfigMap"], "data": {key: text}})
    webhooks = []
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for hook in objs[kind]["webhooks"]:
            hook["clientConfig"]["service"].update(name=service.metadata.name, namespace=namespace)
            if scoped(hook):
                hook["namespaceSelector"] = namespace_selector(namespaces)
        webhooks.append(
            create(
                kind.removesuffix("Configuration").lower(),
                objs[kind],
                ignore_changes=["webhooks[*].clientConfig.caBundle"],
            )
        )
    # Its pods restart with a changed configuration (read once at start).
    deployment = with_config_hash(with_images(objs["Deployment"], images), text)
    pod = deployment["spec"]["template"]["spec"]
    pod["serviceAccountName"] = account.metadata.name
    for volume in pod["volumes"]:
        if "configMap" in volume:
            volume["configMap"]["name"] = config_map.metadata.name
        if "secret" in volume:
            volume["secret"]["secretName"] = cert.metadata.name
    (container,) = pod["containers"]
    version = container["image"].split("@", 1)[0].rsplit(":", 1)[1]
    return create("controller", deployment, depends_on=[*after, *bindings, *webhooks]), version


class ClusterAddons(pulumi.ComponentResource):
    """Device plugins, GPU metrics and the training operator. `ready` lists what a job must wait for."""

    def __init__(self, name: str, args: AddonArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("supernode:workload:ClusterAddons", name, None, opts)
        self._child = pulumi.ResourceOptions(parent=self)
        gpu = args.gpu_nodes
        self.namespace = k8s.core.v1.Namespace(f"{name}-ns", metadata=meta(SYSTEM_NAMESPACE), opts=self._child)
        self._ns = self.namespace.metadata.name

        plugin = self._device_plugin(name, args)

        efa = with_images(load_addon("aws-efa-k8s-device-plugin.yaml")["DaemonSet"], args.images)
        for c in _pod_spec(efa)["containers"]:
            c["image"] = regional_image(c["image"], args.region)
        efa_nodes = {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": _efa_instance_types()}
        self.efa_device_plugin = self._create(f"{name}-efa-device-plugin", on_gpu_nodes(efa, gpu, [efa_nodes]))

        exporter = load_addon(VENDORS[args.vendor].exporter + ".yaml")
        exporter_name = exporter["DaemonSet"]["metadata"]["name"]
        with_images(exporter["DaemonSet"], args.images)
        if "ConfigMap" in exporter:  # DCGM's counters: the exporter starts after (and restarts with) them
            counters = self._create(f"{name}-{exporter_name}-counters", exporter["ConfigMap"])
            for volume in _pod_spec(exporter["DaemonSet"])["volumes"]:
                if "configMap" in volume:
                    volume["configMap"]["name"] = counters.metadata.name
        self.exporter = self._create(f"{name}-{exporter_name}", on_gpu_nodes(exporter["DaemonSet"], gpu))
        self.exporter_service = self._create(f"{name}-{exporter_name}", exporter["Service"])
        svc = exporter["Service"]
        self.scrape_annotations = dict(svc["metadata"]["annotations"])
        port = svc["spec"]["ports"][0]["port"]
        # The accelerator exporter's endpoint (DCGM's, or neuron-monitor's): the stack output keeps its
        # contract name dcgm_metrics_endpoint.
        self.dcgm_endpoint = pulumi.Output.concat(
            f"http://{svc['metadata']['name']}.", self._ns, f".svc:{port}/metrics"
        )

        operator = self._training_operator(name, args.images)
        self.ready = [self.pytorchjob_crd, self.operator]
        # What a job's ComputeDomain waits for (none without multi-node NVLink).
        self.compute_domain_ready: list[pulumi.Resource] = []
        if args.compute_domains:
            cd_crd = shipped_crd(f"{name}-computedomain-crd", "computedomain.yaml", self._child)
            self.compute_domain_ready += [cd_crd, *self._dra_driver(name, args, cd_crd)]
        self.versions = dict(_image_tag(obj) for obj in (plugin, efa, exporter["DaemonSet"], operator))
        if args.compute_domains:
            self.versions[DRA_DRIVER] = self.dra_driver_version
        self.register_outputs(
            {
                "versions": self.versions,
                "dcgm_endpoint": self.dcgm_endpoint,
                "scrape_annotations": self.scrape_annotations,
            }
        )

    def _device_plugin(self, name: str, args: AddonArgs) -> dict[str, Any]:
        """The vendor's device plugin DaemonSet on the accelerator nodes. NVIDIA's needs no API access;
        AWS Neuron's runs as its own ServiceAccount, bound to the file's ClusterRole (its least rules)."""
        objs = load_addon(VENDORS[args.vendor].device_plugin + ".yaml")
        plugin = with_images(objs["DaemonSet"], args.images)
        plugin_name = plugin["metadata"]["name"]
        if "ServiceAccount" in objs:
            sa = self._create(f"{name}-{plugin_name}", objs["ServiceAccount"])
            role = self._create(f"{name}-{plugin_name}", objs["ClusterRole"])
            binding = objs["ClusterRoleBinding"]
            binding["roleRef"]["name"] = role.metadata.name
            for subject in binding["subjects"]:
                subject.update(name=sa.metadata.name, namespace=self._ns)
            self._create(f"{name}-{plugin_name}", binding)
            _pod_spec(plugin)["serviceAccountName"] = sa.metadata.name
        self.device_plugin = self._create(f"{name}-{plugin_name}", on_gpu_nodes(plugin, args.gpu_nodes))
        return plugin

    def _create(self, resource_name: str, obj: dict[str, Any], **options: Any) -> pulumi.CustomResource:
        """The typed resource for one object of an add-on file, with the ownership labels; an object
        the file places in SYSTEM_NAMESPACE goes into the Namespace created above (so after it)."""
        namespace = self._ns if obj["metadata"].get("namespace") == SYSTEM_NAMESPACE else None
        opts = pulumi.ResourceOptions.merge(self._child, pulumi.ResourceOptions(**options))
        return addon_resource(resource_name, obj, opts, namespace)

    def _dra_driver(self, name: str, args: AddonArgs, crd: pulumi.Resource) -> list[pulumi.Resource]:
        """The NVIDIA DRA driver (ComputeDomain mode): service accounts, RBAC, DeviceClasses, the controller
        Deployment and the kubelet-plugin DaemonSet on the GPU nodes. Returns what a ComputeDomain waits
        for: both workloads ready (so their RBAC and the CRD exist) and the DeviceClasses."""
        objs = load_addon_objects(DRA_DRIVER_FILE)
        image = args.images.get(DRA_DRIVER, _dra_driver_image())
        self.dra_driver_version = image.split("@", 1)[0].rsplit(":", 1)[1]
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for obj in objs:
            by_kind.setdefault(obj["kind"], []).append(obj)

        def create(obj: dict[str, Any], **options: Any) -> pulumi.CustomResource:
            return self._create(f"{name}-dra-{obj['kind'].lower()}-{obj['metadata']['name']}", obj, **options)

        accounts = {o["metadata"]["name"]: create(o) for o in by_kind["ServiceAccount"]}
        roles = {(o["kind"], o["metadata"]["name"]): create(o) for o in by_kind["ClusterRole"] + by_kind["Role"]}
        bindings = []
        for binding in by_kind["ClusterRoleBinding"] + by_kind["RoleBinding"]:
            ref = binding["roleRef"]
            ref["name"] = roles[ref["kind"], ref["name"]].metadata.name
            for subject in binding["subjects"]:
                subject.update(name=accounts[subject["name"]].metadata.name, namespace=self._ns)
            bindings.append(create(binding))
        classes = [create(o) for o in by_kind["DeviceClass"]]

        def patched(obj: dict[str, Any]) -> dict[str, Any]:
            pod = _pod_spec(obj)
            pod["serviceAccountName"] = accounts[pod["serviceAccountName"]].metadata.name
            for c in pod.get("initContainers", []) + pod["containers"]:
                c["image"] = image
                for env in c.get("env", []):
                    if env["name"] == "IMAGE_NAME":  # what the compute-domain daemons run
                        env["value"] = image
            return obj

        after = [crd, *bindings]
        (controller,) = by_kind["Deployment"]
        (plugin,) = by_kind["DaemonSet"]
        self.dra_controller = create(patched(controller), depends_on=after)
        self.dra_kubelet_plugin = create(on_gpu_nodes(patched(plugin), args.gpu_nodes), depends_on=after)
        return [self.dra_controller, self.dra_kubelet_plugin, *classes]

    def _training_operator(self, name: str, images: Mapping[str, str]) -> dict[str, Any]:
        """Kubeflow training operator limited to PyTorchJob: CRD, RBAC, validating webhook, Deployment.
        References between its objects are pointed at the created objects' outputs, so Pulumi
        creates each object after the ones it names (and deletes it before them)."""
        self.pytorchjob_crd = shipped_crd(f"{name}-pytorchjob-crd", "pytorchjob.yaml", self._child)

        op = load_addon("training-operator.yaml")
        sa = self._create(f"{name}-{OPERATOR}", op["ServiceAccount"])

        def bind(binding: dict[str, Any], role: pulumi.CustomResource) -> dict[str, Any]:
            binding["roleRef"]["name"] = role.metadata.name
            for subject in binding["subjects"]:
                subject.update(name=sa.metadata.name, namespace=self._ns)
            return binding

        role = self._create(f"{name}-{OPERATOR}", op["ClusterRole"])
        self._create(f"{name}-{OPERATOR}", bind(op["ClusterRoleBinding"], role))
        # The operator writes and rotates the certificate in this Secret: Pulumi must not fight over it.
        cert = self._create(f"{name}-{OPERATOR}-webhook-cert", op["Secret"], ignore_changes=["data"])
        cert_role = self._create(f"{name}-{OPERATOR}-cert", op["Role"])
        self._create(f"{name}-{OPERATOR}-cert", bind(op["RoleBinding"], cert_role))
        svc = self._create(f"{name}-{OPERATOR}", op["Service"])

        webhook = op["ValidatingWebhookConfiguration"]
        for hook in webhook["webhooks"]:
            hook["clientConfig"]["service"].update(name=svc.metadata.name, namespace=self._ns)
        # ... and the caBundle it injects into the webhook configuration.
        self._create(f"{name}-{OPERATOR}-webhook", webhook, ignore_changes=["webhooks[*].clientConfig.caBundle"])

        deployment = with_images(op["Deployment"], images)
        pod = _pod_spec(deployment)
        pod["serviceAccountName"] = sa.metadata.name
        for volume in pod["volumes"]:
            if "secret" in volume:
                volume["secret"]["secretName"] = cert.metadata.name
        self.operator = self._create(f"{name}-{OPERATOR}", deployment, depends_on=[self.pytorchjob_crd])
        return deployment
