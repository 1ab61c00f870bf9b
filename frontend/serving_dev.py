"""The development routes (--enable-dev-routes or ZSERVE_SERVER_DEV_MODE=1) and the
profiler routes (--profiler-config), vLLM's paths and query parameters. Each acts on
every engine of the deployment and answers once all have (engine_actions.py)."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator
from starlette.requests import Request
from starlette.responses import Response

from frontend import engine_actions
from frontend.config import FrontendConfig
from frontend.errors import APIError
from frontend.request_inputs import parse_body
from frontend.responses import json_response
from frontend.serving import ServingContext
from protocol.controls import WAKE_TAGS

MAX_METHOD_CHARS = 64


def dev_routes_enabled(config: FrontendConfig) -> bool:
    return config.enable_dev_routes


def profiler_routes_enabled(config: FrontendConfig) -> bool:
    return config.enable_profiler_routes


class CollectiveRpcRequest(BaseModel):
    """POST /collective_rpc: vLLM's body. zserve's methods take no arguments."""

    method: str = Field(max_length=MAX_METHOD_CHARS)
    args: list = Field(default_factory=list)
    kwargs: dict = Field(default_factory=dict)
    timeout: float | None = None

    @field_validator("args", "kwargs")
    @classmethod
    def _no_arguments(cls, value: list | dict) -> list | dict:
        if value:
            raise ValueError("zserve's collective_rpc methods take no arguments")
        return value


def _query_flag(request: Request, name: str, default: bool = False) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise APIError(f"{name} must be true or false, got {value[:32]!r}", param=name)


def _query_int(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise APIError(f"{name} must be an integer, got {value[:32]!r}", param=name) from None


async def reset_prefix_cache(ctx: ServingContext, request: Request) -> Response:
    """`?reset_running_requests=true` also preempts running requests (recomputed
    after); `reset_external` is accepted, and has nothing to reset in zserve."""
    running = _query_flag(request, "reset_running_requests")
    _query_flag(request, "reset_external")
    engines = await engine_actions.reset_prefix_cache(ctx.client, running)
    return json_response({"reset": True, "engines": engines})


async def sleep(ctx: ServingContext, request: Request) -> Response:
    """`?level=1|2` (default 1), `?mode=abort|wait|keep` (default abort, as vLLM)."""
    level = _query_int(request, "level", 1)
    mode = request.query_params.get("mode", "abort")
    engines = await engine_actions.sleep(ctx.client, level, mode)
    return json_response({"is_sleeping": True, "level": level, "mode": mode, "engines": engines})


async def wake_up(ctx: ServingContext, request: Request) -> Response:
    """`?tags=weights&tags=kv_cache`: only those (default: everything released)."""
    tags = request.query_params.getlist("tags")
    if len(tags) > 4 * len(WAKE_TAGS):
        raise APIError(f"at most {4 * len(WAKE_TAGS)} tags", param="tags")
    engines = await engine_actions.wake_up(ctx.client, tags or None)
    asleep = any(isinstance(e, dict) and e.get("is_sleeping") for e in engines)
    return json_response({"is_sleeping": asleep, "engines": engines})


async def is_sleeping(ctx: ServingContext, request: Request) -> Response:
    return json_response({"is_sleeping": await engine_actions.is_sleeping(ctx.client)})


async def pause(ctx: ServingContext, request: Request) -> Response:
    """vLLM's `?mode=abort|wait|keep` (default abort), `?clear_cache=` (default true),
    and its older `?wait_for_inflight_requests=true` (mode wait)."""
    mode = request.query_params.get("mode")
    if _query_flag(request, "wait_for_inflight_requests"):
        if mode not in (None, "wait"):
            raise APIError(
                f"wait_for_inflight_requests=true is mode=wait; got mode={mode[:32]!r}",
                param="mode",
            )
        mode = "wait"
    clear_cache = _query_flag(request, "clear_cache", default=True)
    engines = await engine_actions.pause(ctx.client, mode or "abort", clear_cache)
    return json_response({"status": "paused", "engines": engines})


async def resume(ctx: ServingContext, request: Request) -> Response:
    engines = await engine_actions.resume(ctx.client)
    return json_response({"status": "resumed", "engines": engines})


async def is_paused(ctx: ServingContext, request: Request) -> Response:
    return json_response({"is_paused": await engine_actions.is_paused(ctx.client)})


async def collective_rpc(ctx: ServingContext, request: Request) -> Response:
    body = await parse_body(ctx, request, CollectiveRpcRequest)
    results = await engine_actions.collective_rpc(ctx.client, body.method, body.timeout)
    return json_response({"results": results})


async def start_profile(ctx: ServingContext, request: Request) -> Response:
    return json_response({"engines": await engine_actions.start_profile(ctx.client)})


async def stop_profile(ctx: ServingContext, request: Request) -> Response:
    return json_response({"engines": await engine_actions.stop_profile(ctx.client)})
