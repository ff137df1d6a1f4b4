"""Shared machinery for `preflight` and `verify`: a check result, AWS clients, and a runner.

Each check runs on its own: an AWS error (access denied, throttling, a timeout, an unreachable
endpoint, an API the endpoint does not implement) becomes that check's clear message and the
other checks still run. Clients come from boto3's standard chain, so credentials,
`AWS_ENDPOINT_URL` (and `AWS_ENDPOINT_URL_<SERVICE>`) and `AWS_MAX_ATTEMPTS` work as usual; the
region is the stack's, since that is where the stack lives.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import boto3
import botocore.loaders
import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)
from botocore.parsers import ResponseParserError
from pydantic import BaseModel, ConfigDict
from rich.console import Console
from rich.table import Table
from rich.text import Text

Result = Literal["pass", "fail", "warn"]

ACCESS_DENIED = {
    "AccessDenied",
    "AccessDeniedException",
    "UnauthorizedOperation",
    "UnauthorizedAccess",
    "AuthorizationError",
    "AuthFailure",
    "Forbidden",
    "403",
}
THROTTLED = {
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "RequestThrottled",
    "RequestThrottledException",
    "SlowDown",
    "ProvisionedThroughputExceededException",
}
# Error codes meaning "this endpoint does not offer the API", as opposed to "the answer is no".
UNSUPPORTED = {
    "InvalidAction",
    "UnsupportedOperation",
    "NotImplemented",
    "UnknownOperationException",
    "NoSuchResourceException",
    "500",
    "501",
}
UNANSWERED_FIX = "check it by hand in the AWS console or CLI"


class Check(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    result: Result
    detail: str
    fix: str = ""


def passed(name: str, detail: str) -> Check:
    return Check(name=name, result="pass", detail=detail)


def failed(name: str, detail: str, fix: str) -> Check:
    return Check(name=name, result="fail", detail=detail, fix=fix)


def warned(name: str, detail: str, fix: str) -> Check:
    return Check(name=name, result="warn", detail=detail, fix=fix)


_LOADER = botocore.loaders.create_loader()


def new_session() -> boto3.session.Session:
    """A session that reads credentials and settings afresh but shares the parsed API models: loading
    EC2's model alone takes about a second, per session."""
    core = botocore.session.Session()
    core.register_component("data_loader", _LOADER)
    return boto3.session.Session(botocore_session=core)


@dataclass
class Aws:
    """boto3 clients for one region, with short timeouts and few retries so a dead endpoint fails fast."""

    region: str
    connect_timeout: float = 3.0
    read_timeout: float = 10.0
    _clients: dict[str, Any] = field(default_factory=dict, repr=False)
    _session: boto3.session.Session = field(default_factory=new_session, repr=False)

    def client(self, service: str, region: str | None = None) -> Any:
        key = f"{service}@{region or self.region}"
        if key not in self._clients:
            config = Config(
                connect_timeout=self.connect_timeout,
                read_timeout=self.read_timeout,
                retries={"mode": "standard", "total_max_attempts": max_attempts()},
            )
            self._clients[key] = self._session.client(service, region_name=region or self.region, config=config)
        return self._clients[key]


def max_attempts() -> int:
    try:
        return max(1, int(os.environ.get("AWS_MAX_ATTEMPTS", "3")))
    except ValueError:
        return 3


def is_unsupported(e: Exception) -> bool:
    """The endpoint could not answer this API (not implemented, not offered here), as opposed to an answer."""
    if isinstance(e, ResponseParserError):
        return True
    return isinstance(e, ClientError) and error_code(e) in UNSUPPORTED


def error_code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


