"""POST /score and /rerank (and their /v1, /v2 paths) on a --runner pooling server.

An embedding model (vLLM's bi-encoder scoring): each query and document embedded once,
each pair scored by the cosine of its two vectors. A one-label classifier (a
cross-encoder): each pair read as one input, as the tokenizer joins a pair (or as one
text: an LLM as reranker), scored by the classifier's probability.
"""

from __future__ import annotations

import asyncio

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from frontend.chat_prompt import render_template, template_kwargs
from frontend.errors import APIError
from frontend.pooling_input import RerankRequest, ScoreRequest, ScoringFields
from frontend.request_inputs import read_inputs
from frontend.responses import generation_headers, json_response
from frontend.sampling import context_length_error, truncation
from frontend.serving import ServingContext
from frontend.serving_pooling import list_body, pool, pooling_params
from frontend.tokenizer_pool import INLINE_CHARS
from protocol.messages import PoolingParams


async def create_score(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, ScoreRequest, _num_texts, "documents")
    body = inputs.body
    first, second = body.sides
    scores, num_tokens, headers = await _scores(ctx, request, inputs, first, second)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return json_response(
        list_body(f"score-{inputs.request_id}", inputs.model, data, num_tokens), headers
    )


async def create_rerank(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, RerankRequest, _num_texts, "documents")
    body = inputs.body
    scores, num_tokens, headers = await _scores(ctx, request, inputs, "query", "documents")
    documents = _texts(body.documents)
    results = [
        {"index": i, "document": {"text": documents[i], "multi_modal": None}, "relevance_score": s}
        for i, s in enumerate(scores)
    ]
    results.sort(key=lambda r: r["relevance_score"], reverse=True)
    if 0 < body.top_n < len(results):
        results = results[: body.top_n]
    payload = {
        "id": f"score-{inputs.request_id}",
        "model": inputs.model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": results,
    }
    return json_response(payload, headers)


async def _scores(ctx: ServingContext, request: Request, inputs, first: str, second: str):
    """The cosine of each (query, document) pair: one query against every document, or
    the i-th against the i-th; and the tokens embedded (each text once)."""
    body: ScoringFields = inputs.body
    queries, documents = _texts(getattr(body, first)), _texts(getattr(body, second))
    if not queries:
        raise APIError(f"{first}: At least one text element must be given", param=first)
    if not documents:
        raise APIError(f"{second}: At least one text_pair element must be given", param=second)
    if len(queries) > 1 and len(queries) != len(documents):
        raise APIError(
            f"{first}: Input lengths must be either 1:1, 1:N or N:N (got {len(queries)} "
            f"{first} and {len(documents)} {second})",
            param=first,
        )
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        if getattr(body, name) >= ctx.max_model_len:
            raise APIError(
                f"{name} ({getattr(body, name)}) must be less than max_model_len "
                f"({ctx.max_model_len}).",
                param=name,
            )
    if ctx.config.pooling.task == "classify":
        return await _cross_encoded(ctx, request, inputs, queries, documents, (first, second))
    prompts = [
        *[await _token_ids(ctx, body, t, body.max_tokens_per_query, first) for t in queries],
        *[await _token_ids(ctx, body, t, body.max_tokens_per_doc, second) for t in documents],
    ]
    vectors, generation = await pool(ctx, inputs, prompts, PoolingParams(), request)
    headers = generation_headers(ctx, generation)
    left, right = np.stack(vectors[: len(queries)]), np.stack(vectors[len(queries) :])
    # Unit vectors already: the cosine is the dot product (a query row broadcasts).
    scores = np.einsum("ij,ij->i", np.broadcast_to(left, right.shape), right)
    return scores.tolist(), sum(map(len, prompts)), headers


