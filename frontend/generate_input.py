"""vLLM's tokens-in, tokens-out request (POST /inference/v1/generate, and what the
/render routes answer): its fields, mapped onto the completion request the completion
pipeline already checks and serves; and the way back, a submitted request's engine
parameters as the `sampling_params` object vLLM's SamplingParams reads.

`sampling_params` holds vLLM's SamplingParams fields. Those zserve samples with map
one to one onto the completion fields of the same name; `detokenize` false turns the
text off (no stop strings then, as in vLLM); the fields that only tune vLLM's own
output plumbing (`output_kind`, `skip_clone`, ...) are accepted and change nothing.
What zserve cannot do is refused by name, never ignored: multimodal `features` and
`content_parts`, KV and encoder-cache transfer, `bad_words`, watermarking, the
thinking budget and repetition detection.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from frontend.errors import APIError
from frontend.openai_models import (
    INT64_MAX,
    INT64_MIN,
    MAX_CACHE_SALT_CHARS,
    CompletionRequest,
    SamplingFields,
    StreamOptions,
    _Model,
)
from frontend.request_inputs import validation_error
from protocol.controls import MAX_ABORT_IDS
from protocol.messages import SamplingParams, StructuredOutputs

# SamplingParams fields that are completion fields of the same name.
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "logprob_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logit_bias",
    "allowed_token_ids",
    "structured_outputs",
    "truncate_prompt_tokens",
)
# vLLM's output plumbing: how its engine hands outputs over, nothing the answer shows.
_PLUMBING = (
    "detokenize",
    "output_kind",
    "skip_clone",
    "stream_interval",
    "output_text_buffer_length",
    "flat_logprobs",
    "skip_reading_prefix_cache",
    "routed_experts_prompt_start",
)
# Set to anything but these values, a field asks for what zserve does not do.
_UNSUPPORTED = {
    "bad_words": (None, []),
    "watermarking": (None, False),
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None, 0),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "trace_decode_token_ids": (None,),
    "extra_args": (None, {}),
}
_NOT_SERVED = {
    "features": "multimodal input is not supported (zserve serves text models)",
    "content_parts": "multimodal input is not supported (zserve serves text models)",
    "kv_transfer_params": "zserve does not transfer KV caches between servers",
    "ec_transfer_params": "zserve does not transfer encoder caches between servers",
}


class GenerateRequest(_Model):
    """The body of POST /inference/v1/generate, as vLLM defines it."""

    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any]
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    output_mode: Literal["tokens", "text"] = "tokens"
    return_token_ids: bool | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    token_offsets: list[tuple[int, int]] | None = None  # the renderer's; not used here

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, ids: list[int]) -> list[int]:
        if any(t < 0 for t in ids):
            raise ValueError("token_ids must not contain negative values")
        return ids


class AbortRequests(_Model):
    """The body of POST /inference/v1/abort_requests."""

    request_ids: list[str] = Field(max_length=MAX_ABORT_IDS)


class GenerateBody(CompletionRequest):
    """A generate request as the completion request it maps onto (`prompt`: its
    token ids); what the completion request has no field for rides along."""

    output_mode: Literal["tokens", "text"] = "tokens"
    detokenize: bool = True
    reasoning_ended: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    _max_tokens_given: bool = PrivateAttr(True)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt  # type: ignore[return-value]

    @property
    def max_tokens_given(self) -> bool:
        return self._max_tokens_given

    @classmethod
    def model_validate(cls, data: Any, **kwargs) -> GenerateBody:  # type: ignore[override]
        outer = GenerateRequest.model_validate(data)
        fields = completion_fields(outer)
        try:
            body = super().model_validate(fields, **kwargs)
        except ValidationError as e:
            raise in_sampling_params(validation_error(e)) from None
        body._max_tokens_given = fields.get("max_tokens") is not None
        return body


def completion_fields(req: GenerateRequest) -> dict[str, Any]:
    """The completion request a generate request maps onto; APIError naming the field
    of what zserve does not serve."""
    for name, reason in _NOT_SERVED.items():
        if getattr(req, name, None) or (req.model_extra or {}).get(name):
            raise APIError(f"{name}: {reason}", param=name)
    params = req.sampling_params
    for name, allowed in _UNSUPPORTED.items():
        if params.get(name) not in allowed:
            raise APIError(
                f"sampling_params.{name}: not supported by zserve",
                param=f"sampling_params.{name}",
            )
    detokenize = params.get("detokenize", True)
    if not isinstance(detokenize, bool):
        raise APIError(
            "sampling_params.detokenize: must be true or false", param="sampling_params.detokenize"
        )
    fields = {name: params[name] for name in SAMPLING_FIELDS if name in params}
    fields.update(
        prompt=req.token_ids,
        model=req.model,
        stream=bool(req.stream),
        stream_options=req.stream_options,
        cache_salt=req.cache_salt,
        priority=req.priority,
        request_id=req.request_id,
        return_token_ids=bool(req.return_token_ids),
        output_mode=req.output_mode,
        detokenize=detokenize,
        reasoning_ended=req.reasoning_ended,
        chat_template_kwargs=(req.reasoning_parser_kwargs or {}).get("chat_template_kwargs"),
    )
    return {k: v for k, v in fields.items() if v is not None}


def in_sampling_params(e: APIError) -> APIError:
    """An error about a mapped field, named where the client wrote it: in
    `sampling_params` (`prompt` is `token_ids`)."""
    message, param = renamed(e.message, e.param)
    return APIError(message, e.status, param, e.headers, e.type)


def renamed(message: str, param: str | None) -> tuple[str, str | None]:
    """in_sampling_params for an error's message and param (a stream's error event)."""
    param = param or ""
    prefix, bare = ("body.", param[5:]) if param.startswith("body.") else ("", param)
    head = bare.split(".")[0]
    if head == "prompt":
        where = "token_ids" + bare[len(head) :]
    elif head in SAMPLING_FIELDS:
        where = f"sampling_params.{bare}"
    else:
        return message, param or None
    if message.startswith(bare):
        message = where + message[len(bare) :]
    return message, prefix + where


def vllm_sampling_params(
    params: SamplingParams, body: SamplingFields, stream: bool
) -> dict[str, Any]:
    """A submitted request's engine parameters (and the text options the API server
    applies) as vLLM's SamplingParams object, which /inference/v1/generate reads."""
    out: dict[str, Any] = {
        "n": body.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
        "stop": body.stop_strings,
        "stop_token_ids": params.stop_token_ids,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "ignore_eos": params.ignore_eos,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "logprob_token_ids": params.logprob_token_ids,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "logit_bias": params.logit_bias,
        "allowed_token_ids": params.allowed_token_ids,
        "structured_outputs": structured_outputs_field(params.structured_outputs),
        "output_kind": 1 if stream else 2,  # vLLM's RequestOutputKind: DELTA, FINAL_ONLY
    }
    return {k: v for k, v in out.items() if v is not None}


