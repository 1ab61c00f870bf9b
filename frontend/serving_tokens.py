"""POST /tokenize, POST /detokenize, GET /tokenizer_info."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from frontend.chat_prompt import render_messages
from frontend.errors import APIError
from frontend.openai_models import DetokenizeRequest, TokenizeRequest
from frontend.request_inputs import parse_body
from frontend.responses import json_response
from frontend.sampling import check_token_ids
from frontend.serving import ServingContext
from frontend.tokenizer_pool import INLINE_CHARS


async def tokenize(ctx: ServingContext, request: Request) -> Response:
    body = await parse_body(ctx, request, TokenizeRequest)
    await ctx.resolve_target(body.model)
    if body.messages is not None:
        text = await render_messages(
            ctx,
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        add_special = bool(body.add_special_tokens)  # chat templates carry their own specials
    else:
        text = body.prompt
        add_special = body.add_special_tokens is not False
    if len(text) > INLINE_CHARS and ctx.tokenizers is not None:
        # The worker writes the JSON lists: no per-token work on this loop.
        count, tokens, strs = await ctx.tokenizers.tokenize_json(
            text, add_special, body.return_token_strs
        )
        payload = b'{"count":%d,"max_model_len":%d,"tokens":%s,"token_strs":%s}' % (
            count,
            ctx.max_model_len,
            tokens,
            strs,
        )
        return Response(payload, media_type="application/json")
    if len(text) > INLINE_CHARS:
        ids = await asyncio.to_thread(ctx.renderer.encode, text, add_special)
    else:
        ids = ctx.renderer.encode(text, add_special)
    token_strs = (
        ctx.renderer.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    )
    return json_response(
        {
            "count": len(ids),
            "max_model_len": ctx.max_model_len,
            "tokens": ids,
            "token_strs": token_strs,
        }
    )


async def detokenize(ctx: ServingContext, request: Request) -> Response:
    body = await parse_body(ctx, request, DetokenizeRequest)
    await ctx.resolve_target(body.model)
    check_token_ids(body.tokens, ctx.vocab_size, "tokens")
    return json_response({"prompt": await ctx.decode(body.tokens)})


async def tokenizer_info(ctx: ServingContext, request: Request) -> Response:
    if not ctx.config.enable_tokenizer_info_endpoint:
        raise APIError(
            "/tokenizer_info is disabled; start the server with --enable-tokenizer-info-endpoint",
            404,
        )
    path = Path(ctx.config.tokenizer_dir) / "tokenizer_config.json"
    info = json.loads(path.read_text()) if path.is_file() else {}
    tok = ctx.renderer.tokenizer
    info.update(
        {
            "tokenizer_class": info.get("tokenizer_class") or type(tok).__name__,
            "model_max_length": max(int(info.get("model_max_length") or 0), ctx.max_model_len),
            "vocab_size": ctx.vocab_size,
            "eos_token_ids": ctx.eos_token_ids,
        }
    )
    if "chat_template" not in info and tok.chat_template:
        info["chat_template"] = tok.chat_template
    info.pop("added_tokens_decoder", None)
    return json_response(info)
