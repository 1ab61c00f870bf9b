"""The last step of a generation request: its SSE stream, or its JSON once done; and
a client that goes away, either way, aborts the generation in its engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from frontend import orca, sse
from frontend.errors import APIError
from frontend.generation import Generation
from frontend.request_inputs import ClientDisconnected
from frontend.serving import ServingContext
from frontend.streaming_view import GenerationView

log = logging.getLogger("zserve.api")


async def respond(ctx: ServingContext, request: Request, view: GenerationView) -> Response:
    """The response of a submitted generation, as the request asked for it."""
    generation = view.gen
    headers = generation_headers(ctx, generation)
    if view.body.stream:
        return _stream(ctx, view, headers)
    try:
        await run_unless_disconnected(request, generation.drain)
    finally:
        ctx.finish(generation)
    report_format = request.headers.get(orca.REQUEST_HEADER)
    if report_format:
        headers.update(orca.load_report(report_format, ctx.client.engines))
    return json_response(view.response(), headers)


def generation_headers(ctx: ServingContext, generation: Generation) -> dict[str, str]:
    """Which engine and API server served a generation (and its id, when asked)."""
    headers = {
        "x-engine-rank": str(generation.engine.rank),
        "x-api-server": str(ctx.client_index),
    }
    if ctx.config.enable_request_id_headers:
        headers["x-request-id"] = header_safe(generation.request_id)
    return headers


def _stream(
    ctx: ServingContext, view: GenerationView, headers: dict[str, str]
) -> StreamingResponse:
    """HTTP 200 first; a later error becomes an error event; the view's last event
    ([DONE] for completions and chat) always ends it."""
    generation = view.gen

    async def body() -> AsyncIterator[bytes]:
        # Once every choice has finished, what is left (the last tokens' chunk, the
        # usage chunk, [DONE]) goes out in one write, with the body's end: one TCP
        # segment for the client to read instead of four.
        tail: list[bytes] = []
        try:
            async for chunk in view.events():
                if generation.finished:
                    tail.append(chunk)
                else:
                    yield chunk
        except APIError as e:
            log.error("request %s failed mid-stream: %s", generation.request_id, e.message)
            tail.append(view.error_event(e.body()))
        except Exception:
            log.exception("request %s failed mid-stream", generation.request_id)
            tail.append(view.error_event(APIError("internal server error", 500).body()))
        finally:
            ctx.finish(generation)
        tail.append(view.done)
        yield LastChunk(b"".join(tail))

    return _GenerationStream(
        body(),
        on_close=lambda: ctx.finish(generation),
        media_type="text/event-stream",
        headers=headers,
    )


class LastChunk(bytes):
    """A stream's last bytes: sent with the end of the body (one write)."""


class _GenerationStream(StreamingResponse):
    """A stream whose generation is finished however the response ends: a client may
    leave before the body iterator ever starts (its `finally` then never runs)."""

    def __init__(self, content, *, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def stream_response(self, send) -> None:
        """Starlette's, but a LastChunk ends the body in the same message."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self.body_iterator:
            last = type(chunk) is LastChunk
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def run_unless_disconnected(request: Request, fn: Callable[[], Awaitable[None]]) -> None:
    """Run `fn` to the end, or raise ClientDisconnected as soon as the client leaves
    (Starlette cancels only streaming responses on a disconnect)."""
    task = asyncio.ensure_future(fn())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        task.result()
        return
    task.cancel()
    raise ClientDisconnected()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def header_safe(value: str) -> str:
    """A client-chosen id as an HTTP header value: printable ASCII only."""
    if value.isascii() and value.isprintable():
        return value
    return quote(value, safe="")


def json_response(payload: dict, headers: dict[str, str] | None = None) -> Response:
    return Response(sse.dumps(payload), media_type="application/json", headers=headers)
