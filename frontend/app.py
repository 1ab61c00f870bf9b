"""The Starlette application: the one table of routes, error handlers, middleware.

`ROUTES` is the only list of what this server answers: the router, /openapi.json and
the API key's open paths are all made from it. With `--root-path /p` every route is
also answered under /p (as vLLM's FastAPI root_path does), by the same table."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend import serving_dev as dev
from frontend.anthropic_input import CountTokensRequest, MessagesRequest
from frontend.config import FrontendConfig
from frontend.derender_input import DerenderChatRequest, DerenderCompletionRequest
from frontend.errors import APIError, handle_api_error, handle_http_exception, handle_unexpected
from frontend.generate_input import AbortRequests, GenerateRequest
from frontend.http_limits import BodyLimitMiddleware
from frontend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from frontend.middleware import APIKeyMiddleware, RequestIdMiddleware, add_user_middleware
from frontend.openai_models import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from frontend.openapi import build_openapi
from frontend.pooling_input import (
    ClassificationRequest,
    CohereEmbedRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from frontend.request_inputs import ClientDisconnected, json_body
from frontend.responses import json_response
from frontend.responses_input import ResponsesRequest
from frontend.serving import ServingContext
from frontend.serving_anthropic import count_tokens, create_message
from frontend.serving_chat import create_batch_chat_completion, create_chat_completion
from frontend.serving_cohere import create_cohere_embedding
from frontend.serving_completions import create_completion
from frontend.serving_generate import (
    abort_requests,
    create_generate,
    scale_out_enabled,
    scale_out_off,
    tokens_only,
)
from frontend.serving_lora import load_lora_adapter, runtime_lora_updating, unload_lora_adapter
from frontend.serving_pooling import create_classify, create_embedding, create_pooling
from frontend.serving_render import (
    derender_chat_completion,
    derender_completion,
    render_chat_completion,
    render_completion,
    render_messages,
    render_responses,
)
from frontend.serving_responses import create_response, stored_response
from frontend.serving_scores import create_rerank, create_score
from frontend.serving_tokens import detokenize, tokenize, tokenizer_info

VERSION = "0.1.0"

Handler = Callable[[ServingContext, Request], Awaitable[Response]]


async def list_models(ctx: ServingContext, request: Request) -> Response:
    """The served names, then every LoRA adapter with its base model as `parent`."""
    models = [(name, None) for name in ctx.config.served_model_names]
    models += await ctx.loras.models()
    data = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "zserve",
            "root": name,  # never a path on this machine (vLLM shows it)
            "parent": parent,
            "max_model_len": ctx.max_model_len,
        }
        for name, parent in models
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
                "node_id": e.ready.node_id or None if e.ready else None,  # Ray backend
                "incarnation": e.ready.incarnation if e.ready else None,
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
            "engine_core_imported": any(m.split(".")[0] == "engine_core" for m in sys.modules),
            "model": ctx.model_name,
            "max_model_len": ctx.max_model_len,
            "in_flight": ctx.in_flight,
            "engines": engines,
        }
    )


async def load(ctx: ServingContext, request: Request) -> Response:
    """In-flight requests of the whole server (with --enable-server-load-tracking)."""
    server_load = ctx.admission.totals()[0] if ctx.config.enable_server_load_tracking else 0
    return json_response({"server_load": server_load})


async def metrics(ctx: ServingContext, request: Request) -> Response:
    return Response(ctx.metrics.render(), media_type=METRICS_CONTENT_TYPE)


async def invocations(ctx: ServingContext, request: Request) -> Response:
    """SageMaker's entry: a chat body goes to chat, a prompt body to completions; on a
    pooling server, every body to its model's task (embeddings or classification)."""
    data = await json_body(ctx, request)
    if ctx.config.pooling is not None:
        if ctx.config.pooling.task == "classify":
            return await create_classify(ctx, request)
        return await create_embedding(ctx, request)
    if "messages" in data:
        return await create_chat_completion(ctx, request)
    if "prompt" in data:
        return await create_completion(ctx, request)
    raise APIError(
        "/invocations needs a chat body (with messages) or a completion body (with prompt)",
        param="messages",
    )


@dataclass(frozen=True)
class RouteSpec:
    path: str
    handler: Handler
    methods: tuple[str, ...] = ("GET",)
    body: type[BaseModel] | None = None  # the documented JSON body of a POST
    open: bool = False  # answered without the API key (probes and the scrape route)
    # vLLM answers it without the API key (its key guards /v1 only); zserve guards it
    # unless --api-key-open-paths opens it.
    vllm_open: bool = False
    when: Callable[[FrontendConfig], bool] | None = None  # served only if this says so
    otherwise: Handler | None = None  # what answers when `when` says no (else a 404)
    # The servers that have it (server_tasks): "generate" (the default runner), "pool"
    # (--runner pooling), "embed" or "classify" (its model's), "score"; None: all.
    task: str | None = None

    def serves(self, config: FrontendConfig) -> bool:
        """The task is this server's (whatever `when` says)."""
        return self.task is None or self.task in server_tasks(config)


