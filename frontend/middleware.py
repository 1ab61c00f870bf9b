"""HTTP middleware: API-key checks and user-supplied ASGI middleware."""

from __future__ import annotations

import importlib
import inspect
import uuid

from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.api_key import bearer_matches, key_matches
from frontend.errors import error_response


class APIKeyMiddleware:
    """Every route needs `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`)
    except `open_paths` (the probes
    and the scrape route, and those of --api-key-open-paths: app.api_key_open_paths)
    and CORS preflights; compared in constant time (api_key.py). Unlike vLLM's key,
    which guards /v1 only, it guards /tokenize, /detokenize, /invocations and /load
    too unless they are opened."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = next((v for name, v in scope["headers"] if name == b"authorization"), None)
        header_key = next((v for name, v in scope["headers"] if name == b"x-api-key"), None)
        if not (bearer_matches(given, self.expected) or key_matches(header_key, self.expected)):
            response = error_response(
                "Unauthorized: send the API key as 'Authorization: Bearer <key>' (or as "
                "'x-api-key: <key>')",
                401,
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """`--enable-request-id-headers`: every response carries `X-Request-Id`, the
    client's own or a fresh one (a generation sets its request id itself)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", given or uuid.uuid4().hex.encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def add_user_middleware(app: Starlette, dotted: str) -> None:
    """`--middleware pkg.module.Name`: a class is added as ASGI middleware, a function
    as an HTTP middleware `(request, call_next) -> response`."""
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"--middleware {dotted!r}: expected module.path.Name")
    target = getattr(importlib.import_module(module_name), attr)
    if inspect.isclass(target):
        app.add_middleware(target)
    elif inspect.iscoroutinefunction(target):
        app.add_middleware(BaseHTTPMiddleware, dispatch=target)
    else:
        raise ValueError(f"--middleware {dotted!r} is neither a class nor an async function")
