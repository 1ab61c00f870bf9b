"""The VllmEngine gRPC service (smg-grpc-proto's `vllm_engine.proto`) on zserve's own
engine client: what model gateways such as SMG speak to a vLLM worker.

Every RPC goes through the same ServingContext as the HTTP routes: admission, the
engine balancer, metrics, the drain, abort when the caller goes away. Errors leave as
gRPC status codes whose details name the field (status_of)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated.vllm_engine_pb2_grpc import VllmEngineServicer

from frontend import engine_actions
from frontend.admission import AdmissionRejected
from frontend.errors import APIError
from frontend.generation import Generation
from frontend.grpc_inputs import check_rank, read_embed, read_generate
from frontend.grpc_outputs import final_responses, stream_responses
from frontend.serving import ServingContext
from frontend.serving_pooling import pool
from frontend.tokenizer_bundle import TokenizerBundle
from protocol.messages import PoolingParams

log = logging.getLogger("zserve.grpc")

SERVER_TYPE = "zserve-grpc"
FLUSH_MAX_TIMEOUT_S = 600.0
UTILITY_TIMEOUT_S = 30.0

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


# The HTTP path's error params that are a proto field under another name.
_FIELDS = {"prompt": "tokenized.input_ids", "input_tokens": "tokenized.input_ids"}
_FIELDS.update((f.name, f"sampling_params.{f.name}") for f in pb.SamplingParams.DESCRIPTOR.fields)


def details_of(error: APIError) -> str:
    """The error's message, naming the field as the proto spells it (the HTTP path's
    params may read body.<field>, as vLLM's do)."""
    param = (error.param or "").removeprefix("body.")
    field = _FIELDS.get(param)
    if field is None or error.message.startswith(field):
        return error.message
    if error.message.startswith(f"{param}:"):
        return field + error.message[len(param) :]
    return f"{field}: {error.message}"


def status_of(error: APIError) -> grpc.StatusCode:
    """The HTTP path's error as a gRPC code: a full server is RESOURCE_EXHAUSTED (try
    later or elsewhere), a draining or engine-less one UNAVAILABLE."""
    if isinstance(error, AdmissionRejected):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return _CODES.get(error.status, grpc.StatusCode.INTERNAL)


