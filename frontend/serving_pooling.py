"""POST /v1/embeddings, /classify and /pooling (--runner pooling): inputs → token ids →
one pooled vector each from the engines (an embedding, or a classifier's label
probabilities) → as floats, base64 or raw bytes."""

from __future__ import annotations

import base64
import json
import sys
import time

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from frontend.chat_prompt import render_messages
from frontend.errors import APIError
from frontend.generation import Generation
from frontend.pooling_input import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingFields,
    PoolingInputs,
    PoolingRequest,
)
from frontend.request_inputs import RequestInputs, read_inputs
from frontend.responses import generation_headers, json_response, run_unless_disconnected
from frontend.sampling import truncation
from frontend.serving import ServingContext
from frontend.serving_completions import prompt_token_ids
from protocol.messages import PoolingParams, SamplingParams

# What a pooling request asks of the engine's sampling fields: nothing is sampled.
_NOTHING_SAMPLED = SamplingParams(max_tokens=1)


async def create_embedding(ctx: ServingContext, request: Request) -> Response:
    return await _pool(ctx, request, EmbeddingRequest, "embd", "embedding", "embedding")


async def create_pooling(ctx: ServingContext, request: Request) -> Response:
    return await _pool(ctx, request, PoolingRequest, "pooling", "pooling", "data")


async def create_classify(ctx: ServingContext, request: Request) -> Response:
    """Each input's label probabilities, its likeliest label named (vLLM's /classify)."""
    inputs = await read_inputs(ctx, request, ClassificationRequest, num_inputs, "input")
    body = inputs.body
    prompts = await input_token_ids(ctx, body)
    vectors, generation = await pool(ctx, inputs, prompts, pooling_params(ctx, body), request)
    labels = ctx.config.pooling.labels or []
    data = []
    for i, probs in enumerate(vectors):
        best = int(np.argmax(probs))
        label = labels[best] if best < len(labels) else None
        data.append(
            {"index": i, "label": label, "probs": probs.tolist(), "num_classes": len(probs)}
        )
    payload = list_body(f"classify-{inputs.request_id}", inputs.model, data, sum(map(len, prompts)))
    return json_response(payload, generation_headers(ctx, generation))


def pooling_params(ctx: ServingContext, body: PoolingFields, dimensions: int | None = None):
    """The engine's pooling parameters: use_activation, or the server's default."""
    activate = body.use_activation
    return PoolingParams(
        use_activation=ctx.config.pooling.normalize if activate is None else activate,
        dimensions=dimensions_of(ctx, dimensions),
    )


async def _pool(
    ctx: ServingContext,
    request: Request,
    model: type[EmbeddingRequest],
    id_prefix: str,
    kind: str,
    key: str,
) -> Response:
    inputs = await read_inputs(ctx, request, model, num_inputs, "input")
    body = inputs.body
    task = ctx.config.pooling.task
    if getattr(body, "task", None) not in (None, task):
        raise APIError(
            f"task: Unsupported task: {body.task!r}; this model's task is {task!r}", param="task"
        )
    params = pooling_params(ctx, body, body.dimensions)
    prompts = await input_token_ids(ctx, body)
    vectors, generation = await pool(ctx, inputs, prompts, params, request)
    headers = generation_headers(ctx, generation)
    num_tokens = sum(map(len, prompts))
    id_ = f"{id_prefix}-{inputs.request_id}"
    created = int(time.time())
    if body.encoding_format in ("bytes", "bytes_only"):
        blobs = [_binary(v, body.embed_dtype, body.endianness) for v in vectors]
        if body.encoding_format == "bytes":
            headers["metadata"] = _metadata(
                id_, created, inputs.model, blobs, vectors, body, num_tokens
            )
        return Response(b"".join(blobs), media_type="application/octet-stream", headers=headers)
    if body.encoding_format == "base64":
        encode = lambda v: base64.b64encode(_binary(v, body.embed_dtype, body.endianness)).decode()  # noqa: E731
    else:
        encode = np.ndarray.tolist
    data = [{"index": i, "object": kind, key: encode(v)} for i, v in enumerate(vectors)]
    return json_response(list_body(id_, inputs.model, data, num_tokens, created), headers)


