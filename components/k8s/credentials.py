"""The inference API's credentials: a private CA and the server certificate it signs (TLS on the API
port, vLLM's own --ssl-keyfile/--ssl-certfile), and an API key (vLLM's VLLM_API_KEY), as Kubernetes
Secrets in the serving namespace.

Why these and not cert-manager or an ACM-backed load balancer (docs/architecture.md, "Serving: TLS and
authentication"): an ACM certificate terminates TLS at the load balancer, leaving the hop to the pod
plain, and the endpoint is deliberately not behind a load balancer (ClusterIP only, the
serving-not-public policy); cert-manager would be one more controller with its CRDs and webhooks to pin
and run for a single certificate. Here a Pulumi dynamic resource generates them once with `cryptography`
(create runs in the deploying process; nothing is downloaded, no provider plugin), and keeps them in the
stack's state as secrets: the same certificate and key on every update, new ones when the service's DNS
names change or on `pulumi up --replace` of the resource (rotation is an operator's step: the
certificate is valid VALID_DAYS days). Clients in the allowed namespaces verify the server against the
`serving_ca` stack output (also the Secret's ca.crt and the `serving-ca` ConfigMap the serving
Prometheus reads) and present the key from the `serving_api_key` output.
"""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi.dynamic as dynamic
import pulumi_kubernetes as k8s

from supernode.core.credentials import generate

from .common import meta

VALID_DAYS = 397  # the CA/Browser Forum's ceiling for a server certificate, kept here too
TLS_SECRET, API_KEY_SECRET, CA_CONFIGMAP = "serving-tls", "serving-api-key", "serving-ca"
OUTPUTS = ("ca_pem", "cert_pem", "key_pem", "api_key")


class _Provider(dynamic.ResourceProvider):
    def create(self, props: dict[str, Any]) -> dynamic.CreateResult:
        import uuid

        made = generate(list(props["dns_names"]), int(props["valid_days"]))
        return dynamic.CreateResult(id_=uuid.uuid4().hex, outs={**props, **made})

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> dynamic.DiffResult:
        changed = [k for k in ("dns_names", "valid_days") if olds.get(k) != news.get(k)]
        return dynamic.DiffResult(changes=bool(changed), replaces=changed, delete_before_replace=False)


class ServingCredentials(dynamic.Resource):
    ca_pem: pulumi.Output[str]
    cert_pem: pulumi.Output[str]
    key_pem: pulumi.Output[str]
    api_key: pulumi.Output[str]

    def __init__(self, name: str, dns_names: pulumi.Input[list[str]], opts: pulumi.ResourceOptions | None = None):
        props = {"dns_names": dns_names, "valid_days": VALID_DAYS, **dict.fromkeys(OUTPUTS)}
        secret = pulumi.ResourceOptions(additional_secret_outputs=["key_pem", "api_key"])
        super().__init__(_Provider(), name, props, pulumi.ResourceOptions.merge(opts, secret))


def serving_credentials(
    resource: str, service_dns: pulumi.Input[str], namespace: pulumi.Input[str], opts: pulumi.ResourceOptions
) -> tuple[ServingCredentials, k8s.core.v1.Secret, k8s.core.v1.Secret]:
    """The credentials and their two Secrets in the serving namespace: `serving-tls` (kubernetes.io/tls:
    tls.crt, tls.key, ca.crt), which the server mounts, and `serving-api-key` (api-key), which it reads
    into VLLM_API_KEY. `service_dns`: the Service's `NAME.NAMESPACE.svc` (the certificate also names
    `NAME.NAMESPACE.svc.cluster.local` and `NAME.NAMESPACE`)."""
    names = pulumi.Output.from_input(service_dns).apply(lambda d: [d, f"{d}.cluster.local", d.removesuffix(".svc")])
    creds = ServingCredentials(resource, names, opts)
    self_opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[creds]))
    tls = k8s.core.v1.Secret(
        f"{resource}-tls",
        metadata=meta(TLS_SECRET, namespace),
        type="kubernetes.io/tls",
        string_data={
            "tls.crt": pulumi.Output.secret(creds.cert_pem),
            "tls.key": pulumi.Output.secret(creds.key_pem),
            "ca.crt": creds.ca_pem,
        },
        opts=self_opts,
    )
    api_key = k8s.core.v1.Secret(
        f"{resource}-api-key",
        metadata=meta(API_KEY_SECRET, namespace),
        type="Opaque",
        string_data={"api-key": pulumi.Output.secret(creds.api_key)},
        opts=self_opts,
    )
    return creds, tls, api_key
