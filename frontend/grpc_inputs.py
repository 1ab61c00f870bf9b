"""Step one of a gRPC Generate: the request's fields read and checked, cheapest first,
into what ServingContext.submit takes.

The sampling fields go through the HTTP path's own checks: the same pydantic model
(ranges, NaN, stop strings, logit_bias keys), the same limits, the same
`sampling_params()` (lengths, logprob counts, token ids, the model's defaults), so the
two doors accept and refuse alike. A proto3 scalar without presence cannot say "unset":
zero there means the server's default, as an absent JSON field does.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from pydantic import ValidationError
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from frontend.errors import APIError
from frontend.limits import check_fan_out, check_request_id, check_stop_strings
from frontend.openai_models import SamplingFields
from frontend.pooling_input import PoolingFields
from frontend.request_inputs import RequestInputs, validation_error
from frontend.sampling import check_token_ids, context_length_error, sampling_params, truncation
from frontend.structured_outputs import constraint
from frontend.tracing import trace_headers
from protocol.messages import SamplingParams, StructuredOutputs

if TYPE_CHECKING:
    from frontend.serving import ServingContext

# The proto's structured-output constraints (the `constraint` oneof).
STRUCTURED_OUTPUT_FIELDS = ("json_schema", "regex", "grammar", "structural_tag", "json_object")


@dataclass(frozen=True, slots=True)
class GenerateInputs:
    """A Generate request once every check passed: ready for ctx.submit."""

    inputs: RequestInputs[SamplingFields]
    prompt: list[int]
    params: SamplingParams


async def read_generate(
    ctx: ServingContext, request: pb.GenerateRequest, metadata=()
) -> GenerateInputs:
    """Server state, then the request's own fields, then the prompt: each refusal
    before the next cost. `metadata`: the call's, for a W3C trace context when traced."""
    ctx.preflight()
    if request.request_id:
        check_request_id(request.request_id, "request_id", ctx.limits)
    refuse_unsupported(request)
    sp = request.sampling_params
    body = sampling_fields(sp, prompt_logprobs=_logprob_count(ctx, sp, "prompt_logprobs"))
    check_stop_strings(body.stop_strings, ctx.limits)
    check_fan_out(1, body.n, ctx.limits)
    engine_rank = None
    if request.HasField("data_parallel_rank"):
        engine_rank = check_rank(request.data_parallel_rank, len(ctx.client.engines))
    prompt = await prompt_ids(ctx, request, body)
    (params,) = sampling_params(
        ctx,
        body,
        [prompt],
        max_tokens=_max_tokens(sp),
        logprobs=_logprob_count(ctx, sp, "logprobs"),
    )
    spec = output_constraint(ctx, sp)
    if spec is not None:
        params = msgspec.structs.replace(params, structured_outputs=spec)
    request_id = request.request_id or uuid.uuid4().hex
    traced = trace_headers(dict(metadata)) if ctx.tracer is not None else None
    return GenerateInputs(
        RequestInputs(body, ctx.model_name, request_id, 0, engine_rank, trace_headers=traced),
        prompt,
        params,
    )


def refuse_unsupported(request: pb.GenerateRequest) -> None:
    """What this server cannot do is refused by name, never ignored: ignoring a field
    would answer as if it had been honoured."""
    for field in ("mm_inputs", "media_refs"):
        if request.HasField(field):
            raise APIError(f"{field}: this server serves text-only models", param=field)
    if request.extra_mm_inputs:
        raise APIError(
            "extra_mm_inputs: this server serves text-only models", param="extra_mm_inputs"
        )
    for field in ("kv_transfer_params", "kv_transfer_params_json"):
        if request.HasField(field):
            raise APIError(
                f"{field}: this server has no KV connector (disaggregated prefill is not "
                f"supported)",
                param=field,
            )


def sampling_fields(sp: pb.SamplingParams, prompt_logprobs: int | None = None) -> SamplingFields:
    """The proto's sampling fields as the HTTP path's model, validated by it."""
    fields = {
        "n": sp.n or 1,
        "temperature": sp.temperature if sp.HasField("temperature") else None,
        "top_p": sp.top_p or None,
        "top_k": sp.top_k or None,
        "min_p": sp.min_p or None,
        "presence_penalty": sp.presence_penalty or None,
        "frequency_penalty": sp.frequency_penalty or None,
        "repetition_penalty": sp.repetition_penalty or None,
        "seed": sp.seed if sp.HasField("seed") else None,
        "stop": list(sp.stop) or None,
        "stop_token_ids": list(sp.stop_token_ids) or None,
        "include_stop_str_in_output": sp.include_stop_str_in_output,
        "ignore_eos": sp.ignore_eos,
        "min_tokens": sp.min_tokens,
        "logit_bias": {str(k): v for k, v in sp.logit_bias.items()} or None,
        "skip_special_tokens": sp.skip_special_tokens,
        "spaces_between_special_tokens": sp.spaces_between_special_tokens,
        "prompt_logprobs": prompt_logprobs,
        "truncate_prompt_tokens": (
            sp.truncate_prompt_tokens if sp.HasField("truncate_prompt_tokens") else None
        ),
    }
    try:
        return SamplingFields.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e) from None


