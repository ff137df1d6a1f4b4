"""Credentials of the inference API: a private CA, a server certificate it signs and an API key. Used by
the cluster's serving workload (components/k8s/credentials.py, once, kept in the stack's state) and by
`supernode serve --local --tls` (a fresh set per server, supernode/tools/serve.py)."""

from __future__ import annotations


def generate(dns_names: list[str], valid_days: int = 397, ip_addresses: tuple[str, ...] = ()) -> dict[str, str]:
    """A CA, a server certificate for `dns_names` (and `ip_addresses`) signed by it (ECDSA P-256) and a
    256-bit API key, as PEM text: ca_pem, cert_pem, key_pem (PKCS#8, unencrypted), api_key."""
    import datetime
    import ipaddress
    import secrets

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    until = now + datetime.timedelta(days=valid_days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("supernode serving CA"))
        .issuer_name(name("supernode serving CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name(dns_names[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return {
        "ca_pem": ca.public_bytes(pem).decode(),
        "cert_pem": cert.public_bytes(pem).decode(),
        "key_pem": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode(),
        "api_key": secrets.token_urlsafe(32),
    }
