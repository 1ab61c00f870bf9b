"""The /render routes (--enable-scale-out): a chat, completion, Messages or Responses
request rendered, not run. The answer is the generate request (generate_input.py)
that POST /inference/v1/generate runs as the route itself would have: the prompt as
token ids after the chat template, and the engine parameters after every check and
default, output constraints (forced tool calls included) and where they start.

Nothing is submitted, so no engine is asked; the API server's checks and limits are
the routes' own. What a token-only request cannot carry is refused: beam search,
completions' echo (the prompt text) and a max_tokens of 0.
"""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.chat_tools import reasoning_end_ids
from frontend.errors import APIError
from frontend.generate_input import generate_request
from frontend.openai_models import ChatCompletionRequest, CompletionRequest
from frontend.request_inputs import RequestInputs, read_inputs
from frontend.serving import ServingContext
from frontend.serving_anthropic import messages_chat
from frontend.serving_chat import encode_plain, plan_chat
from frontend.serving_completions import num_prompts, plan_completion
from frontend.serving_responses import responses_chat


def _renderable(body) -> None:
    if body.use_beam_search:
        raise APIError(
            "use_beam_search: beam search is not supported by the render endpoints",
            param="use_beam_search",
        )


async def _render_chat(
    ctx: ServingContext, inputs: RequestInputs, request_id: str, max_tokens_field: str | None
) -> dict:
    _renderable(inputs.body)
    plan = await plan_chat(ctx, inputs, max_tokens_field)
    ended = kwargs = None
    if plan.parser is not None and plan.parser.reasoning is not None:
        # True: constrain from the first token (the output starts past any reasoning).
        ended = reasoning_end_ids(ctx.chat_parsers, plan.parser, encode_plain(ctx)) is None
        kwargs = {"chat_template_kwargs": inputs.body.chat_template_kwargs or {}}
    return generate_request(
        inputs.body,
        request_id,
        inputs.model,
        inputs.priority,
        plan.prompt_ids,
        plan.params,
        reasoning_ended=ended,
        reasoning_parser_kwargs=kwargs,
    )


async def render_chat_completion(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, ChatCompletionRequest)
    return JSONResponse(await _render_chat(ctx, inputs, f"chatcmpl-{inputs.request_id}", None))


async def render_messages(ctx: ServingContext, request: Request) -> Response:
    inputs, chat = await messages_chat(ctx, request)
    inputs = dataclasses.replace(inputs, body=chat)
    return JSONResponse(
        await _render_chat(ctx, inputs, f"chatcmpl-{inputs.request_id}", "max_tokens")
    )


async def render_responses(ctx: ServingContext, request: Request) -> Response:
    inputs, chat = await responses_chat(ctx, request)
    inputs = dataclasses.replace(inputs, body=chat)
    return JSONResponse(
        await _render_chat(ctx, inputs, f"resp_{inputs.request_id}", "max_output_tokens")
    )


async def render_completion(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, CompletionRequest, num_prompts)
    body = inputs.body
    _renderable(body)
    if body.echo:
        raise APIError(
            "echo: a rendered request carries token ids only; send echo to /v1/completions",
            param="echo",
        )
    if body.max_tokens == 0:
        raise APIError(
            "max_tokens: 0 generates nothing; a rendered request needs at least 1",
            param="max_tokens",
        )
    prompts, params = await plan_completion(ctx, body)
    base = f"cmpl-{inputs.request_id}"
    return JSONResponse(
        [
            generate_request(
                body,
                base if len(prompts) == 1 else f"{base}-{i}",
                inputs.model,
                inputs.priority,
                prompt,
                prompt_params,
            )
            for i, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True))
        ]
    )
