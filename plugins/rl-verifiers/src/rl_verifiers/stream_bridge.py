"""A loopback bridge that serves streamed chat completions over an endpoint that answers whole ones.

verifiers' chat program always asks for ``stream: true``, and its interception server relays that request as is;
rlcore's endpoint answers whole completions. The bridge sits between the two for one episode: it forwards each
request to the endpoint without ``stream``/``stream_options`` and, when the request asked to stream, frames the
endpoint's completion as server-sent events (one chunk holding the whole message, its finish reason and usage,
then ``[DONE]``). Token ids and logprobs are the endpoint's, untouched; other requests pass through unchanged.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any


def sse_events(completion: dict[str, Any]) -> bytes:
    """A ``chat.completion`` as the server-sent events of one ``chat.completion.chunk`` and ``[DONE]``."""
    choice = (completion.get("choices") or [{}])[0]
    delta = dict(choice.get("message") or {"role": "assistant", "content": ""})
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(delta["tool_calls"])]
    chunk_choice = {"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}
    if choice.get("logprobs") is not None:
        chunk_choice["logprobs"] = choice["logprobs"]
    chunk = {**{k: v for k, v in completion.items() if k != "choices"}, "object": "chat.completion.chunk"}
    chunk["choices"] = [chunk_choice]
    return f"data: {json.dumps(chunk)}\n\n".encode() + b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def stream_bridge(base_url: str) -> AsyncIterator[str]:
    """Serve the bridge to ``base_url`` (an OpenAI ``.../v1`` URL) on 127.0.0.1; yields the bridge's own base URL."""
    import aiohttp
    from aiohttp import web

    upstream = base_url.rstrip("/")

    async def forward(request: web.Request) -> web.StreamResponse:
        path = request.match_info["tail"]
        body = await request.read()
        streamed = False
        if request.method == "POST" and path.endswith("chat/completions") and body:
            payload = json.loads(body)
            if isinstance(payload, dict):
                streamed = payload.pop("stream", None) is True
                payload.pop("stream_options", None)
                body = json.dumps(payload).encode()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        async with session.request(request.method, f"{upstream}/{path}", data=body or None, headers=headers) as reply:
            content = await reply.read()
            if not streamed or reply.status != 200:
                return web.Response(body=content, status=reply.status, content_type=reply.content_type)
        return web.Response(body=sse_events(json.loads(content)), content_type="text/event-stream")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/v1/{tail:.*}", forward)  # the tail goes after base_url
    runner = web.AppRunner(app, access_log=None)
    # No total timeout: a turn takes as long as the engine takes (the episode's own deadlines bound it).
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            await runner.cleanup()
