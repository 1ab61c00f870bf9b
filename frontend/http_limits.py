"""HTTP-level limits, enforced before a request reaches a route: header bytes and
count (431), header and body read time (408), body bytes (413).

uvicorn's httptools protocol buffers whatever a client sends and waits for it as long
as the client likes; `guarded_protocol` adds the limits at the connection, where a
header flood or a slow sender can be cut off before the application sees anything.
The body limit is ASGI middleware: Content-Length is checked before the body is read,
and a chunked body is counted as it arrives (uvicorn stops reading from the socket
while the application has not taken what it already buffered, so counting in
`receive` bounds memory too).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from frontend.accept_gate import AcceptGate
from frontend.errors import APIError, error_response
from frontend.limits import RequestLimits

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def guarded_protocol(limits: RequestLimits, gate: AcceptGate) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with these limits (uvicorn builds one per connection),
    counting its connections for the accept gate."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _limits = limits

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            gate.opened()
            self._timer: asyncio.TimerHandle | None = None
            self._expect_headers()
            self._arm(self._limits.header_timeout_s)

        def connection_lost(self, exc) -> None:
            gate.closed()
            self._disarm()
            super().connection_lost(exc)

        def _expect_headers(self) -> None:
            """From the end of one request to the end of the next one's headers."""
            self._reading_headers = True
            self._bytes_in_headers = 0  # raw bytes received meanwhile (a flood's bound)
            self._header_size = 0  # request line and headers, as parsed
            self._header_count = 0

        def data_received(self, data: bytes) -> None:
            if self._reading_headers:
                self._bytes_in_headers += len(data)
            super().data_received(data)
            if (
                self._reading_headers
                and not self.transport.is_closing()
                and self._bytes_in_headers > self._limits.max_header_bytes
            ):
                self._refuse(431, self._too_large())

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._timer is None:  # a later request on a kept-alive connection
                self._arm(self._limits.header_timeout_s)

        def on_url(self, url: bytes) -> None:
            self._header_size += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            self._header_size += len(name) + len(value) + 4
            if self._header_count <= self._limits.max_header_count:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._reading_headers = False
            self._disarm()
            limits = self._limits
            if self._header_count > limits.max_header_count:
                self._refuse(
                    431,
                    f"the request has more than {limits.max_header_count} headers "
                    f"(--max-header-count)",
                )
                return
            if self._header_size > limits.max_header_bytes:
                self._refuse(431, self._too_large())
                return
            super().on_headers_complete()
            if self.parser is not None and not self.transport.is_closing():
                self._arm(limits.body_timeout_s)  # disarmed once the body is in

        def on_message_complete(self) -> None:
            self._disarm()
            self._expect_headers()
            super().on_message_complete()

        def _too_large(self) -> str:
            return (
                f"the request line and headers exceed {self._limits.max_header_bytes} bytes "
                f"(--max-header-bytes)"
            )

        def _arm(self, seconds: float) -> None:
            self._disarm()
            if seconds > 0:
                self._timer = self.loop.call_later(seconds, self._on_timeout, seconds)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _on_timeout(self, seconds: float) -> None:
            self._timer = None
            cycle = self.cycle
            if self._reading_headers:
                if cycle is not None and not cycle.response_complete:
                    self.transport.close()  # a pipelined response is under way
                    return
                message = f"the request headers did not arrive within {seconds:g} s"
                flag = "--header-read-timeout"
            else:
                if cycle.response_started:
                    self.transport.close()  # no status line can be sent any more
                    return
                cycle.disconnected = True  # the application's receive() ends
                cycle.message_event.set()
                message = f"the request body did not arrive within {seconds:g} s"
                flag = "--body-read-timeout"
            self._refuse(408, f"{message} ({flag})")

        def _refuse(self, status: int, message: str) -> None:
            body = error_response(message, status).body
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), body)
            )
            self.transport.close()

    return GuardedHttpToolsProtocol


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once by Content-Length, or while it arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    response = error_response(self._message(), 413, headers={"Connection": "close"})
                    await response(scope, receive, send)
                    return
                break
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise APIError(self._message(), 413, headers={"Connection": "close"})
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"the request body exceeds {self.max_bytes} bytes (--max-request-body-bytes)"
