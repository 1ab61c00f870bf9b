"""The Starlette application: routes, error handlers, middleware."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.errors import APIError, handle_api_error, handle_http_exception, handle_unexpected
from frontend.serving import ClientDisconnected, ServingContext, json_response
from frontend.serving_chat import create_chat_completion
from frontend.serving_completions import create_completion

VERSION = "0.1.0"

Handler = Callable[[ServingContext, Request], Awaitable[Response]]


def _bind(ctx: ServingContext, handler: Handler):
    async def endpoint(request: Request) -> Response:
        ctx.in_flight += 1
        try:
            return await handler(ctx, request)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            ctx.in_flight -= 1

    endpoint.__name__ = handler.__name__
    return endpoint


async def list_models(ctx: ServingContext, request: Request) -> Response:
    data = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "zserve",
            "root": ctx.config.model_dir,
            "parent": None,
            "max_model_len": ctx.max_model_len,
        }
        for name in ctx.config.served_model_names
    ]
    return json_response({"object": "list", "data": data})


async def health(ctx: ServingContext, request: Request) -> Response:
    """Readiness: 503 when any engine is dead or the server is draining."""
    if ctx.draining or any(not e.alive for e in ctx.client.engines):
        return Response(status_code=503)
    return Response(status_code=200)


async def live(ctx: ServingContext, request: Request) -> Response:
    return Response(status_code=200)


async def version(ctx: ServingContext, request: Request) -> Response:
    return json_response({"version": VERSION})


async def server_info(ctx: ServingContext, request: Request) -> Response:
    """Which process answered and what every engine reported last: the shape of the
    server, for operators and tests."""
    engines = []
    for e in ctx.client.engines:
        s = e.stats
        engines.append(
            {
                "rank": e.rank,
                "alive": e.alive,
                "pid": e.ready.pid if e.ready else None,
                "hostname": e.ready.hostname if e.ready else None,
                "device": e.ready.device if e.ready else None,
                "dtype": e.ready.dtype if e.ready else None,
                "num_kv_blocks": e.ready.num_kv_blocks if e.ready else None,
                "in_flight": e.in_flight,
                "stats": {f: getattr(s, f) for f in s.__struct_fields__},
            }
        )
    return json_response(
        {
            "api_server_index": ctx.client_index,
            "api_server_count": ctx.config.api_server_count,
            "pid": ctx.pid,
            "torch_imported": "torch" in sys.modules,
            "model": ctx.model_name,
            "max_model_len": ctx.max_model_len,
            "in_flight": ctx.in_flight,
            "engines": engines,
        }
    )


def build_app(ctx: ServingContext) -> Starlette:
    def route(path: str, handler: Handler, methods: list[str]) -> Route:
        return Route(path, _bind(ctx, handler), methods=methods)

    routes = [
        route("/v1/completions", create_completion, ["POST"]),
        route("/v1/chat/completions", create_chat_completion, ["POST"]),
        route("/v1/models", list_models, ["GET"]),
        route("/health", health, ["GET"]),
        route("/live", live, ["GET"]),
        route("/version", version, ["GET"]),
        route("/server_info", server_info, ["GET"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
    )