def describe_error(e: Exception) -> tuple[str, str]:
    """(detail, fix) for an exception raised while a check talked to AWS."""
    if isinstance(e, ClientError):
        code, op = error_code(e), e.operation_name
        message = e.response.get("Error", {}).get("Message") or ""
        said = f"{code}: {message}" if message else code
        if code in ACCESS_DENIED:
            return (
                f"access denied calling {op} ({said})",
                f"grant the IAM permission for {op} to these credentials (`aws sts get-caller-identity` shows who)",
            )
        if code in THROTTLED:
            return (
                f"throttled by AWS calling {op} after {max_attempts()} attempt(s) ({code})",
                "run again later, or raise AWS_MAX_ATTEMPTS",
            )
        if code in UNSUPPORTED:
            return (f"cannot be checked: the endpoint does not answer {op} ({said})", UNANSWERED_FIX)
        return f"{op} failed ({said})", "see the AWS error above"
    if isinstance(e, (ConnectTimeoutError, ReadTimeoutError)):
        return (
            f"timed out talking to {_endpoint(e)}",
            "check network access to AWS (proxy, VPC endpoints) and AWS_ENDPOINT_URL; then run again",
        )
    if isinstance(e, (EndpointConnectionError, ConnectionClosedError)):
        return (
            f"AWS endpoint unreachable: {_endpoint(e)}",
            "check network access to AWS, the region and AWS_ENDPOINT_URL",
        )
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return ("no usable AWS credentials", "configure credentials (AWS_PROFILE, aws configure, or an instance role)")
    if isinstance(e, ResponseParserError):
        return (
            "cannot be checked: the endpoint answered with an unreadable response (API not implemented there?)",
            UNANSWERED_FIX,
        )
    if isinstance(e, BotoCoreError):
        return f"AWS client error: {e}", "see the error above"
    return f"internal error in this check: {type(e).__name__}: {e}", "report this as a supernode bug"


def _endpoint(e: Exception) -> str:
    """scheme://host[:port] of the request that failed (botocore gives the whole URL)."""
    url = urlsplit(str(getattr(e, "kwargs", {}).get("endpoint_url", "")))
    return f"{url.scheme}://{url.netloc}" if url.netloc else "AWS"


Probe = Callable[[], Check]


@dataclass(frozen=True)
class Step:
    """One check to run: `probe` returns its Check. If it raises, the error becomes the check's
    message, reported as `on_error`, or as `on_unsupported` when the endpoint lacks the API."""

    name: str
    probe: Probe
    on_error: Result = "fail"
    on_unsupported: Result | None = None
    hint: str = ""  # how to check by hand, added to the fix when AWS could not answer


def run_checks(steps: Iterable[Step]) -> list[Check]:
    """Every step's Check. Without usable credentials no check can run: that is said once, as one
    failed "aws credentials" check, instead of once per check."""
    out = []
    for step in steps:
        try:
            out.append(step.probe())
        except (NoCredentialsError, PartialCredentialsError) as e:
            detail, fix = describe_error(e)
            return out + [
                Check(
                    name="aws credentials",
                    result="fail",
                    detail=f"{detail}: no check could run (stopped at {step.name!r})",
                    fix=fix,
                )
            ]
        except Exception as e:  # noqa: BLE001 - every failure becomes this check's message
            detail, fix = describe_error(e)
            result = step.on_unsupported if step.on_unsupported and is_unsupported(e) else step.on_error
            fix = f"{fix}; {step.hint}" if step.hint else fix
            out.append(Check(name=step.name, result=result, detail=detail, fix=fix))
    return out


def failures(checks: list[Check]) -> int:
    return sum(c.result == "fail" for c in checks)


def warnings(checks: list[Check]) -> int:
    return sum(c.result == "warn" for c in checks)


def to_json(command: str, stack: str, checks: list[Check], strict: bool = False) -> str:
    """Stable output: checks sorted by name, keys sorted, so the same state gives the same bytes.
    `strict`: a warning (a check that could not be made) is not ok either."""
    counts = {r: sum(c.result == r for c in checks) for r in ("pass", "fail", "warn")}
    doc = {
        "command": command,
        "stack": stack,
        "ok": counts["fail"] == 0 and not (strict and counts["warn"]),
        "counts": counts,
        "checks": [c.model_dump() for c in sorted(checks, key=lambda c: (c.name, c.result, c.detail))],
    }
    return json.dumps(doc, indent=2, sort_keys=True)


STYLE = {"pass": "green", "fail": "bold red", "warn": "yellow"}


def render(title: str, checks: list[Check], console: Console) -> None:
    t = Table(title=title, show_header=True, header_style="bold", show_lines=False)
    for col in ("check", "result", "detail"):
        t.add_column(col, overflow="fold")
    for c in checks:
        # Text, not markup: details quote AWS messages and lists that contain brackets.
        t.add_row(Text(c.name), Text(c.result, style=STYLE[c.result]), Text(c.detail))
    console.print(t)
    # Fixes below the table, one per line and never wrapped: they hold commands to copy.
    for c in checks:
        if c.fix and c.result != "pass":
            console.print(Text.assemble((f"fix {c.name}: ", STYLE[c.result]), c.fix), soft_wrap=True)
    n = failures(checks)
    warns = warnings(checks)
    console.print(f"{len(checks)} checks: {len(checks) - n - warns} pass, {n} fail, {warns} warn")
