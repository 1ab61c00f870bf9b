"""A scripted OpenAI-compatible streaming server in a thread, for the benchmark's own tests.

The prompt (or chat message) picks the behaviour:
  "ok …"          max_tokens chunks of one word, then a usage chunk and [DONE]
  "nousage …"     the same without the usage chunk
  "errorevent …"  two chunks, then an error event
  "http500 …"     HTTP 500 with a JSON error body
  "empty …"       only [DONE]
Chat streams start with a role-only chunk, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web

CHUNK_DELAY_S = 0.002


@dataclass
class FakeServer:
    base_url: str = ""
    in_flight: int = 0
    peak_in_flight: int = 0
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each request
    models: list[dict] = field(default_factory=lambda: [{"id": "fake-model", "root": None}])


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _app(state: FakeServer) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": state.models})

    async def complete(request: web.Request) -> web.StreamResponse:
        state.arrivals.append(time.monotonic())
        body = await request.json()
        state.bodies.append(body)
        state.headers.append(dict(request.headers))
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        kind = prompt.split(" ", 1)[0]
        if kind == "http500":
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        state.in_flight += 1
        state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = {"errorevent": 2, "empty": 0}.get(kind, body.get("max_tokens", 16))
            if chat and n:
                await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
            for i in range(n):
                await asyncio.sleep(CHUNK_DELAY_S)
                word = f" w{i}"
                choice = {"index": 0, "delta": {"content": word}} if chat else {"text": word}
                await resp.write(_sse({"choices": [choice | {"finish_reason": None}]}))
            if kind == "errorevent":
                await resp.write(_sse({"error": {"message": "engine died", "code": 500}}))
            elif kind != "nousage" and n:
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                await resp.write(_sse({"choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            state.in_flight -= 1

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


@contextmanager
def fake_openai_server() -> Iterator[FakeServer]:
    """Serve on 127.0.0.1 (a free port) in a daemon thread for the duration of the block."""
    state = FakeServer()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner = web.AppRunner(_app(state), handle_signals=False)

    async def start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        state.base_url = f"http://127.0.0.1:{port}"
        started.set()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("fake OpenAI server did not start")
    try:
        yield state
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