def structured_outputs_field(spec: StructuredOutputs | None) -> dict[str, Any] | None:
    """A constraint as the request's `structured_outputs` object (what reads back
    into the same constraint)."""
    if spec is None:
        return None
    kind = spec.kind
    value = getattr(spec, kind)
    out: dict[str, Any] = {kind: json.loads(value) if kind == "json" else value}
    for flag in ("disable_any_whitespace", "disable_additional_properties"):
        if getattr(spec, flag):
            out[flag] = True
    return out


def generate_request(
    body: SamplingFields,
    request_id: str,
    model: str,
    priority: int,
    prompt_ids: list[int],
    params: SamplingParams,
    reasoning_ended: bool | None = None,
    reasoning_parser_kwargs: dict | None = None,
) -> dict[str, Any]:
    """What a /render route answers: the generate request that runs this prompt as the
    route it came from would have (GenerateRequest's fields, vLLM's order)."""
    stream = bool(body.stream)
    options = body.stream_options if stream else None
    return {
        "request_id": request_id,
        "token_ids": prompt_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": vllm_sampling_params(params, body, stream),
        "model": model,
        "reasoning_ended": reasoning_ended,
        "reasoning_parser_kwargs": reasoning_parser_kwargs,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": stream,
        "stream_options": options.model_dump() if options is not None else None,
        "cache_salt": body.cache_salt,
        "priority": priority,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }
