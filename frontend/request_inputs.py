"""Step one of every request: what the client sent, read and checked cheapest first,
before anything is tokenized. A request refused here costs the server almost nothing."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from frontend.errors import APIError
from frontend.limits import (
    check_fan_out,
    check_prompt_count,
    check_request_id,
    check_stop_strings,
)
from frontend.openai_models import INT64_MAX, INT64_MIN, SamplingFields
from frontend.tracing import trace_headers

if TYPE_CHECKING:
    from frontend.serving import ServingContext

log = logging.getLogger("zserve.api")

M = TypeVar("M", bound=BaseModel)
S = TypeVar("S", bound=SamplingFields)

_decode_json = msgspec.json.Decoder().decode
# A body this large leaves the C heap at a new peak (released later: server.py).
LARGE_BODY_BYTES = 256 * 1024


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


@dataclass(frozen=True, slots=True)
class RequestInputs(Generic[S]):
    """A generation request once its cheap checks passed."""

    body: S
    model: str  # the served name responses report
    request_id: str
    priority: int
    engine_rank: int | None  # X-data-parallel-rank; None: the balancer picks
    lora: str | None = None  # the LoRA adapter `model` names (None: the base model)
    trace_headers: dict[str, str] | None = None  # traceparent/tracestate, when traced


async def read_inputs(
    ctx: ServingContext,
    request: Request,
    model: type[S],
    count_prompts: Callable[[S], int] = lambda body: 1,
    prompts_field: str = "prompt",
) -> RequestInputs[S]:
    """Server state, then headers, then the body: each refusal before the next cost.
    `count_prompts`: how many prompts the body holds, in its field `prompts_field`."""
    if ctx.asleep:
        await ctx.wait_until_awake()
    ctx.preflight()
    header_priority = _header_priority(request)
    engine_rank = _engine_rank(request, len(ctx.client.engines))
    header_id = request.headers.get("x-request-id") or None
    if header_id is not None:
        check_request_id(header_id, "X-Request-Id", ctx.limits)
    body = await parse_body(ctx, request, model)
    served, lora = await ctx.resolve_target(body.model)
    priority = header_priority if header_priority is not None else body.priority
    if priority != 0 and ctx.config.scheduling_policy != "priority":
        raise APIError(
            f"priority {priority} needs --scheduling-policy priority (this server "
            f"schedules {ctx.config.scheduling_policy})",
            param="priority",
        )
    if body.request_id is not None:
        check_request_id(body.request_id, "request_id", ctx.limits)
    check_stop_strings(body.stop_strings, ctx.limits)
    num_prompts = count_prompts(body)
    check_prompt_count(num_prompts, ctx.limits, prompts_field)
    check_fan_out(num_prompts, body.n, ctx.limits)
    request_id = header_id or body.request_id or uuid.uuid4().hex
    traced = trace_headers(request.headers) if ctx.tracer is not None else None
    return RequestInputs(body, served, request_id, priority, engine_rank, lora, traced)


async def parse_body(ctx: ServingContext, request: Request, model: type[M]) -> M:
    """The body as `model`, or a 400 naming the first bad field."""
    data = await json_body(ctx, request)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def json_body(ctx: ServingContext, request: Request) -> dict:
    """The request body as a JSON object, or a 4xx saying what is wrong with it.

    One parser for every body: msgspec keeps integers of any size exact (a limit check
    then names the limit, not a float) and refuses deep nesting. Decoded once per
    request (/invocations looks at the body before its route does)."""
    cached = getattr(request.state, "json_body", None)
    if cached is not None:
        return cached
    content_type = request.headers.get("content-type", "")
    if content_type and "json" not in content_type.split(";")[0]:
        raise APIError(f"unsupported Content-Type {content_type!r}; send application/json", 415)
    try:
        raw = await request.body()
    except ClientDisconnect:
        log.info("a client went away while sending its request to %s", request.url.path)
        raise ClientDisconnected() from None
    if len(raw) > LARGE_BODY_BYTES:
        ctx.large_request_seen = True
    try:
        data = _decode_json(raw)
    except msgspec.DecodeError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError("the request body is nested too deeply to be parsed") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    request.state.json_body = data
    return data


def _header_priority(request: Request) -> int | None:
    """X-Priority (or vLLM's X-vLLM-Priority) overrides the body's priority."""
    for header in ("x-priority", "x-vllm-priority"):
        value = request.headers.get(header)
        if value is None:
            continue
        try:
            priority = int(value)
        except ValueError:
            priority = None
        if priority is None or not INT64_MIN <= priority <= INT64_MAX:
            raise APIError(
                f"{header} must be an integer in [{INT64_MIN}, {INT64_MAX}], got {value!r}",
                param=header,
            )
        return priority
    return None


def _engine_rank(request: Request, num_engines: int) -> int | None:
    """X-data-parallel-rank pins the request to one engine."""
    value = request.headers.get("x-data-parallel-rank")
    if value is None:
        return None
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if not 0 <= rank < num_engines:
        raise APIError(
            f"X-data-parallel-rank {value!r} is out of range: this server has {num_engines} "
            f"engine(s), ranks 0..{num_engines - 1}",
            param="X-data-parallel-rank",
        )
    return rank


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field in `param` as vLLM does: a
    wrong type, or a range vLLM's request model itself declares, is `body.<field>`
    (FastAPI's place of the field); a range vLLM checks later, and a model-level rule
    (which names its field as the first word of its message, "field: ..."), is the
    bare field name. The first kind has vLLM's type for it too, "Bad Request"."""
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
    if loc and (err.get("type") not in _RANGE_ERRORS or path[0] in _VLLM_RANGED_FIELDS):
        return APIError(
            f"{detail} (type={err.get('type')})", 400, param=f"body.{loc}", type_="Bad Request"
        )
    return APIError(f"{detail} (type={err.get('type')})", 400, param=loc or None)


_RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})
# Fields whose range vLLM's request models declare (so FastAPI names them body.<field>).
_VLLM_RANGED_FIELDS = frozenset({"seed", "priority", "truncate_prompt_tokens", "prompt", "top_n"})


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*|constrained-.*)$")