def server_tasks(config: FrontendConfig) -> set[str]:
    """What a server does: generate, or pool for its model's task, and score pairs when
    that is embed or a one-label classifier (a cross-encoder), as vLLM's servers."""
    pooling = config.pooling
    if pooling is None:
        return {"generate"}
    tasks = {"pool", pooling.task}
    if pooling.task == "embed" or len(pooling.labels or ()) == 1:
        tasks.add("score")
    return tasks


ROUTES: tuple[RouteSpec, ...] = (
    *(
        RouteSpec(path, handler, methods, body, task="generate")
        for path, handler, methods, body in (
            ("/v1/completions", create_completion, ("POST",), CompletionRequest),
            ("/v1/chat/completions", create_chat_completion, ("POST",), ChatCompletionRequest),
            (
                "/v1/chat/completions/batch",
                create_batch_chat_completion,
                ("POST",),
                BatchChatCompletionRequest,
            ),
            ("/v1/responses", create_response, ("POST",), ResponsesRequest),
            ("/v1/messages", create_message, ("POST",), MessagesRequest),
            ("/v1/messages/count_tokens", count_tokens, ("POST",), CountTokensRequest),
            ("/v1/responses/{response_id}", stored_response, ("GET",), None),
            ("/v1/responses/{response_id}/cancel", stored_response, ("POST",), None),
        )
    ),
    *(
        RouteSpec(
            path,
            handler,
            ("POST",),
            body,
            when=scale_out_enabled,
            otherwise=scale_out_off,
            task="generate",
        )
        for path, handler, body in (
            ("/v1/chat/completions/render", render_chat_completion, ChatCompletionRequest),
            ("/v1/completions/render", render_completion, CompletionRequest),
            ("/v1/messages/render", render_messages, MessagesRequest),
            ("/v1/responses/render", render_responses, ResponsesRequest),
            ("/v1/chat/completions/derender", derender_chat_completion, DerenderChatRequest),
            ("/v1/completions/derender", derender_completion, DerenderCompletionRequest),
            ("/inference/v1/generate", create_generate, GenerateRequest),
            ("/inference/v1/abort_requests", abort_requests, AbortRequests),
        )
    ),
    # vLLM's older path of the abort, on its --tokens-only servers.
    RouteSpec(
        "/abort_requests",
        abort_requests,
        ("POST",),
        AbortRequests,
        when=tokens_only,
        task="generate",
    ),
    RouteSpec("/v1/embeddings", create_embedding, ("POST",), EmbeddingRequest, task="embed"),
    RouteSpec("/v2/embed", create_cohere_embedding, ("POST",), CohereEmbedRequest, task="embed"),
    # vLLM's key guards /v1 and /v2 only: /pooling, /classify, /score and /rerank are open
    # there.
    RouteSpec("/pooling", create_pooling, ("POST",), PoolingRequest, vllm_open=True, task="pool"),
    RouteSpec(
        "/classify",
        create_classify,
        ("POST",),
        ClassificationRequest,
        vllm_open=True,
        task="classify",
    ),
    *(
        RouteSpec(
            path, handler, ("POST",), body, vllm_open=path[:3] not in ("/v1", "/v2"), task="score"
        )
        for path, handler, body in (
            ("/score", create_score, ScoreRequest),
            ("/v1/score", create_score, ScoreRequest),
            ("/rerank", create_rerank, RerankRequest),
            ("/v1/rerank", create_rerank, RerankRequest),
            ("/v2/rerank", create_rerank, RerankRequest),
        )
    ),
    RouteSpec(
        "/invocations",
        invocations,
        ("POST",),
        CompletionRequest | ChatCompletionRequest,
        vllm_open=True,
    ),
    RouteSpec("/tokenize", tokenize, ("POST",), TokenizeRequest, vllm_open=True),
    RouteSpec("/detokenize", detokenize, ("POST",), DetokenizeRequest, vllm_open=True),
    RouteSpec("/tokenizer_info", tokenizer_info, vllm_open=True),
    RouteSpec("/v1/models", list_models),
    RouteSpec("/health", health, open=True),
    RouteSpec("/live", live, open=True),
    RouteSpec("/ping", health, ("GET", "POST"), open=True),
    RouteSpec("/load", load, vllm_open=True),
    RouteSpec("/version", version, open=True),
    RouteSpec("/server_info", server_info, when=dev.dev_routes_enabled),
    RouteSpec("/metrics", metrics, open=True),
    RouteSpec("/metrics/", metrics, open=True),
    RouteSpec(
        "/reset_prefix_cache", dev.reset_prefix_cache, ("POST",), when=dev.dev_routes_enabled
    ),
    RouteSpec("/sleep", dev.sleep, ("POST",), when=dev.dev_routes_enabled),
    RouteSpec("/wake_up", dev.wake_up, ("POST",), when=dev.dev_routes_enabled),
    RouteSpec("/is_sleeping", dev.is_sleeping, when=dev.dev_routes_enabled),
    RouteSpec("/pause", dev.pause, ("POST",), when=dev.dev_routes_enabled),
    RouteSpec("/resume", dev.resume, ("POST",), when=dev.dev_routes_enabled),
    RouteSpec("/is_paused", dev.is_paused, when=dev.dev_routes_enabled),
    RouteSpec(
        "/collective_rpc",
        dev.collective_rpc,
        ("POST",),
        dev.CollectiveRpcRequest,
        when=dev.dev_routes_enabled,
    ),
    RouteSpec("/start_profile", dev.start_profile, ("POST",), when=dev.profiler_routes_enabled),
    RouteSpec("/stop_profile", dev.stop_profile, ("POST",), when=dev.profiler_routes_enabled),
    RouteSpec(
        "/v1/load_lora_adapter",
        load_lora_adapter,
        ("POST",),
        LoadLoRAAdapterRequest,
        when=runtime_lora_updating,
    ),
    RouteSpec(
        "/v1/unload_lora_adapter",
        unload_lora_adapter,
        ("POST",),
        UnloadLoRAAdapterRequest,
        when=runtime_lora_updating,
    ),
)
OPEN_PATHS = frozenset(r.path for r in ROUTES if r.open)
VLLM_OPEN_PATHS = frozenset(r.path for r in ROUTES if r.vllm_open)


