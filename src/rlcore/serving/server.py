"""The endpoint's HTTP layer: a stdlib ``ThreadingHTTPServer`` on the loopback, over a :class:`ChatService`.

Routes, each also under ``/rollouts/<rollout_id>`` (the episode's base URL, so a client keeps the rollout id without
custom headers): ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, and vLLM's
``POST /tokenize`` and ``POST /detokenize`` (served with or without the ``/v1``). Every response closes
its connection (HTTP/1.0), so closing the server leaves no connection or thread behind: :meth:`PolicyServer.close`
stops the listener and joins every request thread.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlcore.serving.openai_api import ApiError, sse_events, streamed
from rlcore.serving.service import ChatService

#: ``[/rollouts/<id>]/v1/<route>``; a rollout id is letters, digits, ``.``, ``_`` and ``-``.
ROUTE = re.compile(
    r"^(?:/rollouts/(?P<rollout>[A-Za-z0-9._-]+))?"
    r"(?:/v1/(?P<route>chat/completions|completions|models)|(?:/v1)?/(?P<tokens>tokenize|detokenize))/?$"
)
#: The largest request body read (a long conversation's JSON is far below it).
MAX_BODY_BYTES = 64 << 20


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # request threads are joined by server_close
    block_on_close = True
    request_queue_size = 1024  # every episode of a rollout may connect at once
    service: ChatService


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"
    timeout = 60  # a client that opens a connection and sends nothing does not hold a thread for ever

    def do_GET(self) -> None:
        match = ROUTE.match(self.path)
        if match is None or match["route"] != "models":
            self._send(404, ApiError(404, f"no route GET {self.path}").body())
            return
        self._send(200, self.server.service.models())

    def do_POST(self) -> None:
        match = ROUTE.match(self.path)
        if match is None or match["route"] == "models":
            self._send(404, ApiError(404, f"no route POST {self.path}").body())
            return
        try:
            body = self._json()
            service = self.server.service
            if match["tokens"] is not None:  # stateless: the rollout id, if any, changes nothing
                answer = service.tokenize(body) if match["tokens"] == "tokenize" else service.detokenize(body)
            elif match["route"] == "chat/completions":
                answer = service.chat(match["rollout"], body)
            else:
                answer = service.completion(match["rollout"], body)
        except ApiError as exc:
            self._send(exc.status, exc.body())
            return
        except Exception as exc:  # a bug of ours: the client hears of it rather than waiting
            error = ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error")
            self._send(500, error.body())
            return
        stream, include_usage = streamed(body)
        if stream:
            self._send_bytes(200, sse_events(answer, include_usage), "text/event-stream")
        else:
            self._send(200, answer)

    def _json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is {length} bytes, more than {MAX_BODY_BYTES}")
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except ValueError as exc:
            raise ApiError(400, f"the request body is not JSON: {exc}") from None

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        self._send_bytes(status, json.dumps(payload).encode("utf-8"), "application/json")

    def _send_bytes(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        pass  # one line per request would drown the run's log


class PolicyServer:
    """Serves ``service`` on ``host:port`` (port 0: an ephemeral one) from :meth:`start` (or ``with``) to
    :meth:`close`."""

    def __init__(self, service: ChatService, host: str = "127.0.0.1", port: int = 0) -> None:
        self.service, self.host, self.port = service, host, port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> PolicyServer:
        server = _Server((self.host, self.port), _Handler)
        server.service = self.service
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, name="rlcore-openai-endpoint", daemon=True)
        self._thread.start()
        return self

    @property
    def base_url(self) -> str:
        """The URL of requests without a rollout id (ends in ``/v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    def url_for(self, rollout_id: str) -> str:
        """The base URL of rollout ``rollout_id``'s episode (ends in ``/v1``)."""
        return f"http://{self.host}:{self.port}/rollouts/{rollout_id}/v1"

    def close(self) -> None:
        """Stop listening and join the request threads still running (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def exposed_endpoint(cfg: Any, generation: Any, tokenizer: Any, pad_id: int) -> Iterator[PolicyServer | None]:
    """Serve the endpoint (requests without a rollout id: ``/v1``) for the block when run config ``cfg`` sets
    ``policy.generation.expose_http_server``, printing its URL; yields the server, or None when it is off."""
    from rlcore.interfaces.generation import serves_continuously
    from rlcore.serving.checks import NOT_CONTINUOUS
    from rlcore.serving.service import ServingSettings

    settings = getattr(getattr(cfg, "policy", None), "generation", None)
    if not getattr(settings, "expose_http_server", False):  # off, or a stand-in config without the section
        yield None
        return
    if not serves_continuously(generation):
        what = "policy.generation.expose_http_server: true"
        raise ValueError(NOT_CONTINUOUS.format(backend=cfg.policy.generation.backend, what=what))
    service = ChatService(generation, tokenizer, ServingSettings.from_config(cfg, pad_id))
    with PolicyServer(service) as server:
        print(f"policy served at {server.base_url} (OpenAI-compatible; policy.generation.expose_http_server)")
        yield server