async def _cross_encoded(ctx, request, inputs, queries, documents, sides):
    """Each (query, document) pair's probability from a one-label classifier."""
    body: ScoringFields = inputs.body
    cut = truncation(body, ctx.max_model_len)
    queries = [await _first(ctx, q, body.max_tokens_per_query, sides[0], cut) for q in queries]
    prompts = []
    for i, document in enumerate(documents):
        document = await _first(ctx, document, body.max_tokens_per_doc, sides[1], cut)
        query = queries[0 if len(queries) == 1 else i]
        if ctx.config.chat_template is None:
            prompts.append(await _pair_ids(ctx, query, document, cut))
        else:
            text = await _score_template(ctx, body, query, document, cut is not None)
            prompts.append(await ctx.encode(text, True, cut, room=0))
    vectors, generation = await pool(ctx, inputs, prompts, pooling_params(ctx, body), request)
    scores = [float(v[0]) for v in vectors]
    return scores, sum(map(len, prompts)), generation_headers(ctx, generation)


async def _first(ctx: ServingContext, text: str, at_most: int, field: str, cut) -> str:
    """The text, cut to its first `at_most` tokens (0: whole; then it must fit)."""
    if at_most:
        if len(text) > INLINE_CHARS:
            return await asyncio.to_thread(_first_tokens, ctx, text, at_most)
        return _first_tokens(ctx, text, at_most)
    ctx.check_text_length(text, field, truncating=cut is not None)
    return text


async def _pair_ids(ctx: ServingContext, query: str, document: str, cut) -> list[int]:
    """A pair's token ids: the tokenizer's pair (its separators between the two), or with
    use_sep_token off the two texts as one (vLLM's default for an LLM as reranker)."""
    raw = ctx.renderer.raw

    def encode() -> list[int]:
        if ctx.config.pooling.use_sep_token:
            return raw.encode(query, document, add_special_tokens=True).ids
        return raw.encode(query + document, add_special_tokens=True).ids

    long = len(query) + len(document) > INLINE_CHARS
    ids = await asyncio.to_thread(encode) if long else encode()
    if cut is not None:
        return cut.apply(ids)
    if len(ids) > ctx.max_model_len:
        raise context_length_error(len(ids), ctx.max_model_len, room=0)
    return ids


async def _score_template(
    ctx: ServingContext, body: ScoringFields, query: str, doc: str, truncating: bool
) -> str:
    """The pair through the server's --chat-template as the messages of roles query and
    document (vLLM's score template; `instruction` is a template variable too)."""
    kwargs = template_kwargs(ctx, body.chat_template_kwargs)
    if body.instruction is not None:
        kwargs.setdefault("instruction", body.instruction)
    messages = [{"role": "query", "content": query}, {"role": "document", "content": doc}]
    return await render_template(
        ctx, messages, "documents", truncating, add_generation_prompt=False, template_kwargs=kwargs
    )


def _texts(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _num_texts(body: ScoringFields) -> int:
    """The texts embedded (at most --max-prompts-per-request)."""
    first, second = body.sides
    return len(_texts(getattr(body, first))) + len(_texts(getattr(body, second)))


async def _token_ids(
    ctx: ServingContext, body: ScoringFields, text: str, at_most: int, field: str
) -> list[int]:
    """A text's token ids: cut to its first `at_most` tokens first (0: whole, else the
    text may be longer than the context), then tokenized with the special tokens."""
    cut = truncation(body, ctx.max_model_len)
    text = await _first(ctx, text, at_most, field, cut)
    ids = await ctx.encode(text, True, cut, room=0)
    if not ids:
        raise APIError(f"{field}: a text has no tokens once tokenized", param=field)
    return ids


def _first_tokens(ctx: ServingContext, text: str, n: int) -> str:
    """The text up to the end of its n-th token (no special tokens counted), cut where
    a token starts so that it tokenizes to at most n tokens."""
    # No token spans more than max_token_chars characters: the first n lie in this
    # prefix (with room for the words around the n-th), so a long text is not read whole.
    text = text[: (n + 16) * ctx.renderer.max_token_chars]
    for _ in range(4):  # a cut may re-merge into fewer tokens: then it holds; rarely more
        offsets = ctx.renderer.raw.encode(text, add_special_tokens=False).offsets
        if len(offsets) <= n:
            return text
        text = text[: min(offsets[n - 1][1], offsets[n][0])]
    return text
