"""Who is asking, in the cluster's management page (issue 37, item 2), and the audit log of what they did.

The page sits behind an internal ALB whose HTTPS listener authenticates people with the organisation's
OIDC provider (components/aws/management.py). The ALB then adds `x-amzn-oidc-data` to every request it
forwards: a JWT of the person's user-info claims, signed by the ALB (ES256) with a key it publishes at
https://public-keys.auth.elb.REGION.amazonaws.com/KID, naming itself in the JWT header's `signer`.
`AlbIdentity.verify` checks exactly that: the algorithm, the signer (this stack's ALB, never another
one's), the signature against the published key, the expiry. A request without the header, or with
one that fails any check, is 401: a pod that reaches the page around the ALB cannot forge an identity.

Authorisation is the CLI's: the groups claim lists the person's groups, and `supernode:team:<name>` lets
them see, submit and cancel that team's jobs (the team Role's rights); `supernode:admins` sees every
team's jobs and changes none (the admin ClusterRole's).

The audit log: one JSON record per submit and cancel (who, team, job, action, result), written with
PutLogEvents into the stack's audit log group through the page's own IRSA role (which may do nothing
else), and the same line on stdout. Why PutLogEvents rather than stdout through a log agent: the
audit trail is a log group of its own, with its own retention and a writer that is this process only
(an agent shipping container stdout would mix it with every pod's output and could be configured away).
"""

from __future__ import annotations

import base64
import json
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from supernode.core import teams as names

IDENTITY_HEADER = "x-amzn-oidc-data"
KEY_URL = "https://public-keys.auth.elb.{region}.amazonaws.com/{kid}"
KID_RE = re.compile(r"^[A-Za-z0-9-]{1,128}$")  # it goes into the key's URL


class Unauthenticated(Exception):
    """No identity, or one the page cannot trust: answered 401 with the reason."""


@dataclass(frozen=True)
class Viewer:
    """An authenticated person and what the team groups let them do."""

    who: str
    groups: frozenset[str]
    sees: frozenset[str]  # the teams whose jobs they see
    acts: frozenset[str]  # the teams they submit and cancel for


def viewer_for(who: str, groups: Sequence[str], teams: Sequence[str]) -> Viewer:
    """The CLI's groups, read the CLI's way: a team's group acts in that team; the admin group reads all."""
    groups_set = frozenset(groups)
    acts = frozenset(t for t in teams if names.group(t) in groups_set)
    sees = frozenset(teams) if names.ADMIN_GROUP in groups_set else acts
    return Viewer(who=who, groups=groups_set, sees=sees, acts=acts)


def _b64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def fetch_key(region: str, kid: str) -> bytes:
    """The ALB's public key (PEM) for `kid`, from the region's endpoint."""
    with urllib.request.urlopen(KEY_URL.format(region=region, kid=kid), timeout=5) as r:  # noqa: S310 (https, fixed host)
        return r.read()


