"""POST /v2/embed on an embedding server (--runner pooling): Cohere's embed API, as vLLM
serves it (the `cohere` client's ClientV2.embed). Texts, or inputs of text parts rendered
by the chat template; an input_type the model has a prompt for prefixes each (as a
system message where the model has a chat template); Cohere's truncation; the vectors
as floats, packed sign bits or base64."""

from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from frontend.chat_prompt import render_messages
from frontend.errors import APIError
from frontend.openai_models import ChatMessage
from frontend.pooling_input import CohereEmbedRequest
from frontend.request_inputs import read_inputs
from frontend.responses import generation_headers, json_response
from frontend.sampling import Truncation
from frontend.serving import ServingContext
from frontend.serving_pooling import dimensions_of, pool
from protocol.messages import PoolingParams


async def create_cohere_embedding(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, CohereEmbedRequest, _num_inputs, "texts")
    body = inputs.body
    prefix = _task_prefix(ctx, body.input_type)
    cut = _truncation(ctx, body)
    if body.inputs is not None:
        conversations = [[{"type": "text", "text": c.text} for c in i.content] for i in body.inputs]
        prompts = [await _rendered(ctx, parts, prefix, cut) for parts in conversations]
    elif prefix is not None and ctx.renderer.has_chat_template:
        parts = [[{"type": "text", "text": t}] for t in body.texts]
        prompts = [await _rendered(ctx, p, prefix, cut) for p in parts]
    else:
        prompts = [await _encoded(ctx, (prefix or "") + t, cut) for t in body.texts]
    if body.truncate == "NONE" and body.max_tokens is not None:
        for prompt in prompts:
            if len(prompt) > body.max_tokens:
                raise APIError(
                    f"max_tokens: Input of {len(prompt)} tokens exceeds max_tokens="
                    f"{body.max_tokens} with truncate=NONE. Set truncate to END or START to "
                    "allow truncation.",
                    param="max_tokens",
                )
    types = body.embedding_types or ["float"]
    dims = dimensions_of(ctx, body.output_dimension, "output_dimension")
    width = dims or ctx.client.engines[0].ready.hidden_size
    if width % 8 and {"binary", "ubinary"} & set(types):
        raise APIError(
            f"embedding_types: binary types need a dimension that is a multiple of 8; got {width}",
            param="embedding_types",
        )
    params = PoolingParams(use_activation=ctx.config.pooling.normalize, dimensions=dims)
    vectors, generation = await pool(ctx, inputs, prompts, params, request)
    num_tokens = sum(map(len, prompts))
    payload = {
        "id": f"embd-{inputs.request_id}",
        "embeddings": {t: _typed(vectors, t) for t in dict.fromkeys(types)},
        **({"texts": body.texts} if body.texts is not None else {}),
        "meta": {
            "api_version": {"version": "2"},
            "billed_units": {"input_tokens": num_tokens, "image_tokens": 0},
        },
        "response_type": "embeddings_by_type",
    }
    return json_response(payload, generation_headers(ctx, generation))


def _num_inputs(body: CohereEmbedRequest) -> int:
    return len(body.texts if body.texts is not None else body.inputs)


def _task_prefix(ctx: ServingContext, input_type: str | None) -> str | None:
    """The model's prompt for `input_type` (None: none asked, or an empty one)."""
    if input_type is None:
        return None
    prompts = ctx.config.pooling.task_instructions
    if not prompts:
        raise APIError(
            f"input_type: Unsupported input_type {input_type!r}. This model does not define "
            "any input_type task instructions.",
            param="input_type",
        )
    if input_type not in prompts:
        raise APIError(
            f"input_type: Unsupported input_type {input_type!r}. Supported values: "
            f"{', '.join(sorted(prompts))}",
            param="input_type",
        )
    return prompts[input_type] or None


def _truncation(ctx: ServingContext, body: CohereEmbedRequest) -> Truncation | None:
    """END keeps the first max_tokens tokens (the context's worth by default), START the
    last; NONE cuts nothing."""
    if body.truncate == "NONE":
        return None
    count = min(body.max_tokens or ctx.max_model_len, ctx.max_model_len)
    return Truncation(count, left=body.truncate == "START")


async def _encoded(ctx: ServingContext, text: str, cut: Truncation | None) -> list[int]:
    ctx.check_text_length(text, "texts", truncating=cut is not None)
    ids = await ctx.encode(text, True, cut, room=0)
    if not ids:
        raise APIError("texts: a text has no tokens once tokenized", param="texts")
    return ids


async def _rendered(
    ctx: ServingContext, parts: list[dict], prefix: str | None, cut: Truncation | None
) -> list[int]:
    """An input's text parts as the user's message (after the prefix as the system's),
    through the chat template, as vLLM renders Cohere inputs."""
    messages = [ChatMessage(role="user", content=parts)]
    if prefix is not None:
        messages.insert(0, ChatMessage(role="system", content=prefix))
    text = await render_messages(
        ctx,
        messages,
        add_generation_prompt=False,
        continue_final_message=False,
        truncating=cut is not None,
    )
    ids = await ctx.encode(text, False, cut, room=0)
    if not ids:
        raise APIError("inputs: an input has no tokens once rendered", param="inputs")
    return ids


def _typed(vectors: list[np.ndarray], kind: str) -> list:
    """The vectors as Cohere's type: float; binary / ubinary, each dimension's sign bit
    (set: >= 0) packed eight to a byte, first bit highest (binary: less 128); base64 of
    little-endian float32."""
    if kind == "float":
        return [v.tolist() for v in vectors]
    if kind == "base64":
        return [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    packed = np.packbits(np.stack(vectors) >= 0, axis=-1).astype(np.int16)
    return (packed - 128 if kind == "binary" else packed).tolist()
