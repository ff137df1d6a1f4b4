"""A real local HTTP(S) server answering the OpenAI completions API as vLLM streams it (server-sent
events, a usage chunk, `[DONE]`), with an answer, a delay before the first token and between tokens,
and an API key of the test's choosing: what `supernode verify`'s serving request is tested against."""

from __future__ import annotations

import json
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Behaviour:
    tokens: tuple[str, ...] = (" Paris", ".", " It", " is")
    first_token_s: float = 0.0  # before the first chunk: the TTFT the client sees
    between_tokens_s: float = 0.0  # between chunks: the ITL
    api_key: str | None = None  # requests without "Bearer <key>" get 401, as vLLM's --api-key


class _Handler(BaseHTTPRequestHandler):
    behaviour: Behaviour
    requests: list[dict]

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        b = self.behaviour
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append({"path": self.path, "body": body, "authorization": self.headers.get("Authorization")})
        if b.api_key is not None and self.headers.get("Authorization") != f"Bearer {b.api_key}":
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": "Unauthorized"}')
            return
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(b.first_token_s)
        for i, token in enumerate(b.tokens):
            if i:
                time.sleep(b.between_tokens_s)
            self._event({"object": "text_completion", "model": body["model"], "choices": [{"index": 0, "text": token}]})
        self._event({"choices": [], "usage": {"completion_tokens": len(b.tokens)}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, chunk: dict) -> None:
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()


@contextmanager
def completions_server(behaviour: Behaviour, tls: dict[str, str] | None = None) -> Iterator[tuple[str, list[dict]]]:
    """(base URL, the requests it received); `tls`: supernode.core.credentials.generate's PEMs."""
    handler = type("Handler", (_Handler,), {"behaviour": behaviour, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    with tempfile.TemporaryDirectory() as d:
        if tls is not None:
            for name in ("cert_pem", "key_pem"):
                (Path(d) / name).write_text(tls[name], encoding="utf-8")
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(Path(d) / "cert_pem", Path(d) / "key_pem")
            server.socket = context.wrap_socket(server.socket, server_side=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}", handler.requests
        finally:
            server.shutdown()
            server.server_close()