class AlbIdentity:
    """Verifies the ALB's identity header; `fetch` (region, kid) -> PEM, cached per kid."""

    def __init__(
        self,
        region: str,
        signer: str,
        groups_claim: str,
        teams: Sequence[str],
        fetch: Callable[[str, str], bytes] = fetch_key,
        clock: Callable[[], float] = time.time,
    ):
        self.region, self.signer, self.groups_claim, self.teams = region, signer, groups_claim, list(teams)
        self.fetch, self.clock = fetch, clock
        self._keys: dict[str, ec.EllipticCurvePublicKey] = {}

    def _key(self, kid: str) -> ec.EllipticCurvePublicKey:
        if kid not in self._keys:
            try:
                key = serialization.load_pem_public_key(self.fetch(self.region, kid))
            except (OSError, ValueError) as e:
                raise Unauthenticated(f"the load balancer's key {kid} could not be read ({e})") from None
            if not isinstance(key, ec.EllipticCurvePublicKey):
                raise Unauthenticated(f"the load balancer's key {kid} is not an EC key")
            self._keys[kid] = key
        return self._keys[kid]

    def claims(self, token: str | None) -> dict[str, Any]:
        """The token's claims, once every check passed; Unauthenticated naming the first that failed."""
        if not token:
            raise Unauthenticated(f"no {IDENTITY_HEADER} header: the page is reached through its load balancer")
        try:
            head_b64, body_b64, sig_b64 = token.split(".")
            header, claims, sig = json.loads(_b64(head_b64)), json.loads(_b64(body_b64)), _b64(sig_b64)
        except (ValueError, TypeError):
            raise Unauthenticated(f"{IDENTITY_HEADER} is not a JWT") from None
        if not isinstance(header, dict) or not isinstance(claims, dict):
            raise Unauthenticated(f"{IDENTITY_HEADER} is not a JWT")
        if header.get("alg") != "ES256":
            raise Unauthenticated(f"{IDENTITY_HEADER} alg {header.get('alg')!r}: the load balancer signs ES256")
        if header.get("signer") != self.signer:
            raise Unauthenticated(
                f"{IDENTITY_HEADER} signed by {header.get('signer')!r}, not this page's load balancer"
            )
        kid = header.get("kid")
        if not isinstance(kid, str) or not KID_RE.fullmatch(kid) or len(sig) != 64:
            raise Unauthenticated(f"{IDENTITY_HEADER} has no usable key id or signature")
        der = encode_dss_signature(int.from_bytes(sig[:32], "big"), int.from_bytes(sig[32:], "big"))
        try:
            self._key(kid).verify(der, f"{head_b64}.{body_b64}".encode(), ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            raise Unauthenticated(f"{IDENTITY_HEADER}: the signature does not verify") from None
        exp = header.get("exp", claims.get("exp"))
        if not isinstance(exp, (int, float)) or exp < self.clock():
            raise Unauthenticated(f"{IDENTITY_HEADER} has expired: reload the page to log in again")
        return claims

    def viewer(self, token: str | None) -> Viewer:
        claims = self.claims(token)
        who = claims.get("email") or claims.get("sub")
        if not isinstance(who, str) or not who:
            raise Unauthenticated(f"{IDENTITY_HEADER} names no person (no email or sub claim)")
        raw = claims.get(self.groups_claim) or []
        groups = [g.strip() for g in raw.split(",")] if isinstance(raw, str) else [str(g) for g in raw]
        return viewer_for(who, groups, self.teams)


class AuditLog:
    """One JSON record per submit or cancel: on stdout, and into `log_group` (PutLogEvents through the
    page's IRSA role) where one is given. `client`: a boto3 CloudWatch Logs client (tests pass a stub)."""

    def __init__(self, log_group: str | None, stream: str, client: Any = None, out=None):
        self.log_group, self.stream, self.out = log_group, stream, out or sys.stdout
        self._client, self._lock, self._stream_made = client, threading.Lock(), False

    def record(self, who: str, team: str, job: str, action: str, result: str, message: str = "") -> dict[str, Any]:
        entry = {
            "time": round(time.time(), 3),
            "who": who,
            "team": team,
            "job": job,
            "action": action,
            "result": result,
            "message": message,
        }
        line = json.dumps(entry, sort_keys=True)
        print(f"audit {line}", file=self.out, flush=True)
        if self.log_group:
            self._put(line, int(entry["time"] * 1000))
        return entry

    def _put(self, line: str, millis: int) -> None:
        with self._lock:  # one writer of the stream at a time (PutLogEvents orders a stream's events)
            try:
                client = self._client or self._make_client()
                if not self._stream_made:
                    try:
                        client.create_log_stream(logGroupName=self.log_group, logStreamName=self.stream)
                    except client.exceptions.ResourceAlreadyExistsException:
                        pass
                    self._stream_made = True
                client.put_log_events(
                    logGroupName=self.log_group,
                    logStreamName=self.stream,
                    logEvents=[{"timestamp": millis, "message": line}],
                )
            except Exception as e:  # the action happened: say loudly that its record did not land
                print(f"audit: the record did not reach {self.log_group} ({e}): {line}", file=sys.stderr, flush=True)

    def _make_client(self) -> Any:
        import boto3

        self._client = boto3.client("logs")
        return self._client