def check_rank(rank: int, num_engines: int) -> int:
    if not 0 <= rank < num_engines:
        raise APIError(
            f"data_parallel_rank {rank} is out of range: this server has {num_engines} "
            f"engine(s), ranks 0..{num_engines - 1}",
            param="data_parallel_rank",
        )
    return rank


async def prompt_ids(
    ctx: ServingContext, request: pb.GenerateRequest, body: SamplingFields
) -> list[int]:
    """The prompt's token ids (the gateway's usual input), or the text tokenized here;
    cut to its last truncate_prompt_tokens. A too-long prompt is refused before its
    ids are copied out of the message (cut copies them: a prompt within the limits)."""
    cut = truncation(body, ctx.max_model_len)
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        given = request.tokenized.input_ids
        if not given:
            raise APIError("tokenized.input_ids may not be empty", param="tokenized.input_ids")
        if cut is None and len(given) >= ctx.max_model_len:
            raise context_length_error(len(given), ctx.max_model_len)
        ids = cut.apply(list(given)) if cut else list(given)
        check_token_ids(ids, ctx.vocab_size, "tokenized.input_ids")
        return ids
    if kind == "text":
        ctx.check_text_length(request.text, "text", truncating=cut is not None)
        return await ctx.encode(request.text, True, cut)
    raise APIError(
        "the request has no input: send tokenized.input_ids (or text)", param="tokenized"
    )


def _max_tokens(sp: pb.SamplingParams) -> int | None:
    """None (unset): what the context leaves after the prompt, as in vLLM."""
    if not sp.HasField("max_tokens"):
        return None
    if sp.max_tokens == 0:
        raise APIError("max_tokens must be at least 1, got 0", param="max_tokens")
    return sp.max_tokens


def _logprob_count(ctx: ServingContext, sp: pb.SamplingParams, field: str) -> int | None:
    """`-1` asks for the whole vocabulary: allowed only with --max-logprobs -1.
    (sampling_params() checks every other count against --max-logprobs.)"""
    if not sp.HasField(field):
        return None
    value = getattr(sp, field)
    if value == -1:
        if ctx.config.max_logprobs != -1:
            raise APIError(
                f"{field} -1 asks for the whole vocabulary ({ctx.vocab_size} tokens); this "
                f"server allows at most {ctx.config.max_logprobs} (--max-logprobs)",
                param=field,
            )
        return ctx.vocab_size
    return value


# The proto's constraint oneof → StructuredOutputs' fields.
_CONSTRAINTS = {
    "json_schema": "json",
    "regex": "regex",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
    "json_object": "json_object",
    "choice": "choice",
}


def output_constraint(ctx: ServingContext, sp: pb.SamplingParams) -> StructuredOutputs | None:
    """The request's structured-output constraint (the same limits and compiler as the
    HTTP path's; a grammar that fails to compile is an INVALID_ARGUMENT naming it)."""
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    value = getattr(sp, kind)
    if kind == "choice":
        value = list(value.choices)
    return constraint(
        _CONSTRAINTS[kind], value, f"sampling_params.{kind}", ctx.config.structured_outputs
    )


async def read_embed(
    ctx: ServingContext, request: pb.EmbedRequest, metadata=()
) -> tuple[RequestInputs, list[int]]:
    """An Embed request's inputs and prompt: its token ids (or, without them, its text
    tokenized here), within the vocabulary and the context."""
    ctx.preflight()
    if request.request_id:
        check_request_id(request.request_id, "request_id", ctx.limits)
    tokenized = request.tokenized
    if tokenized.input_ids:
        prompt = list(tokenized.input_ids)
        check_token_ids(prompt, ctx.vocab_size, "tokenized.input_ids")
        if len(prompt) > ctx.max_model_len:
            raise context_length_error(len(prompt), ctx.max_model_len, room=0)
    elif tokenized.original_text:
        ctx.check_text_length(tokenized.original_text, "tokenized.original_text")
        prompt = await ctx.encode(tokenized.original_text, True, room=0)
    else:
        raise APIError("tokenized.input_ids: give the input's token ids", param="tokenized")
    request_id = request.request_id or uuid.uuid4().hex
    traced = trace_headers(dict(metadata)) if ctx.tracer is not None else None
    body = PoolingFields()
    return RequestInputs(body, ctx.model_name, request_id, 0, None, trace_headers=traced), prompt
