"""What every route handler shares: the parsed body, the model name, request ids,
engine pinning, tokenization off the event loop, and the generation life cycle."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar
from urllib.parse import quote

import msgspec
import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from frontend import sse
from frontend.admission import Admission
from frontend.config import FrontendConfig
from frontend.engine_client import EngineClient, EngineDeadError
from frontend.errors import APIError
from frontend.generation import Choice, Generation
from frontend.limits import check_fan_out, check_prompt_chars, check_request_id, check_stop_strings
from frontend.metrics import Metrics
from frontend.openai_models import INT64_MAX, INT64_MIN, SamplingFields
from frontend.renderer import Renderer
from frontend.sampling import context_length_error, generation_defaults
from frontend.tokenizer_pool import INLINE_CHARS, TokenizerPool
from protocol.messages import SamplingParams

log = logging.getLogger("zserve.api")

M = TypeVar("M", bound=BaseModel)

_decode_json = msgspec.json.Decoder().decode
# A request this large (body bytes, or sequences) leaves the C heap at a new peak.
LARGE_BODY_BYTES = 256 * 1024
LARGE_FAN_OUT = 64


class ServingContext:
    """Shared state of one API server's routes; also the observer of every generation."""

    def __init__(
        self,
        config: FrontendConfig,
        client: EngineClient,
        renderer: Renderer,
        admission: Admission,
        metrics: Metrics | None = None,
        tokenizers: TokenizerPool | None = None,
    ) -> None:
        self.config = config
        self.limits = config.limits
        self.client = client
        self.renderer = renderer
        self.admission = admission
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.model_name = config.served_model_names[0]
        self.defaults = generation_defaults(renderer.generation_config)
        self.client_index = client.client_index
        self.pid = os.getpid()
        self.in_flight = 0  # HTTP requests being handled, any route
        self.active: set[Generation] = set()  # started and not yet finished
        self.draining = False
        self.large_request_seen = False  # the heap may hold its peak: release it (server.py)

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def max_request_tokens(self) -> int:
        """Prompt + max_tokens that one request may need: the context length, or less
        when an engine's KV cache is smaller (the last sampled token needs no KV)."""
        limit = self.max_model_len
        for e in self.client.engines:
            if e.ready is not None:
                limit = min(limit, (e.ready.num_kv_blocks - 1) * e.ready.block_size + 1)
        return limit

    # --- request parsing ----------------------------------------------------------

    async def json_body(self, request: Request) -> dict:
        """The request body as a JSON object, or a 4xx saying what is wrong with it.

        One parser for every body: msgspec keeps integers of any size exact (a limit
        check can then name the value the client sent) and refuses deep nesting."""
        content_type = request.headers.get("content-type", "")
        if content_type and "json" not in content_type.split(";")[0]:
            raise APIError(
                f"unsupported Content-Type {content_type!r}; send application/json",
                415,
            )
        try:
            raw = await request.body()
        except ClientDisconnect:
            log.info("a client went away while sending its request to %s", request.url.path)
            raise ClientDisconnected() from None
        if len(raw) > LARGE_BODY_BYTES:
            self.large_request_seen = True
        try:
            data = _decode_json(raw)
        except msgspec.DecodeError as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError("the request body is nested too deeply to be parsed") from None
        if not isinstance(data, dict):
            raise APIError("the request body must be a JSON object")
        return data

    async def parse(self, request: Request, model: type[M]) -> M:
        data = await self.json_body(request)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None

    def check_limits(self, body: SamplingFields, num_prompts: int) -> None:
        """The size and count limits every generation request shares."""
        limits = self.limits
        if body.request_id is not None:
            check_request_id(body.request_id, "request_id", limits)
        check_stop_strings(body.stop_strings, limits)
        check_fan_out(num_prompts, body.n, limits)

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which no text can fit the context (--max-prompt-chars)."""
        if self.limits.max_prompt_chars is not None:
            return self.limits.max_prompt_chars
        return self.max_model_len * self.renderer.max_token_chars

    def check_text_length(self, text: str, field: str, truncating: bool = False) -> None:
        """A text that cannot fit the context is refused before tokenization; with
        truncate_prompt_tokens it may be longer (its start is cut), up to the body limit."""
        if not truncating:
            check_prompt_chars(len(text), self.max_prompt_chars, field)

    def resolve_model(self, name: str | None) -> str:
        if not name or name in self.config.served_model_names:
            return self.model_name
        raise APIError(f"The model `{name}` does not exist.", 404, param="model")

    def request_id(self, request: Request, body_id: str | None) -> str:
        header = request.headers.get("x-request-id")
        if header is not None:
            check_request_id(header, "X-Request-Id", self.limits)
            return header
        return body_id or uuid.uuid4().hex

    def engine_rank(self, request: Request) -> int | None:
        value = request.headers.get("x-data-parallel-rank")
        if value is None:
            return None
        n = len(self.client.engines)
        try:
            rank = int(value)
        except ValueError:
            rank = -1
        if not 0 <= rank < n:
            raise APIError(
                f"X-data-parallel-rank {value!r} is out of range: this server has {n} "
                f"engine(s), ranks 0..{n - 1}",
                param="X-data-parallel-rank",
            )
        return rank

    def priority(self, request: Request, body_priority: int) -> int:
        for header in ("x-priority", "x-vllm-priority"):
            value = request.headers.get(header)
            if value is not None:
                try:
                    body_priority = int(value)
                except ValueError:
                    body_priority = None
                if body_priority is None or not INT64_MIN <= body_priority <= INT64_MAX:
                    raise APIError(
                        f"{header} must be an integer in [{INT64_MIN}, {INT64_MAX}], got {value!r}",
                        param=header,
                    )
                break
        if body_priority != 0 and self.config.scheduling_policy != "priority":
            raise APIError(
                f"priority {body_priority} needs --scheduling-policy priority (this server "
                f"schedules {self.config.scheduling_policy})",
                param="priority",
            )
        return body_priority

    async def encode(
        self, text: str, add_special_tokens: bool, keep_last: int | None = None
    ) -> list[int]:
        """A prompt's token ids; long texts go to the tokenizer pool (tokenizer_pool.py).

        `keep_last`: only the last n ids (truncate_prompt_tokens). Without it a prompt
        that does not fit the context is a 400, and a huge one's ids are never listed
        on this loop."""
        at_most = None if keep_last else self.max_model_len - 1
        if len(text) > INLINE_CHARS and self.tokenizers is not None:
            count, ids = await self.tokenizers.encode(text, add_special_tokens, at_most, keep_last)
        else:
            if len(text) > INLINE_CHARS:
                ids = await asyncio.to_thread(self.renderer.encode, text, add_special_tokens)
            else:
                ids = self.renderer.encode(text, add_special_tokens)
            count = len(ids)
        if at_most is not None and count > at_most:
            raise context_length_error(count, self.max_model_len)
        return ids[-keep_last:] if keep_last else ids

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > INLINE_CHARS and self.tokenizers is not None:
            return await self.tokenizers.decode(ids, skip_special_tokens)
        return self.renderer.decode(ids, skip_special_tokens)

    async def render_chat(self, **kwargs) -> str:
        return await asyncio.to_thread(self.renderer.render_chat, **kwargs)

    # --- the generation life cycle ------------------------------------------------

    def generation(
        self,
        request: Request,
        body: SamplingFields,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
    ) -> Generation:
        """The generation of one API call: its prompts × n, with the request's stop rules,
        priority and engine pin."""
        return Generation(
            self.client,
            request_id,
            prompts,
            params,
            n=body.n,
            tokenizer=self.renderer.raw,
            stop=body.stop_strings,
            include_stop=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            priority=self.priority(request, body.priority),
            engine_rank=self.engine_rank(request),
        )

    def preflight(self) -> None:
        """Cheap checks before any work is done for a request."""
        if self.draining:
            raise APIError("the server is shutting down", 503, headers={"Retry-After": "5"})
        if self.client.dead:
            raise APIError("no engine is alive", 503)

    def start(self, generation: Generation, params_n: int) -> None:
        """Admit and send a generation; every started generation reaches finish()."""
        self.preflight()
        generation.observer = self
        choices = generation.choices
        self.admission.admit(len(choices), sum(len(c.prompt_ids) for c in choices))
        generation.params_n = params_n
        self.active.add(generation)
        try:
            generation.start()
        except EngineDeadError as e:
            self.finish(generation)
            raise APIError(f"the engine is not available: {e}", 503) from None
        except BaseException:
            self.finish(generation)
            raise
        if self.config.enable_log_requests:
            c = choices[0]
            log.info(
                "request %s: %d choice(s), %d prompt tokens, max_tokens %d, engine %d",
                generation.request_id,
                len(choices),
                len(c.prompt_ids),
                c.params.max_tokens,
                generation.engine.rank,
            )

    def finish(self, generation: Generation) -> None:
        """Release what start() reserved and record the request (idempotent)."""
        if generation.done:
            return
        generation.done = True
        self.active.discard(generation)
        if len(generation.choices) > LARGE_FAN_OUT:
            self.large_request_seen = True
        generation.abort()
        waiting = sum(len(c.prompt_ids) for c in generation.choices if not c.first_token_time)
        self.admission.release(len(generation.choices), waiting)
        if self.metrics is not None:
            self.metrics.observe_request(generation, generation.params_n)

    # GenerationObserver
    def first_token(self, choice: Choice) -> None:
        self.admission.prefilled(len(choice.prompt_ids))

    def token_gap(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_gap(seconds)

    def response_headers(self, generation: Generation, request_id: str) -> dict[str, str]:
        headers = {
            "x-engine-rank": str(generation.engine.rank),
            "x-api-server": str(self.client_index),
        }
        if self.config.enable_request_id_headers:
            headers["x-request-id"] = header_safe(request_id)
        return headers

    def stream(
        self,
        request: Request,
        generation: Generation,
        events: AsyncIterator[bytes],
        headers: dict[str, str],
    ) -> StreamingResponse:
        """HTTP 200 first; a later error becomes an error event; [DONE] always ends it;
        a client that goes away aborts the generation."""

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in events:
                    yield chunk
            except APIError as e:
                log.error("request %s failed mid-stream: %s", generation.request_id, e.message)
                yield sse.event(e.body())
            except Exception:
                log.exception("request %s failed mid-stream", generation.request_id)
                yield sse.event(APIError("internal server error", 500).body())
            finally:
                self.finish(generation)
            yield sse.DONE

        return _GenerationStream(
            body(),
            on_close=lambda: self.finish(generation),
            media_type="text/event-stream",
            headers=headers,
        )

    async def respond(
        self, request: Request, generation: Generation, view: StreamingView, headers: dict
    ) -> Response:
        """The response of a started generation: its SSE stream, or its JSON once done."""
        if view.body.stream:
            return self.stream(request, generation, view.events(), headers)
        await self.complete(request, generation)
        return json_response(view.response(), headers)

    async def complete(self, request: Request, generation: Generation) -> None:
        """Run a non-streaming generation to the end; a client that disconnects
        meanwhile aborts it (Starlette cancels only streaming responses)."""

        async def drain() -> None:
            async for _ in generation.deltas():
                pass

        try:
            await run_unless_disconnected(request, drain)
        finally:
            self.finish(generation)


class _GenerationStream(StreamingResponse):
    """A stream whose generation is finished however the response ends: a client may
    leave before the body iterator ever starts (its `finally` then never runs)."""

    def __init__(self, content, *, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def run_unless_disconnected(request: Request, fn: Callable[[], Awaitable[None]]) -> None:
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


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (model-level validators
    name theirs as the first word of the message: "field: ...")."""
    err = e.errors()[0]
    # Union members tag the path with their type ("prompt.list[int].0"): not a field.
    path = [p for p in err.get("loc", ()) if not (isinstance(p, str) and _TYPE_TAG.search(p))]
    loc = ".".join(str(p) for p in path)
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if not loc and ":" in msg and " " not in msg.split(":", 1)[0]:
        loc = msg.split(":", 1)[0]
        return APIError(f"{msg} (type={err.get('type')})", 400, param=loc)
    detail = f"{loc}: {msg}" if loc else msg
    return APIError(f"{detail} (type={err.get('type')})", 400, param=loc or None)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*)$")


def header_safe(value: str) -> str:
    """A client-chosen id as an HTTP header value: printable ASCII only."""
    if value.isascii() and value.isprintable():
        return value
    return quote(value, safe="")


def json_response(payload: dict, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json", headers=headers)


class StreamingView:
    """The SSE loop completions and chat share; a view supplies `_stream_choices(delta)`
    (the chunk choices of one delta), `_chunk(choices, usage)` and `_usage()`."""

    ctx: ServingContext
    gen: Generation

    async def events(self) -> AsyncIterator[bytes]:
        """Hot path: one chunk per token (per --stream-interval tokens)."""
        opts = self.body.stream_options
        include_usage = bool(opts and opts.include_usage) or self.ctx.config.force_include_usage
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        config = self.ctx.config
        async for batch in self.gen.deltas(
            config.sse_keep_alive_interval or None, config.stream_interval
        ):
            if not batch:
                yield sse.KEEP_ALIVE
                continue
            out = []
            for d in batch:
                for choice in self._stream_choices(d):
                    usage_ = self._usage() if continuous else None
                    out.append(sse.event(self._chunk([choice], usage_)))
            if out:
                yield b"".join(out)
        if include_usage:
            yield sse.event(self._chunk([], self._usage()))
