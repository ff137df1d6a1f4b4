"""`moto_aws`: a real moto server behind a small HTTP stub, for the preflight / verify tests.

boto3 talks HTTP to the stub through `AWS_ENDPOINT_URL`. The stub forwards every request to a
`ThreadedMotoServer`, except the ones a test scripts with `answer` (APIs moto lacks, such as
DescribeCapacityReservations and the EC2 quota; AccessDenied, throttling and slow answers) or
`patch_json` (moto's own answer with a field moto does not fill, e.g. FSx `Lifecycle`). Either
way the client gets a real HTTP answer and botocore parses it as it would AWS's.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import pytest
from moto.server import ThreadedMotoServer


@dataclass
class Answer:
    status: int = 200
    body: str = ""
    content_type: str = "text/xml"
    delay_s: float = 0.0
    patch: Callable[[dict], dict] | None = None  # forward to moto, then edit its JSON answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AwsStub:
    def __init__(self, moto_port: int):
        self.moto_port = moto_port
        self.answers: dict[str, Answer] = {}
        self.seen: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.1 so that the server answers botocore's `Expect: 100-continue` at once: under
            # HTTP/1.0 every PutObject waited botocore's 1 s for a "100 Continue" that never came.
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def handle_any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                label = stub.label(self.command, self.path, self.headers, body)
                stub.seen.append(label)
                answer = next((a for k, a in stub.answers.items() if re.fullmatch(k, label)), None)
                if answer and answer.delay_s:
                    time.sleep(answer.delay_s)
                if answer and answer.patch is None:
                    status, headers, out = answer.status, {"Content-Type": answer.content_type}, answer.body.encode()
                else:
                    status, headers, out = stub.forward(self.command, self.path, self.headers, body)
                    if answer:
                        out = json.dumps(answer.patch(json.loads(out))).encode()
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(out)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out on a delayed answer, as the test meant it to

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = handle_any

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def label(method: str, path: str, headers, body: bytes) -> str:
        """The API action: `X-Amz-Target` (JSON protocols), `Action=` (query protocols), else METHOD /path."""
        if headers.get("X-Amz-Target"):
            return headers["X-Amz-Target"].rsplit(".", 1)[-1]
        if "x-www-form-urlencoded" in (headers.get("Content-Type") or ""):
            action = parse_qs(body.decode()).get("Action")
            if action:
                return action[0]
        return f"{method} {path}"

    def forward(self, method: str, path: str, headers, body: bytes) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.moto_port, timeout=30)
        conn.request(method, path, body=body or None, headers={k: v for k, v in headers.items()})
        resp = conn.getresponse()
        out = resp.read()
        conn.close()
        return resp.status, dict(resp.getheaders()), out

    def answer(self, label: str, answer: Answer) -> None:
        self.answers[label] = answer

    # Answers as AWS writes them (the test files reach these through the fixture, not by import).
    Answer = Answer

    @staticmethod
    def ec2_error(code: str, message: str, status: int = 400) -> Answer:
        return Answer(
            status,
            f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error></Errors><RequestID>stub</RequestID></Response>",
        )

    @staticmethod
    def json_answer(doc: dict, status: int = 200) -> Answer:
        return Answer(status, json.dumps(doc), "application/x-amz-json-1.1")

    @staticmethod
    def json_error(code: str, message: str, status: int = 400) -> Answer:
        return Answer(status, json.dumps({"__type": code, "message": message}), "application/x-amz-json-1.1")

    @staticmethod
    def closed_url() -> str:
        """An endpoint nobody listens on."""
        return f"http://127.0.0.1:{free_port()}"

    def patch_json(self, label: str, patch: Callable[[dict], dict]) -> None:
        self.answers[label] = Answer(patch=patch)

    def reset(self) -> None:
        """Forget scripted answers. moto's state is kept (a moto reset costs seconds of data reloading
        per test), so tests name what they create uniquely (`unique`)."""
        self.answers.clear()
        self.seen.clear()

    @staticmethod
    def unique(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _warm_up(url: str) -> None:
    """moto loads its EC2 instance-type data on first use, which takes over 10 s on a loaded 2-core
    machine: load it once, with a generous timeout, before tests that use the checks' short ones."""
    import boto3
    from botocore.config import Config

    ec2 = boto3.client(
        "ec2",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(read_timeout=300, retries={"max_attempts": 1}),
    )
    ec2.describe_instance_types(InstanceTypes=["p5.48xlarge"])
    ec2.describe_instance_type_offerings(LocationType="availability-zone")


@pytest.fixture(scope="session")
def _moto_stub() -> Iterator[AwsStub]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    _warm_up(f"http://127.0.0.1:{port}")
    stub = AwsStub(port)
    yield stub
    stub.server.shutdown()
    server.stop()


@contextmanager
def boto3_pointed_at(stub: AwsStub, scratch: Path) -> Iterator[AwsStub]:
    """The environment boto3 reads, pointed at the stub: dummy credentials, no local AWS config, one
    attempt per call (errors surface at once; retrying is botocore's job). Restored on exit."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
            mp.delenv(var, raising=False)
        mp.setenv("AWS_CONFIG_FILE", str(scratch / "no-aws-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(scratch / "no-aws-credentials"))
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_ENDPOINT_URL", stub.url)
        mp.setenv("AWS_MAX_ATTEMPTS", "1")
        yield stub


@pytest.fixture
def moto_aws(_moto_stub: AwsStub, tmp_path: Path) -> Iterator[AwsStub]:
    """The stub with no scripted answers, boto3 pointed at it for this test."""
    _moto_stub.reset()
    with boto3_pointed_at(_moto_stub, tmp_path) as stub:
        yield stub


@pytest.fixture(scope="module")
def moto_aws_module(_moto_stub: AwsStub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AwsStub]:
    """boto3 pointed at the stub for a whole test module, to deploy state that several tests read."""
    with boto3_pointed_at(_moto_stub, tmp_path_factory.mktemp("aws")) as stub:
        yield stub