async def pool(
    ctx: ServingContext,
    inputs: RequestInputs,
    prompts: list[list[int]],
    params: PoolingParams,
    request: Request | None = None,
) -> tuple[list[np.ndarray], Generation]:
    """Each prompt's vector from the engines (float32). The HTTP `request`'s client
    going away aborts them (a gRPC caller's cancellation does by itself)."""
    generation = ctx.submit(inputs, prompts, [_NOTHING_SAMPLED] * len(prompts), pooling=params)
    try:
        if request is None:
            await generation.drain()
        else:
            await run_unless_disconnected(request, generation.drain)
    finally:
        ctx.finish(generation)
    unpooled = [c for c in generation.choices if c.pooled is None]
    if unpooled:  # ended in the engine first: /pause or /sleep aborted it
        raise APIError(
            f"{len(unpooled)} of the request's {len(generation.choices)} inputs ended before "
            f"they were pooled ({unpooled[0].finish_reason}); retry",
            503,
            headers={"Retry-After": "1"},
        )
    return [np.frombuffer(c.pooled, dtype="<f4") for c in generation.choices], generation


def list_body(
    id_: str, model: str, data: list, num_tokens: int, created: int | None = None
) -> dict:
    """The list answer of embeddings, classifications and scores (vLLM's shape)."""
    return {
        "id": id_,
        "object": "list",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "data": data,
        "usage": usage(num_tokens),
    }


def usage(num_tokens: int) -> dict:
    """vLLM's usage of a pooling answer: every input token, nothing generated."""
    return {
        "prompt_tokens": num_tokens,
        "total_tokens": num_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def num_inputs(body: PoolingInputs) -> int:
    """How many vectors the request asks for (at most --max-prompts-per-request)."""
    conversations = body.conversations
    if conversations is not None:
        return len(conversations)
    prompt = body.input
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


async def input_token_ids(ctx: ServingContext, body: PoolingInputs) -> list[list[int]]:
    """Each input's token ids: texts tokenized, conversations rendered first; each may
    fill the context (nothing is generated after it)."""
    conversations = body.conversations
    if conversations is None:
        if body.input == []:
            raise APIError("input: You must pass at least one prompt", param="input")
        prompts = await prompt_token_ids(ctx, body.input, body, "input", room=0)
    else:
        cut = truncation(body, ctx.max_model_len)
        prompts = []
        for conversation in conversations:
            if not conversation:
                raise APIError("messages: a conversation may not be empty", param="messages")
            text = await render_messages(
                ctx,
                conversation,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template=body.chat_template,
                chat_template_kwargs=body.chat_template_kwargs,
                truncating=cut is not None,
            )
            prompts.append(await ctx.encode(text, bool(body.add_special_tokens), cut, room=0))
    if any(not p for p in prompts):
        raise APIError("input: an input has no tokens once tokenized", param="input")
    return prompts


def dimensions_of(ctx: ServingContext, dimensions: int | None, param: str = "dimensions"):
    """`dimensions` (or Cohere's output_dimension), as the model admits it (vLLM's
    wording)."""
    if dimensions is None:
        return None
    options, name = ctx.config.pooling, ctx.model_name
    if not options.matryoshka:
        raise APIError(
            f"Model {name!r} does not support Matryoshka embeddings; dimensions must be "
            f"unset (received {param}={dimensions}).",
            param=param,
        )
    width = ctx.client.engines[0].ready.hidden_size
    if not 1 <= dimensions <= width:
        raise APIError(
            f"Model {name!r} only supports {param} in range [1, {width}], got {dimensions}.",
            param=param,
        )
    allowed = options.matryoshka_dimensions
    if allowed is not None and dimensions not in allowed:
        raise APIError(
            f"Model {name!r} only supports Matryoshka dimensions {allowed}, got {dimensions}.",
            param=param,
        )
    return dimensions


def _binary(vector: np.ndarray, dtype: str, endianness: str) -> bytes:
    """A vector's bytes in the asked type and order (bfloat16: float32's top half,
    rounded to nearest even)."""
    if dtype == "float16":
        out = vector.astype("<f2")
    elif dtype == "bfloat16":
        bits = vector.astype("<f4").view("<u4").astype(np.uint64)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    else:
        out = vector.astype("<f4")
    if (endianness if endianness != "native" else sys.byteorder) == "big":
        out = out.byteswap()
    return out.tobytes()


def _metadata(id_, created, model, blobs, vectors, body, num_tokens) -> str:
    """The `metadata` header of a bytes response: where each vector lies in the body."""
    items, offset = [], 0
    for i, (blob, vector) in enumerate(zip(blobs, vectors)):
        items.append(
            {
                "index": i,
                "embed_dtype": body.embed_dtype,
                "endianness": body.endianness,
                "start": offset,
                "end": offset + len(blob),
                "shape": [len(vector)],
            }
        )
        offset += len(blob)
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    payload = {"id": id_, "created": created, "model": model, "data": items, "usage": usage}
    # ASCII only, as a header must be (the id and model are the client's and ours).
    return json.dumps(payload, separators=(",", ":"))