def api_key_open_paths(names: list[str]) -> frozenset[str]:
    """--api-key-open-paths: the routes answered without the API key besides the
    probes; `vllm` stands for every route vLLM leaves open. Raises ValueError naming
    an unknown path and the routes there are."""
    paths: set[str] = set()
    known = {r.path for r in ROUTES}
    for name in names:
        if name == "vllm":
            paths |= VLLM_OPEN_PATHS
        elif name in known:
            paths.add(name)
        else:
            raise ValueError(
                f"{name!r} is not a route of this server; use 'vllm' or some of "
                f"{', '.join(sorted(known - OPEN_PATHS))}"
            )
    return OPEN_PATHS | paths


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


class RootPathMiddleware:
    """--root-path P: a request for P/x is served as x, and one for x too, as vLLM
    (FastAPI's root_path) serves both; what is below sees the path without P."""

    def __init__(self, app, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path, root = scope["path"], self.root_path
            if path == root or path.startswith(root + "/"):
                # Stripped once: the router must not strip it again (P/P/x is no route).
                scope = {**scope, "path": path[len(root) :] or "/"}
        await self.app(scope, receive, send)


def served_routes(config: FrontendConfig) -> list[RouteSpec]:
    """The routes this configuration serves (the others answer 404)."""
    return [r for r in ROUTES if r.serves(config) and (r.when is None or r.when(config))]


def build_app(ctx: ServingContext) -> Starlette:
    config = ctx.config
    served = served_routes(config)
    routes = [Route(r.path, _bind(ctx, r.handler), methods=list(r.methods)) for r in served]
    routes += [
        Route(r.path, _bind(ctx, r.otherwise), methods=list(r.methods))
        for r in ROUTES
        if r.otherwise is not None and r not in served and r.serves(config)
    ]
    if not config.disable_fastapi_docs:
        document = orjson.dumps(build_openapi(served, VERSION, config.root_path))
        routes.append(
            Route(
                "/openapi.json",
                lambda request: Response(document, media_type="application/json"),
                methods=["GET"],
            )
        )
    app = Starlette(
        routes=routes,
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
    )
    for dotted in config.middleware:
        add_user_middleware(app, dotted)
    if config.api_key:
        app.add_middleware(
            APIKeyMiddleware,
            api_key=config.api_key,
            open_paths=api_key_open_paths(config.api_key_open_paths),
        )
    if config.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    # Always, as in vLLM: without --allowed-origins a CORS preflight is refused (400).
    app.add_middleware(
        CORSMiddleware,
        allow_origins=config.allowed_origins,
        allow_methods=config.allowed_methods,
        allow_headers=config.allowed_headers,
        allow_credentials=config.allow_credentials,
    )
    # An oversized body is refused before anything else looks at it.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.limits.max_body_bytes)
    if config.root_path:
        app.add_middleware(RootPathMiddleware, root_path=config.root_path)
    return app