class EngineService(VllmEngineServicer):
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.started = time.time()
        self.last_receive = 0.0
        # Client request id -> its running generations (ids may repeat across callers).
        self.by_id: dict[str, set[Generation]] = {}
        self.tokenizer = TokenizerBundle(ctx.config.tokenizer_dir)

    # --- generation -----------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        ctx = self.ctx
        if ctx.config.pooling is not None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "Generate: this server embeds (--runner pooling); use Embed",
            )
        self.last_receive = time.time()
        ctx.in_flight += 1
        generation = None
        try:
            g = await read_generate(ctx, request, context.invocation_metadata() or ())
            generation = ctx.submit(g.inputs, [g.prompt], [g.params])
            self.by_id.setdefault(generation.request_id, set()).add(generation)
            await context.send_initial_metadata(
                (
                    ("x-engine-rank", str(generation.engine.rank)),
                    ("x-api-server", str(ctx.client_index)),
                )
            )
            if request.stream:
                async for response in stream_responses(generation, ctx.config.stream_interval):
                    yield response
            else:
                generation.keep_logprobs = g.params.logprobs is not None
                await generation.drain()
                for response in final_responses(generation):
                    yield response
        except APIError as e:
            rid = generation.request_id if generation else request.request_id[:256]
            if e.status >= 500 and e.status != 503:  # a full or draining server is no news
                log.warning("request %s failed: %s", rid, e.message)
            await context.abort(status_of(e), details_of(e))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise  # the caller went away (finish() aborts the engine requests)
        except Exception:
            rid = generation.request_id if generation else request.request_id[:256]
            log.exception("internal error in Generate (request id %s)", rid)
            await context.abort(grpc.StatusCode.INTERNAL, "internal server error")
        finally:
            ctx.in_flight -= 1
            if generation is not None:
                self._forget(generation)
                ctx.finish(generation)

    def _forget(self, generation: Generation) -> None:
        running = self.by_id.get(generation.request_id)
        if running is not None:
            running.discard(generation)
            if not running:
                del self.by_id[generation.request_id]

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """End the named requests: their Generate streams finish with "abort". Unknown
        ids are ignored (the request may have finished already)."""
        limit = self.ctx.limits.max_sequences
        if len(request.request_ids) > limit:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_ids has {len(request.request_ids)} ids; at most {limit} per call "
                f"are allowed (--max-sequences-per-request)",
            )
        for rid in request.request_ids:
            for generation in list(self.by_id.get(rid, ())):
                generation.cancel()
        return pb.AbortResponse()

    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        """One input's pooled vector (--runner pooling), as /v1/embeddings answers it."""
        ctx = self.ctx
        if ctx.config.pooling is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "Embed: this server generates; start it with --runner pooling to embed",
            )
        if ctx.config.pooling.task != "embed":
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "Embed: this server's model classifies; its HTTP door's /classify answers",
            )
        self.last_receive = time.time()
        ctx.in_flight += 1
        try:
            inputs, prompt = await read_embed(ctx, request, context.invocation_metadata() or ())
            params = PoolingParams(use_activation=ctx.config.pooling.normalize)
            vectors, _ = await pool(ctx, inputs, [prompt], params)
            return pb.EmbedResponse(
                embedding=vectors[0].tolist(),
                prompt_tokens=len(prompt),
                embedding_dim=len(vectors[0]),
            )
        except APIError as e:
            await context.abort(status_of(e), details_of(e))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            log.exception("internal error in Embed (request id %s)", request.request_id[:256])
            await context.abort(grpc.StatusCode.INTERNAL, "internal server error")
        finally:
            ctx.in_flight -= 1

    # --- state ----------------------------------------------------------------------------

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        """Readiness, as GET /health: unhealthy while draining or with a dead engine."""
        ctx = self.ctx
        dead = [e for e in ctx.client.engines if not e.alive]
        if ctx.draining:
            return pb.HealthCheckResponse(healthy=False, message="the server is shutting down")
        if dead:
            e = dead[0]
            return pb.HealthCheckResponse(
                healthy=False, message=f"engine {e.rank} is dead: {e.dead_reason}"
            )
        return pb.HealthCheckResponse(healthy=True, message="Healthy")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        ctx = self.ctx
        ready = next(e.ready for e in ctx.client.engines if e.ready)
        tokenizer = ctx.renderer.tokenizer
        return pb.GetModelInfoResponse(
            model_path=ctx.model_name,  # never the model's path on this machine
            is_generation=ctx.config.pooling is None,
            max_context_length=ctx.max_model_len,
            vocab_size=ctx.vocab_size,
            supports_vision=False,
            served_model_name=ctx.model_name,
            model_type=ready.model_type,
            architectures=[ready.architecture] if ready.architecture else [],
            eos_token_ids=ready.eos_token_ids,
            pad_token_id=_token_id(ready.pad_token_id, tokenizer.pad_token_id),
            bos_token_id=_token_id(ready.bos_token_id, tokenizer.bos_token_id),
            max_req_input_len=ctx.max_model_len - (ctx.config.pooling is None),
            default_sampling_params_json=json.dumps(ctx.defaults) if ctx.defaults else "",
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        ctx = self.ctx
        ready = next((e.ready for e in ctx.client.engines if e.ready), None)
        return pb.GetServerInfoResponse(
            active_requests=ctx.admission.totals()[0],
            is_paused=False,
            last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started,
            server_type=SERVER_TYPE,
            data_parallel_size=len(ctx.client.engines),
            kv_cache_dtype="auto",
            block_size=ready.block_size if ready else 0,
            model_dtype=ready.dtype if ready else "",
        )

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        """Every engine's last reported state (or one rank's, `dp_rank`)."""
        engines = self.ctx.client.engines
        if request.HasField("dp_rank"):
            try:
                engines = [engines[check_rank(request.dp_rank, len(engines))]]
            except APIError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
        loads = [_load(e) for e in engines]
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version=SERVER_TYPE,
            dp_rank_count=len(loads),
            loads=loads,
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The tokenizer's files as a zip, in chunks; the SHA-256 rides on the last."""
        try:
            data, sha256 = await self.tokenizer.archive()
        except OSError as e:
            log.error("cannot build the tokenizer bundle: %s", e)
            await context.abort(grpc.StatusCode.INTERNAL, "the tokenizer files cannot be read")
        for chunk, last in self.tokenizer.chunks(data):
            yield common_pb2.GetTokenizerChunk(data=chunk, sha256=sha256 if last else "")

    # --- administration -------------------------------------------------------------------

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """Forget every engine's prefix cache. An engine refuses while requests hold
        blocks; `timeout_s` > 0 retries until they are done or it runs out."""
        timeout = request.timeout_s
        if not (math.isfinite(timeout) and 0 <= timeout <= FLUSH_MAX_TIMEOUT_S):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"timeout_s must be between 0 and {FLUSH_MAX_TIMEOUT_S:g} seconds, got {timeout}",
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                done = await self._reset_prefix_caches()
            except (TimeoutError, RuntimeError) as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"cache flush failed: {e}")
            if done:
                return common_pb2.FlushCacheResponse(
                    success=True, message="prefix cache flushed on every engine"
                )
            if loop.time() >= deadline:
                return common_pb2.FlushCacheResponse(
                    success=False,
                    message="an engine refused to flush its prefix cache: requests still "
                    "hold cache blocks (retry, or send a timeout_s to wait for them)",
                )
            await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))

    async def _reset_prefix_caches(self) -> bool:
        """True once every engine forgot its cached blocks; False while one still has
        requests on them (engine_actions' 409)."""
        try:
            await engine_actions.reset_prefix_cache(self.ctx.client)
        except APIError as e:
            if e.status == 409:
                return False
            raise RuntimeError(e.message) from None
        return True

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        """The engines' torch profiler (--profiler-config), as POST /start_profile."""
        return await self._profile(engine_actions.start_profile, context)

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return await self._profile(engine_actions.stop_profile, context)

    async def _profile(
        self, action, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        try:
            results = await action(self.ctx.client)
        except APIError as e:
            if e.status == 409:  # no profiler configured, or not running / running already
                return common_pb2.ProfileResponse(success=False, message=e.message)
            await context.abort(status_of(e), e.message)
        return common_pb2.ProfileResponse(success=True, message=json.dumps(results))

    async def SubscribeKvEvents(self, request, context: grpc.aio.ServicerContext):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "SubscribeKvEvents: this server publishes no KV cache events; poll GetLoads",
        )


def _load(engine) -> pb.SchedulerLoad:
    s, ready = engine.stats, engine.ready
    block_size = ready.block_size if ready else 0
    return pb.SchedulerLoad(
        dp_rank=engine.rank,
        num_running_reqs=s.num_running,
        num_waiting_reqs=s.num_waiting,
        num_total_reqs=s.num_running + s.num_waiting,
        num_used_tokens=(s.num_total_blocks - s.num_free_blocks) * block_size,
        max_total_num_tokens=(ready.num_kv_blocks * block_size) if ready else 0,
        token_usage=s.kv_cache_usage,
        cache_hit_rate=(
            s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        ),
    )


def _token_id(*candidates) -> int:
    """The first id the config or tokenizer names (-1: none), as an int32."""
    for value in candidates:
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and 0 <= value < 2**31:
            return value
    return -1
