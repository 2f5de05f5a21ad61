"""A scripted OpenAI-compatible chat endpoint for rl-verifiers' tests (stdlib only, 127.0.0.1).

Like rlcore's endpoint it serves ``/rollouts/<rollout_id>/v1/chat/completions``, answers whole completions and
refuses ``stream: true``; each rollout id answers from its own script, in order (a script entry ``{"status": 400}``
answers that error). Every request is kept, per rollout id.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ScriptedEndpoint:
    def __init__(self, model: str = "policy") -> None:
        self.model = model
        self.scripts: dict[str, list[dict[str, Any]]] = {}
        self.requests: dict[str, list[dict[str, Any]]] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def base_url(self, rollout_id: str) -> str:
        return f"http://127.0.0.1:{self._server.server_port}/rollouts/{rollout_id}/v1"

    def __enter__(self) -> ScriptedEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _answer(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        parts = path.strip("/").split("/")
        if len(parts) != 5 or parts[0] != "rollouts" or parts[2:] != ["v1", "chat", "completions"]:
            return 404, {"error": {"message": f"no route {path}"}}
        rollout = parts[1]
        self.requests.setdefault(rollout, []).append(body)
        if body.get("stream"):
            return 400, {"error": {"message": "stream: streaming is not served; send stream: false"}}
        script = self.scripts.get(rollout) or [{"content": "(script ended)"}]
        reply = script.pop(0)
        if "status" in reply:
            return reply["status"], {"error": {"message": "scripted failure", "type": "invalid_request_error"}}
        message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
        if "tool_calls" in reply:
            message["tool_calls"] = reply["tool_calls"]
        finish = "tool_calls" if "tool_calls" in reply else "stop"
        return 200, {
            "id": f"chatcmpl-{rollout}-{len(self.requests[rollout])}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", self.model),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                status, answer = endpoint._answer(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


def tool_call(name: str, arguments: dict[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    """A script entry: one function tool call."""
    return {
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        ],
    }
